"""A Triton kernel for `deterministic` on a GPU: a dense linear whose every row is computed in one
order, whatever the number of rows (vLLM's batch-invariant mode and "Defeating
Nondeterminism in LLM Inference" do the same).

cuBLAS picks its tiles and split-K reductions by the matrix sizes, and torch's row reductions pick
their layout by the number of rows, so a row's bits change with the batch. Here one tile shape is
fixed for every call: a program computes a [16, 32] tile of the output, walking the inputs in
blocks of 64 in order. 16-bit inputs meet on the tensor cores (their products are exact in the
float32 sums, and an output element's sums read its own row and column only, so a row's bits do not
depend on the rows sharing its tile); float32 inputs multiply in float32 at IEEE precision. The norms (workers.engine.cuda.triton_fused,
one program a row) and the attention kernels (a row's own positions, in block order, in segments
fixed by position) need no second version.

Set TRITON_INTERPRET before this module is imported (the tests run it on the CPU in Triton's
interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.engine.cuda.triton_common import INTERPRETED

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 64


@triton.jit
def _linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   WIDE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=mask_m[:, None] & (k[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=mask_n[:, None] & (k[None, :] < K),
                    other=0.0)
        if WIDE:  # float32: multiply-adds at IEEE precision (not TF32)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's contract for x [M, K] and weight [N, K], each row in one order for any M."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x, weight = x.contiguous(), weight.contiguous()
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _linear_kernel[grid](x, weight, bias if bias is not None else x, out, m, n, k, x.stride(0), weight.stride(0),
                         out.stride(0), HAS_BIAS=bias is not None, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                         WIDE=INTERPRETED or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype)
    return out
