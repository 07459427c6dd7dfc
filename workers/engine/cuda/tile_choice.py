"""Which shape the Triton linears take for each weight on a GPU, measured at load.

A decode step's linears have few rows and, on a small model, few outputs: SmolLM2's o projection
has 576, which tiles of 32 outputs give 18 programs on a GPU of 132 multiprocessors, each walking
every input. Narrower tiles, wider steps or the inputs split in ranges (workers.engine.cuda.
triton_splits) can be faster, and which is depends on the GPU and the shape. So each worker times
the default and the candidates on every distinct shape (workers.engine.cuda.timing, all on the
same inputs) at a few fixed row counts, and a weight takes the candidate whose time relative to the
default's, averaged over the rows, is lowest, where that is at least MARGIN lower; else the default.

The choice is the weight's for every step, whatever its rows: a row's sums keep one order in any
batch, so `deterministic` takes it too. It is kept in the cache (workers.files.remembered) under
the GPU's name, torch's and Triton's versions, the shape and the dtype: later loads
on the machine, and the copies of a deployment, read it rather than time it again, so a
`deterministic` answer keeps its bits from one load to the next (a timing's noise would otherwise
be free to pick another shape).
- weight-only blocks (`quantization: int8`, `int4`): the row kernel's `Gemv` (triton_qlinear);
- dense weights under `deterministic`: the batch-invariant linear's `Tiles` (triton_invariant);
  otherwise they go to cuBLAS, which chooses for itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch
import triton

from workers.devices import device_kind
from workers.engine.cuda.timing import Timer
from workers.engine.cuda.triton_invariant import CANDIDATES, DEFAULT, Tiles
from workers.engine.cuda.triton_qlinear import DEFAULT_GEMV, GEMV_CANDIDATES, GEMV_ROWS, Gemv
from workers.files import remembered
from workers.quant.weight import QuantizedWeight

MARGIN = 0.05  # a candidate replaces the default only where it is this much faster
VERSION = 2  # of the measurement and its rule: a kept choice of another version is timed anew

C = TypeVar("C", bound=Hashable)


# the row counts timed: fixed, so that a weight's choice (and under `deterministic` its bits)
# never depends on the engine's batch limits, which differ between a deployment's engines
FEW_ROWS = (1, 4, GEMV_ROWS)  # the row kernel, where more rows take the tiles
ANY_ROWS = (1, 8, 64)  # a shape that serves every step (`deterministic`)


def choose(default: C, candidates: Sequence[C], time_of: Callable[[C, int], float], rows: Sequence[int],
           margin: float = MARGIN) -> tuple[C, dict[C, float]]:
    """(the shape to take, each candidate's time over the default's averaged over `rows`): the
    candidate of the lowest mean where it is at most 1 - margin, else the default."""
    base = {r: time_of(default, r) for r in rows}
    ratios = {c: sum(time_of(c, r) / base[r] for r in rows) / len(rows) for c in candidates if c != default}
    best = min(ratios, key=ratios.__getitem__, default=None)
    return (best if best is not None and ratios[best] <= 1 - margin else default), ratios


def _inputs(in_features: int, rows: Sequence[int], dtype: torch.dtype, device: torch.device) -> dict[int, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    return {r: torch.randn(r, in_features, generator=gen, device=device).to(dtype) for r in rows}


def _key(what: str, shape: tuple[int, int], dtype: torch.dtype, rows: Sequence[int], candidates: Sequence,
         device: torch.device) -> str:
    gpu = "the CPU (Triton's interpreter)" if device_kind(device).host else torch.cuda.get_device_name(device)
    return "|".join(map(str, (f"cuda shapes {VERSION}", what, shape, dtype, f"rows {list(rows)}",
                              [c.name for c in candidates], gpu, f"torch {torch.__version__}",
                              f"triton {triton.__version__}")))


def dense_tiles(weight: torch.Tensor, linear: Callable[..., torch.Tensor], rows: Sequence[int],
                timer: Timer) -> Tiles:
    """The tiles of the batch-invariant `linear` (triton_invariant.linear) for `weight` [N, K]:
    kept on this machine, else timed now."""
    def timed() -> list[int]:
        xs = _inputs(weight.shape[1], rows, weight.dtype, weight.device)
        t = choose(DEFAULT, CANDIDATES, lambda t, r: timer(lambda: linear(xs[r], weight, None, tiles=t)), rows)[0]
        return [t.bn, t.bk, t.split]

    key = _key("dense", tuple(weight.shape), weight.dtype, rows, CANDIDATES, weight.device)
    return Tiles(*remembered(key, timed))


def gemv_shape(weight: QuantizedWeight, qlinear: Callable[..., torch.Tensor], dtype: torch.dtype,
               rows: Sequence[int], timer: Timer) -> Gemv:
    """The row kernel's shape for `weight` under `qlinear` (triton_qlinear.qlinear or
    qlinear_invariant), for activations of `dtype`: kept on this machine, else timed now."""
    def timed() -> list[int]:
        xs = _inputs(weight.in_features, rows, dtype, weight.qs.device)
        g = choose(DEFAULT_GEMV, GEMV_CANDIDATES,
                   lambda g, r: timer(lambda: qlinear(xs[r], weight, None, gemv=g)), rows)[0]
        return [g.n, g.chunk, g.split, g.flat]

    key = _key(weight.kind, (weight.out_features, weight.in_features), dtype, rows, GEMV_CANDIDATES,
               weight.qs.device)
    return Gemv(*remembered(key, timed))
