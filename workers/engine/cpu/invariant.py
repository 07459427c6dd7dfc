"""Batch-invariant linears (`deterministic`): a row's result that does not depend on the rows it
is multiplied with.

A GEMM library picks its kernel, its blocking and its threads' split by the shape it is given, and
each choice sums a row's products in its own order: one row alone and the same row among 31
others round differently (in SmolLM2's MLP down projection, oneDNN's bfloat16 result for a row
alone and in a chunk of 512 differed; a greedy answer then parted with the batch). The C++
int4/int8 kernels do the same on purpose: one row in fixed point, two to four straight from the
blocks, more through widened strips.

Two ways out, both checked at load on this machine (Linear.make_invariant):
- one path for every row count: the C++ kernels' strips (the quantized ones over their blocks,
  `dense_strips` over a dense weight) sum each row in one order whatever rows come with it
  (`invariant_any` checks row counts from 1 to 37);
- one call shape, where the strips are not built or do not fit: tiles of TILE_ROWS rows, the last
  padded with zeros, so every call takes one kernel; a row's result then depends on its own
  values only, as long as the kernel keeps rows apart and does not treat them by their place in
  the tile (`invariant_rows` checks; a kernel that fails multiplies one row a call, which holds by
  construction).

This is the same idea as vLLM's batch-invariant mode and SGLang's deterministic inference (after
"Defeating Nondeterminism in LLM Inference", Thinking Machines, 2025): one reduction order for
every batch size, whatever it costs a large batch or a lone row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Rows a call where tiles serve. A decode step of up to this many streams is one call; a prompt's
# chunk of 512 rows is 32 calls, each reading every weight again (at SmolLM2's shapes, 1.15-1.25x
# one call of 512 rows through oneDNN).
TILE_ROWS = 16


def in_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> torch.Tensor:
    """fn over x [M, in] in calls of exactly `rows` rows (the last padded with zeros), joined: [M, out]."""
    m = x.shape[0]
    if m == rows or m == 0:
        return fn(x)
    parts = []
    for i in range(0, m, rows):
        part = x[i:i + rows]
        n = part.shape[0]
        if n < rows:
            part = torch.cat([part, part.new_zeros(rows - n, *part.shape[1:])])
        parts.append(fn(part)[:n])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def invariant_any(fn: Callable[[torch.Tensor], torch.Tensor], width: int, dtype: torch.dtype,
                  sizes: tuple[int, ...] = (1, 3, 5, 16, 24, 37)) -> bool:
    """Whether fn gives each row the same result bit for bit for any number of rows: the first m
    of 37 seeded random rows, in order and reversed, for each m of `sizes`, against all 37."""
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(max(sizes), width, generator=gen).to(dtype)
    with torch.inference_mode():
        y = fn(x)
        return all(torch.equal(fn(x[:m]), y[:m]) and torch.equal(fn(x[:m].flip(0)), y[:m].flip(0)) for m in sizes)


def invariant_rows(fn: Callable[[torch.Tensor], torch.Tensor], width: int, dtype: torch.dtype,
                   rows: int = TILE_ROWS) -> int:
    """`rows` where fn, called on exactly `rows` rows of `width`, gives each row the same result
    bit for bit wherever it sits among them and whatever the others hold (checked here on seeded
    random rows: reversed, and one row among zeros at each end); else 1, one row a call."""
    gen = torch.Generator().manual_seed(rows * 7919 + width)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    with torch.inference_mode():
        y = fn(x)
        if not torch.equal(fn(x.flip(0)), y.flip(0)):
            return 1
        for at in (0, rows - 1):
            alone = torch.zeros_like(x)
            alone[at] = x[0]
            if not torch.equal(fn(alone)[at], y[0]):
                return 1
    return rows
