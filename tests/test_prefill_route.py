"""The prompt chunks' route between the C++ prefill kernel and PyTorch's SDPA: picked from timings
as the row kernels are, exact either way, and never reading a position a chunk does not hold."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from support.prefill import CHUNKS, reference_chunk, scattered_pool

from workers.capability import cpu_capability
from workers.engine import Engine, EngineConfig, attention
from workers.engine.cpu import extension, prefill_route
from workers.engine.cpu.backend import attention_kernels
from workers.engine.cpu.prefill_route import PrefillRoute, route_of
from workers.engine.cpu.runner import PREFILL_NOTE
from workers.engine.params import SamplingParams
from workers.models import load_model


def _kernel_backend(dtype: torch.dtype, head_dim: int):
    need = "avx512_bf16" if dtype == torch.bfloat16 else "avx2"
    if not cpu_capability().at_least(need):
        pytest.skip(f"the {dtype} prefill kernel needs the {need} level; this run is at {cpu_capability().level}")
    backend = attention_kernels(dtype, head_dim)
    assert backend.prefill is not None, extension.build_error()
    return backend


def test_the_library_takes_a_cell_only_where_it_and_every_larger_one_won():
    kernel, fast, level = 1.0, 0.5, 0.95  # level: within the margin, so the kernel keeps it
    seconds = {(16, 256): (kernel, level), (16, 4096): (kernel, level),
               (64, 256): (kernel, fast),  # won, but a larger cell (64, 1024) did not: not taken
               (64, 1024): (kernel, level), (64, 4096): (kernel, fast),
               (256, 256): (kernel, fast), (256, 1024): (kernel, fast), (256, 4096): (kernel, fast)}
    route = route_of(seconds)
    assert route.cells == ((64, 4096), (256, 256))  # (256, 1024) and (256, 4096) lie beyond (256, 256)
    assert route(64, 5000) and route(300, 256) and route(512, 8000)
    assert not route(64, 300) and not route(16, 8000) and not route(200, 1000)
    assert route_of(seconds) == route  # the same timings, the same route
    assert route_of({cell: (kernel, level) for cell in seconds}) == PrefillRoute()
    assert not PrefillRoute()(512, 1 << 20)
    assert "SDPA" in route.describe() and "kernel" in PrefillRoute().describe()


def test_a_chunk_whose_masks_would_outgrow_the_bound_stays_on_the_kernel():
    limit = prefill_route.mask_limit(9, 3, torch.bfloat16)  # 3 query heads a KV head, 1 + 2 bytes a pair
    assert limit * 3 * 3 <= prefill_route.MASK_BYTES < (limit + 1) * 3 * 3
    route = PrefillRoute(((64, 256),), limit)
    assert route(512, limit // 512) and not route(512, limit // 512 + 1)
    assert PrefillRoute(((64, 256),))(512, 1 << 20)  # unbounded where no limit is given
    assert "memory" in route.describe()


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("window", [None, 20])
def test_a_step_split_between_kernel_and_library_matches_a_float64_reference(dtype, tol, window):
    """Whole prompts and later chunks of one step, the larger ones routed to the library: each as
    exact as the dtype allows, and every position a chunk does not hold is NaN (unzeroed blocks at
    their worst), which neither way may read."""
    d, heads, kvh, block = 64, 6, 2, 16
    backend = replace(_kernel_backend(dtype, d), library_prefill=PrefillRoute(((18, 1),)))
    gen = torch.Generator().manual_seed(2)
    chunks = CHUNKS
    free = scattered_pool(chunks, block)
    key = torch.full((1, len(free), kvh, block, d), float("nan"), dtype=dtype)
    value = torch.full_like(key, float("nan"))
    n = sum(c for _, c in chunks)
    q = torch.randn(n, heads, d, generator=gen).to(dtype)
    step_k, step_v = torch.empty(n, kvh, d, dtype=dtype), torch.empty(n, kvh, d, dtype=dtype)
    gs = attention.GroupStep(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    segments, blocks, table, refs, t0 = [], [], [], [], 0
    for i, (start, c) in enumerate(chunks):
        k = torch.randn(start + c, kvh, d, generator=gen).to(dtype)
        v = torch.randn(start + c, kvh, d, generator=gen).to(dtype)
        own = [free.pop() for _ in range(-(-(start + c) // block))]
        for pos in range(start + c):
            key[0, own[pos // block], :, pos % block] = k[pos]
            value[0, own[pos // block], :, pos % block] = v[pos]
        step_k[t0: t0 + c], step_v[t0: t0 + c] = k[start:], v[start:]
        first = max(0, start - window + 1) // block if window else 0
        segments.append(attention.Segment(t0, c, start, [own[first:] if start else None], [first * block]))
        if backend.library_prefill(c, start + c - first * block):
            gs.library_segments.append(i)
        else:
            table.append((t0, c, start, len(blocks), first * block))
            blocks.extend(own[first:])
        refs.append(reference_chunk(q[t0: t0 + c], k, v, start, window, 0.125))
        t0 += c
    assert gs.library_segments == [3, 5] and len(table) == 4  # both ways serve this step
    gs.prefill_blocks, gs.prefill_table = torch.tensor(blocks), torch.tensor(table)
    ctx = attention.StepContext(num_decode=0, num_tokens=n, groups=[gs], segments=segments, position={0: (0, 0)},
                                windows=[window], backend=backend, unzeroed=True)
    out = attention.attend(ctx, q, step_k, step_v, key, value, 0, 0.125, window, None, written=True)
    got = out.double()
    assert torch.isfinite(got).all()
    assert (got - torch.cat(refs)).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_route_is_measured_on_this_machine_and_read_back(dtype):
    """Both ways timed for real on a small model's shape; a second load reads the route back."""
    backend = _kernel_backend(dtype, 64)
    args = (backend, 4, 2, 64, 16, dtype, torch.device("cpu"), 512, extension.kernel_module().__name__)
    seconds = prefill_route.measure(*args[:-1])
    assert set(seconds) == {(r, k) for k in prefill_route.KEYS for r in prefill_route.ROWS if r <= k}
    assert all(0 < t < 5 for pair in seconds.values() for t in pair)
    route = prefill_route.chosen(*args)
    assert isinstance(route, PrefillRoute) and all(cell in seconds for cell in route.cells)
    assert prefill_route.chosen(*args) == route


def _prompt_logprobs(eng: Engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    outs = eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return [torch.tensor(o.prompt_logprobs[1:], dtype=torch.float64) for o in outs]


@pytest.mark.slow
def test_smollm2_routed_to_the_library_is_as_close_to_float32_and_reads_no_stale_block(smollm2_fp32):
    """SmolLM2 in bfloat16, prompts of several lengths in one step and a long one in chunks: with
    every chunk of 64 tokens or more routed to SDPA, the prompts' log-probabilities are as close to
    float32's as the kernel's, the engine's kernels note says so, and a cache full of NaN (new
    blocks are not zeroed while the C++ kernels serve) is never read."""
    _kernel_backend(torch.bfloat16, 64)
    lm = load_model("smollm2-135m", dtype="bfloat16")
    rng = random.Random(3)
    prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for n in (300, 70, 20)]
    cfg = EngineConfig(max_batch_size=4, max_batch_tokens=128)

    def routed_engine() -> Engine:
        return Engine(lm, cfg, attention=replace(attention_kernels(torch.bfloat16, 64),
                                                 library_prefill=PrefillRoute(((64, 1),))))

    truth = torch.cat(_prompt_logprobs(Engine(smollm2_fp32, cfg), prompts))
    kernel = Engine(lm, cfg, attention=attention_kernels(torch.bfloat16, 64))
    kernel.runner.backend = replace(kernel.runner.backend, library_prefill=None)
    routed = routed_engine()
    assert "SDPA" in routed.kernels[PREFILL_NOTE]
    kernel_err = (torch.cat(_prompt_logprobs(kernel, prompts)) - truth).abs()
    routed_err = (torch.cat(_prompt_logprobs(routed, prompts)) - truth).abs()
    assert 0 < kernel_err.max()
    assert routed_err.mean() <= 1.25 * kernel_err.mean() and routed_err.max() <= 2 * kernel_err.max() + 1e-3, \
        (float(routed_err.mean()), float(kernel_err.mean()), float(routed_err.max()), float(kernel_err.max()))
    # new prompts (the cached prefixes of the first ones are poisoned too)
    others = [[rng.randrange(1000, 40000) for _ in range(n)] for n in (200, 90)]
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    routed.runner.cache.keys.fill_(float("nan"))
    routed.runner.cache.values.fill_(float("nan"))
    poisoned = [o.outputs[0].token_ids for o in routed.generate(others, greedy)]
    assert routed.runner.unzeroed
    assert poisoned == [o.outputs[0].token_ids for o in routed_engine().generate(others, greedy)]
