"""Gemma 3's elementwise work of a decode layer as Triton kernels (the paged ops' `gemma_rms_norm`,
`sandwich_norm`, `qk_norm` and `gelu_mul`; their PyTorch references are in workers.engine.cuda.ops).

Gemma3RMSNorm computes in float32 and scales by (1 + w) before it rounds, once, to the activations'
dtype (Llama's norm rounds before its scale); the kernels take the scale as (1 + w) in float32. A
sublayer's output is normed before it joins the residual stream, so a layer's two joins are each
one kernel here (`sandwich_norm`: the output's norm, the add, the next norm), and the q and k heads
are normed before the rotary embedding (`qk_norm`). As in workers.engine.cuda.triton_fused, one
program a row (or a row's head) and rounding where PyTorch rounds: a row's result never depends on
the others. Set TRITON_INTERPRET before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.engine.cuda.triton_fused import act_mul


@triton.jit
def _normed(x, w, eps, N: tl.constexpr):
    """x (float32, zero past N) normed and scaled by w (float32), in float32."""
    var = tl.sum(x * x, axis=0) / N
    return x * tl.rsqrt(var + eps) * w


@triton.jit
def _sandwich_kernel(x_ptr, res_ptr, w_out_ptr, w_next_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s,
                     eps, N: tl.constexpr, N_PAD: tl.constexpr, SANDWICH: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, N_PAD)
    live = offs < N
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + offs, mask=live, other=0.0).to(tl.float32)
    if SANDWICH:
        w_out = tl.load(w_out_ptr + offs, mask=live, other=0.0)
        joined = _normed(h, w_out, eps, N).to(dtype).to(tl.float32)
        # the sum in the activations' dtype, as `residual + norm(x)` is
        summed = (tl.load(res_ptr + row * stride_r + offs, mask=live, other=0.0).to(tl.float32) + joined).to(dtype)
        tl.store(sum_ptr + row * stride_s + offs, summed, mask=live)
        h = summed.to(tl.float32)
    w_next = tl.load(w_next_ptr + offs, mask=live, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, _normed(h, w_next, eps, N).to(dtype), mask=live)


def sandwich_norm(x: torch.Tensor, residual: torch.Tensor, out_weight: torch.Tensor, next_weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.reference_sandwich_norm's contract."""
    n, width = x.shape
    out, summed = torch.empty_like(x), torch.empty_like(x)
    if n == 0:
        return out, summed
    x, residual = x.contiguous(), residual.contiguous()
    _sandwich_kernel[(n,)](x, residual, out_weight, next_weight, out, summed, x.stride(0), residual.stride(0),
                           out.stride(0), summed.stride(0), float(eps), N=width, N_PAD=triton.next_power_of_2(width),
                           SANDWICH=True)
    return out, summed


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ops.reference_gemma_rms_norm's contract, one program a row."""
    n, width = x.shape
    out = torch.empty_like(x)
    if n == 0:
        return out
    x = x.contiguous()
    _sandwich_kernel[(n,)](x, x, weight, weight, out, x, x.stride(0), x.stride(0), out.stride(0), x.stride(0),
                           float(eps), N=width, N_PAD=triton.next_power_of_2(width), SANDWICH=False)
    return out


@triton.jit
def _qk_norm_kernel(qkv_ptr, qw_ptr, kw_ptr, out_ptr, stride_t, stride_o, eps,
                    HEADS: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)  # a query head, a key head, then a value head (copied)
    offs = tl.arange(0, D_PAD)
    live = offs < D
    x = tl.load(qkv_ptr + t * stride_t + h * D + offs, mask=live, other=0.0)
    if h < HEADS + KVH:
        if h < HEADS:
            w = tl.load(qw_ptr + offs, mask=live, other=0.0)
        else:
            w = tl.load(kw_ptr + offs, mask=live, other=0.0)
        x = _normed(x.to(tl.float32), w, eps, D).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_o + h * D + offs, x, mask=live)


def qk_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int, kv_heads: int,
            eps: float) -> torch.Tensor:
    """ops.reference_qk_norm's contract."""
    n, d = qkv.shape[0], q_weight.shape[0]
    out = torch.empty_like(qkv)
    if n == 0:
        return out
    qkv = qkv.contiguous()
    _qk_norm_kernel[(n, heads + 2 * kv_heads)](qkv, q_weight, k_weight, out, qkv.stride(0), out.stride(0), float(eps),
                                               HEADS=heads, KVH=kv_heads, D=d, D_PAD=triton.next_power_of_2(d))
    return out


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """ops.reference_gelu_mul's contract: gate_up [N, 2 x inter] -> gelu_tanh(gate) x up [N, inter]
    (workers.engine.cuda.triton_fused's kernel of SiLU x up, with GELU)."""
    return act_mul(gate_up, gelu=True)
