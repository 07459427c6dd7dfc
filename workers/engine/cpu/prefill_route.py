"""Which prompt chunks the C++ prefill kernel attends, and which PyTorch's SDPA does, measured here.

The C++ prefill kernel (kernels/paged_prefill.cpp) reads a chunk's keys straight from their blocks
with the query rows of one KV head in a vector's lanes: one pass per key, no gather, no mask. It
wins small chunks and short contexts. PyTorch's SDPA (ATen's flash attention, on GEMM micro-kernels:
AMX tiles where the CPU has them) multiplies blocks of queries by blocks of keys, and pays a gather
of the chunk's keys from their blocks and a mask. On a 2-core Sapphire Rapids a chunk of 512 tokens
at the end of 4,096 positions took 32 ms a layer in the kernel and 14 in SDPA; one of 16 tokens
took 1.2 and 1.3. The same held with the CPU capped to AVX512-BF16 and to AVX2 (float32), with
other crossovers: it depends on the CPU, the model's heads and the threads, so it is measured at
load, as the row kernels are, and kept in the cache.

The measurement times both on one layer's scratch cache for chunks of ROWS tokens ending at KEYS
positions, through `attention.attend` as a step runs them. The library serves a chunk of t tokens
seeing k keys where it beat the kernel by MARGIN at a measured cell (rows <= t, keys <= k) and at
every measured cell at or beyond it in both: a noisy cell in the middle does not send larger chunks
back and forth, and the same timings always give the same route. Not under `deterministic`, whose
prompts attend as decode rows do.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

import torch

from workers import files
from workers.engine import attention
from workers.engine.attention_backend import AttentionBackend
from workers.engine.cpu import calibrate
from workers.engine.cpu.row_kernels import machine_key

ROWS = (16, 64, 256)  # a measured chunk's tokens
KEYS = (256, 1024, 4096)  # the positions it sees (its last position + 1)
# the library replaces the kernel only where it is this much faster: timings on a busy machine are
# noisy, and the kernel reads no gathered copy
MARGIN = 0.10
# the most bytes of masks SDPA may take for one chunk (attention.StepContext.additive_mask: the
# additive one has a row per query head of a KV head and a column per key; the boolean one it is
# made from, counted as if it had as many rows, bounds it from above). They live for the step; a
# 512-token chunk of 4 query heads a KV head at 32,768 keys would take 200 MB. Beyond this the
# kernel serves, which needs none
MASK_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class PrefillRoute:
    """The chunks the library serves: those of at least `rows` tokens seeing at least `keys` keys,
    for some (rows, keys) of `cells` (none: the kernel serves every chunk)."""

    cells: tuple[tuple[int, int], ...] = ()
    # the most tokens x keys a chunk's masks may span (within MASK_BYTES: mask_limit); 0: no bound
    max_pairs: int = 0

    def __call__(self, tokens: int, keys: int) -> bool:
        return (any(tokens >= rows and keys >= k for rows, k in self.cells)
                and (not self.max_pairs or tokens * keys <= self.max_pairs))

    def describe(self) -> str:
        if not self.cells:
            return "the C++ kernel for every chunk"
        where = " or ".join(f"{rows}+ tokens over {keys}+ keys" for rows, keys in self.cells)
        bound = f" (up to {self.max_pairs:,} tokens x keys: its masks' memory)" if self.max_pairs else ""
        return f"PyTorch's SDPA for chunks of {where}{bound}; the C++ kernel below"


def mask_limit(heads: int, kv_heads: int, dtype: torch.dtype) -> int:
    """The most tokens x keys of a chunk whose masks (a boolean and an additive one in `dtype`, a row
    per query head of a KV head) fit in MASK_BYTES."""
    return MASK_BYTES // ((heads // kv_heads) * (1 + torch.finfo(dtype).bits // 8))


def route_of(seconds: dict[tuple[int, int], tuple[float, float]]) -> PrefillRoute:
    """The route from {(rows, keys): (kernel's seconds, library's seconds)}: the cells where the library
    won by MARGIN, as did every measured cell at or beyond them in both, less those another such
    cell already covers."""
    won = {cell for cell, (kernel, library) in seconds.items() if library < (1 - MARGIN) * kernel}
    kept = [cell for cell in won
            if all(other in won for other in seconds if other[0] >= cell[0] and other[1] >= cell[1])]
    minimal = [c for c in kept if not any(o != c and o[0] <= c[0] and o[1] <= c[1] for o in kept)]
    return PrefillRoute(tuple(sorted(minimal)))


def measure(backend: AttentionBackend, heads: int, kv_heads: int, head_dim: int, block_size: int,
            dtype: torch.dtype, device: torch.device, max_tokens: int) -> dict[tuple[int, int], tuple[float, float]]:
    """Seconds of the kernel and of the library for a chunk of each of ROWS tokens (up to
    `max_tokens`, the most a step holds) ending at each of KEYS positions, on one layer's scratch
    cache, best of calibrate.REPEATS."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.5).to(dtype=dtype, device=device)

    nb = -(-max(KEYS) // block_size)
    keys, values = rand(1, nb, kv_heads, block_size, head_dim), rand(1, nb, kv_heads, block_size, head_dim)
    library = dataclasses.replace(backend, library_prefill=PrefillRoute(((1, 1),)))
    out: dict[tuple[int, int], tuple[float, float]] = {}
    with torch.inference_mode():
        for k in KEYS:
            for rows in (r for r in ROWS if r <= min(k, max_tokens)):
                q, kn, vn = rand(rows, heads, head_dim), rand(rows, kv_heads, head_dim), rand(rows, kv_heads, head_dim)
                # one step for each way, its masks kept across calls as a step's layers share them
                calls = [functools.partial(attention.attend, calibrate.chunk_step(be, rows, k - rows, block_size, [None]),
                                           q, kn, vn, keys, values, 0, head_dim ** -0.5, None, None, written=True)
                         for be in (backend, library)]
                out[(rows, k)] = _alternated(calls)
    return out


def _alternated(calls: list) -> tuple[float, ...]:
    """The fastest of calibrate.REPEATS calls of each, after a warm-up, taking turns call by call:
    a machine whose pace moves while it measures slows both alike."""
    for call in calls:
        call()
    best = [float("inf")] * len(calls)
    for _ in range(calibrate.REPEATS):
        for i, call in enumerate(calls):
            t = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - t)
    return tuple(best)


def chosen(backend: AttentionBackend, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
           device: torch.device, max_tokens: int, build: str) -> PrefillRoute:
    """The route for a model of these shapes computing in `dtype`, read from the cache or measured
    now. `build`: the kernels' build (its tag)."""
    key = "|".join(map(str, ("prefill route 2", dtype, heads, kv_heads, head_dim, block_size,
                             min(max_tokens, max(ROWS)), ROWS, KEYS, build, machine_key())))
    cells = files.remembered(key, lambda: [list(c) for c in route_of(
        measure(backend, heads, kv_heads, head_dim, block_size, dtype, device, max_tokens)).cells])
    return PrefillRoute(tuple((rows, k) for rows, k in cells), mask_limit(heads, kv_heads, dtype))
