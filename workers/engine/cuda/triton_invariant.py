"""A Triton kernel for `deterministic` on a GPU: a dense linear whose every row is computed in one
order, whatever the number of rows (vLLM's batch-invariant mode and "Defeating
Nondeterminism in LLM Inference" do the same).

cuBLAS picks its tiles and split-K reductions by the matrix sizes, and torch's row reductions pick
their layout by the number of rows, so a row's bits change with the batch. Here a weight's tile
shape (`Tiles`) is fixed for every call, whatever the rows: a program computes a [16, bn] tile of
the output, walking the inputs in blocks of bk in order, over all of them or over one of `split`
ranges whose float32 sums a second kernel adds in range order (workers.engine.cuda.triton_splits).
16-bit inputs meet on the tensor cores (their products are exact in the float32 sums, and an output
element's sums read its own row and column only, so a row's bits do not depend on the rows sharing
its tile); float32 inputs multiply in float32 at IEEE precision. Which tiles serve a weight is
measured at load (workers.engine.cuda.tile_choice): a row's bits then follow the weight and the GPU,
never the batch. The norms (workers.engine.cuda.triton_fused, one program a row) and the attention
kernels (a row's own positions, in block order, in segments fixed by position) need no second
version.

Set TRITON_INTERPRET before this module is imported (the tests run it on the CPU in Triton's
interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from workers.engine.cuda import triton_splits
from workers.engine.cuda.triton_common import INTERPRETED

BLOCK_M = 16  # rows a tile: every weight's, so that a row's tile never depends on the rows


@dataclass(frozen=True, slots=True)
class Tiles:
    """A weight's tile shape under `deterministic`: bn outputs a program, bk inputs a step, the
    inputs in `split` ranges (1: one program walks them all)."""

    bn: int = 32
    bk: int = 64
    split: int = 1

    def __post_init__(self):
        if self.bn < 16 or self.bk < 16 or self.split < 1:
            raise ValueError(f"tiles need bn and bk of 16 or more (a tensor-core dot) and split >= 1, got {self}")

    @property
    def name(self) -> str:
        return f"tiles {BLOCK_M}x{self.bn}, k {self.bk}" + (f", {self.split} ranges" if self.split > 1 else "")


DEFAULT = Tiles()
# what tile_choice times against DEFAULT (each a compile a row-count class on a GPU's first load, so
# few): narrower tiles give a short step's few outputs twice the programs, input ranges four times
# with shorter chains of steps, wider steps half the iterations
CANDIDATES = (Tiles(16, 64), Tiles(32, 64, 4), Tiles(32, 128))


@triton.jit
def _linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, K_RANGE, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   WIDE: tl.constexpr, SPLIT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    k_lo = tl.program_id(2) * K_RANGE
    k_hi = tl.minimum(k_lo + K_RANGE, K)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=mask_m[:, None] & (k[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=mask_n[:, None] & (k[None, :] < K),
                    other=0.0)
        if WIDE:  # float32: multiply-adds at IEEE precision (not TF32)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # this range's sums; triton_splits adds the ranges in order
        tl.store(part_ptr + (tl.program_id(2) * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tiles: Tiles = DEFAULT) -> torch.Tensor:
    """F.linear's contract for x [M, K] and weight [N, K], each row in one order for any M (the
    order `tiles` sets)."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x, weight = x.contiguous(), weight.contiguous()
    split, k_range = triton_splits.ranges(k, tiles.bk, tiles.split)
    part = triton_splits.partials(split, m, n, x.device) if split > 1 else out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, tiles.bn), split)
    _linear_kernel[grid](x, weight, bias if bias is not None else x, out, part, m, n, k, k_range, x.stride(0),
                         weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BM=BLOCK_M, BN=tiles.bn,
                         BK=tiles.bk, WIDE=INTERPRETED or x.dtype not in (torch.bfloat16, torch.float16)
                         or weight.dtype != x.dtype, SPLIT=split)
    return triton_splits.sum_splits(part, bias, out) if split > 1 else out
