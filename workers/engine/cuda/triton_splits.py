"""The second kernel of a linear split over its inputs: a linear whose few output tiles would leave
most of a GPU idle walks its inputs in `split` ranges, one program each, into float32 partial sums
[split, rows, outputs]; this kernel adds them, range 0 first, adds the bias and rounds once to the
output's dtype. The number of ranges is the weight's (workers.engine.cuda.tile_choice), never the
step's, so a row's sums keep one order whatever rows share its step: a split linear stays
batch-invariant.

Set TRITON_INTERPRET before this module is imported (the tests run it on the CPU in Triton's
interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUM_BLOCK = 256  # outputs a program


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, M, N, stride_om,
                       SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.load(part_ptr + m * N + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + (s * M + m) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_row(acc, bias_ptr, out_ptr, part_ptr, m, M, N, offs_n, mask_n, stride_om,
              HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Row m's float32 sums `acc` of the outputs offs_n: with the bias into out, rounded once to its
    dtype; or, a program of one of SPLIT ranges of the inputs, into the partial sums that
    _sum_splits_kernel adds."""
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(part_ptr + (tl.program_id(2) * M + m) * N + offs_n, acc, mask=mask_n)


def partials(split: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    """The float32 [split, m, n] that the ranges' programs write."""
    return torch.empty(split, m, n, dtype=torch.float32, device=device)


def sum_splits(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out[m, n] = (part[0, m, n] + part[1, m, n] + ...) + bias[n], in out's dtype."""
    split, m, n = part.shape
    _sum_splits_kernel[(m, triton.cdiv(n, SUM_BLOCK))](
        part, bias if bias is not None else part, out, m, n, out.stride(0),
        SPLIT=split, HAS_BIAS=bias is not None, BLOCK=SUM_BLOCK)
    return out


def ranges(total: int, step: int, split: int) -> tuple[int, int]:
    """(ranges, items a range): `total` items walked `step` at a time, dealt into at most `split`
    ranges of whole steps, none empty. A weight's own numbers, never a step's."""
    steps = -(-total // step)
    length = -(-steps // min(split, steps)) * step
    return -(-total // length), length
