"""Up to how many rows torch's tinygemm multiplies an int4 linear on a GPU, measured at load.

The Triton kernel (triton_qlinear) reads the blocks as the file lays them out; tinygemm
(int4pack) reads them repacked for the tensor cores. Which is faster at a decode step's rows
depends on the GPU and the shape, and neither was measured side by side when this was written, so
each worker times both on every distinct int4 shape at each decode bucket (workers.engine.cuda.timing,
both on the same input) and gives tinygemm the buckets from the smallest up where it wins
by MARGIN at that bucket and every one below it: one crossover per shape, so a noisy bucket does
not flip a linear back and forth. A shape tinygemm never wins keeps the Triton kernel alone and no
packed copy. The buckets go on past the decode steps' in powers of two up to the most rows a step
can have (prompt chunks: max_batch_tokens), so the chunks take tinygemm too where it wins there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from workers.engine.cuda.int4pack import Int4Pack
from workers.engine.cuda.timing import Timer
from workers.quant.weight import QuantizedWeight

MARGIN = 0.05  # tinygemm replaces the Triton kernel only where it is this much faster


def row_buckets(decode: Sequence[int], max_rows: int) -> list[int]:
    """The row counts timed: the decode buckets, then powers of two up to max_rows, and max_rows."""
    out = set(decode)
    b = max(decode, default=1)
    while b * 2 < max_rows:
        b *= 2
        out.add(b)
    out.add(max(max_rows, 1))
    return sorted(out)


def tinygemm_rows(timings: Sequence[tuple[int, float, float]], margin: float = MARGIN) -> int:
    """The rows up to which tinygemm serves, from (rows, Triton's seconds, tinygemm's seconds) per
    bucket: the largest bucket such that tinygemm won by `margin` there and at every smaller one
    (0: it lost at the smallest)."""
    upto = 0
    for rows, triton_s, tinygemm_s in sorted(timings):
        if tinygemm_s * (1 + margin) > triton_s:
            break
        upto = rows
    return upto


def measure(weight: QuantizedWeight, qlinear: Callable[..., torch.Tensor], buckets: Sequence[int],
            timer: Timer) -> tuple[int, list[tuple[int, float, float]]]:
    """(rows up to which tinygemm serves `weight`'s shape, the timings per bucket) against
    `qlinear` (the Triton kernel), both on the weight's device."""
    pack = Int4Pack.of(weight)
    device = weight.qs.device
    gen = torch.Generator(device=device).manual_seed(0)
    timings = []
    for rows in sorted(buckets):
        x = torch.randn(rows, weight.in_features, generator=gen, device=device).to(torch.bfloat16)
        timings.append((rows, timer(lambda x=x: qlinear(x, weight)), timer(lambda x=x: pack(x))))
    return tinygemm_rows(timings), timings
