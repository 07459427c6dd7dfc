"""What a position of attention costs on this machine, measured at load on the path that serves.

The scheduler prices a long prompt's chunk beside decoding sequences in tokens, where a token at
position p counts 1 + p / attention_span: its attention over the p positions before it grows
with p, while its linears do not. attention_span is the number of positions whose attention
costs what one token's linears do. It depends on the machine as much as on the model: the C++
prefill kernel (bfloat16 on AVX512-BF16) attends several times faster than PyTorch's SDPA in
float32 on an AVX2 CPU, against linears whose speed differs less. A constant from one CPU starved
the streams on another, so the engine measures it once at load: the attention of a chunk of
CHUNK tokens at two depths of a scratch cache, against the model's linears over the same tokens.
Both are measured as serving meets them, out of the CPU's caches: between two visits of one
layer's keys a step reads every other layer's keys and every weight. So the attention runs over
scratch layers that together exceed COLD_BYTES, and the linears over every layer.

The measurement takes a few tenths of a second, a large part of a warm reload, and gives the same
figure for the same model, path and machine within its noise: `remembered` keeps it in the cache
under a key of all it depends on, and a later load reads it back.
"""

from __future__ import annotations

import time

import torch

from workers.engine import attention

CHUNK = 16  # query tokens of the measured chunk
NEAR, FAR = 128, 2048  # the chunk's first positions in the two measurements
REPEATS = 3  # best of: the timings of a loaded machine are noisy
COLD_BYTES = 96 << 20  # more than a CPU's last-level cache: the scratch layers' keys and values
SPAN_LIMITS = (16, 1 << 20)


def best_seconds(fn, repeats: int = REPEATS) -> float:
    """The fastest of `repeats` calls of fn, after a warm-up call."""
    fn()  # warm-up: first-touch of the scratch memory, one-off set-up in the kernels
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def chunk_step(backend, n: int, start: int, block_size: int, windows: list, group: int = 0) -> attention.StepContext:
    """A step of one chunk of n tokens at positions start.. attending in cache group `group` over
    blocks in order (block b holds positions b * block_size..), laid out as `backend` routes it: in
    the prefill kernel's table, or among the library's segments (AttentionBackend.library_prefill)."""
    blocks = list(range(-(-(start + n) // block_size)))
    positions = torch.arange(start, start + n)
    gs = attention.GroupStep(positions // block_size, positions % block_size)
    library = backend.library_prefill is not None and backend.library_prefill(n, start + n)
    gs.library_segments = [0] if library else []
    gs.prefill_blocks = torch.tensor([] if library else blocks, dtype=torch.long)
    gs.prefill_table = torch.tensor([] if library else [(0, n, start, 0, 0)], dtype=torch.long).view(-1, 5)
    seg = attention.Segment(0, n, start, [blocks if start else None] * len(windows), [0] * len(windows))
    groups = [gs if i == group else attention.GroupStep(gs.write_blocks, gs.write_offsets) for i in range(len(windows))]
    return attention.StepContext(num_decode=0, num_tokens=n, groups=groups, segments=[seg],
                                 position={0: (group, 0)}, windows=windows, backend=backend)


def _attention_seconds(holder: attention.ContextHolder, backend, layer: int, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]], start: int, block_size: int,
                       scaling: float) -> float:
    """Attention for a chunk of len(q) tokens at positions start.. over each scratch cache in turn
    (blocks in order: block b holds positions b * block_size..), per cache."""
    g = holder.position[layer][0]
    n = q.shape[0]

    def run() -> None:
        for keys, values in caches:
            ctx = chunk_step(backend, n, start, block_size, holder.windows, g)
            ctx.position = holder.position
            attention.attend(ctx, q, k, v, keys, values, layer, scaling, None, None)

    return best_seconds(run) / len(caches)


def attention_span(holder: attention.ContextHolder, backend, linears: list, layers: int, heads: int, kv_heads: int,
                   head_dim: int, block_size: int, dtype: torch.dtype, device: torch.device) -> int | None:
    """Positions whose attention costs what a token's linears do, measured here; None where no
    layer attends over its whole context (sliding windows bound every chunk's attention) or the
    linears are not at hand. `linears`: (callable on [tokens, in] rows, in) of every layer, whose
    count is `layers`; `backend`: the attention kernels that serve (workers.engine.attention_backend)."""
    layer = next((i for i, (g, p) in sorted(holder.position.items()) if p == 0 and holder.windows[g] is None), None)
    if layer is None or not linears:
        return None
    gen = torch.Generator(device="cpu").manual_seed(0)
    nb = -(-(FAR + CHUNK) // block_size)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.5).to(dtype=dtype, device=device)

    per_layer = 2 * nb * kv_heads * block_size * head_dim * torch.finfo(dtype).bits // 8
    copies = max(1, min(layers, -(-COLD_BYTES // per_layer)))
    caches = [(rand(1, nb, kv_heads, block_size, head_dim), rand(1, nb, kv_heads, block_size, head_dim))
              for _ in range(copies)]
    q, k, v = rand(CHUNK, heads, head_dim), rand(CHUNK, kv_heads, head_dim), rand(CHUNK, kv_heads, head_dim)
    scaling = head_dim ** -0.5
    with torch.inference_mode():
        near = _attention_seconds(holder, backend, layer, q, k, v, caches, NEAR, block_size, scaling)
        far = _attention_seconds(holder, backend, layer, q, k, v, caches, FAR, block_size, scaling)
        inputs = [(fn, rand(CHUNK, width)) for fn, width in linears]
        lin = best_seconds(lambda: [fn(x) for fn, x in inputs]) / layers
    del caches
    per_position = (far - near) / (CHUNK * (FAR - NEAR))
    if per_position <= 0:  # noise larger than the difference: attention is cheap here
        return SPAN_LIMITS[1]
    span = lin / CHUNK / per_position
    return int(min(max(span, SPAN_LIMITS[0]), SPAN_LIMITS[1]))
