"""The elementwise work of a decode layer as three Triton kernels (the paged ops' `add_rms_norm`,
`rope_kv_write` and `silu_mul`; their PyTorch references are in workers.engine.cuda.ops).

PyTorch runs each of these as 4-8 small kernels (a norm is pow, mean, add, rsqrt, two multiplies
and casts; the rotary embedding a roll, two multiplies and an add; then the KV write), and at one
row a kernel's launch and drain cost more than its arithmetic. Each kernel here is one program a
row (a token, or a token's head) that does the whole of it, and rounds where PyTorch rounds: a
bfloat16 sum, product or activation is rounded to bfloat16 before the next step uses it, so the
results are transformers' bits up to the last place of a float32 reduction or exponential.

- `add_rms_norm`: the residual add and LlamaRMSNorm in one pass (SGLang's fused_add_rmsnorm);
  `rms_norm` without the add.
- `rope_kv_write`: the rotary embedding of the fused q/k/v output's q and k heads, looked up by
  position, with the keys and values written to the pool through the slot mapping (SGLang's
  rotary with `fused_set_kv_buffer_arg`).
- `silu_mul`: SiLU of the gate times the up projection (vLLM's silu_and_mul); its kernel takes
  GELU's tanh form instead for Gemma 3 (`act_mul`).

One program a row: a row's result never depends on the others (`deterministic` keeps them). Set
TRITON_INTERPRET before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, eps,
                         N: tl.constexpr, N_PAD: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, N_PAD)
    live = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=live, other=0.0)
    if HAS_RES:
        # the sum in the activations' dtype, as `h + o(a)` is
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=live, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=live)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / N
    h = (h * tl.rsqrt(var + eps)).to(sum_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=live, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (w.to(tl.float32) * h.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=live)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.reference_add_rms_norm's contract: (rms_norm(x + residual), x + residual)."""
    n, width = x.shape
    out = torch.empty(n, width, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = torch.empty_like(x)
    if n == 0:
        return out, summed
    x, residual = x.contiguous(), residual.contiguous()
    _add_rms_norm_kernel[(n,)](x, residual, weight, out, summed, x.stride(0), residual.stride(0), out.stride(0),
                               summed.stride(0), float(eps), N=width, N_PAD=triton.next_power_of_2(width),
                               HAS_RES=True)
    return out, summed


@triton.jit
def _rope_kv_write_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slots_ptr, q_ptr, key_cache_ptr, value_cache_ptr,
                          stride_t, stride_rot, stride_qt, stride_qh,
                          stride_cb, stride_ch, stride_cp, stride_vb, stride_vh, stride_vp, block_size,
                          HEADS: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)  # [0, HEADS): a query head; [HEADS, HEADS + KVH): a KV head
    offs = tl.arange(0, D_PAD)
    live = offs < D
    dtype = qkv_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * stride_rot + offs, mask=live, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_rot + offs, mask=live, other=0.0).to(tl.float32)
    base = qkv_ptr + t * stride_t + h * D
    x = tl.load(base + offs, mask=live, other=0.0).to(tl.float32)
    turned = tl.load(base + (offs + D // 2) % D, mask=live, other=0.0).to(tl.float32)  # roll by half
    # x * cos + roll(x) * sin, each product and the sum rounded to the activations' dtype
    out = ((x * c).to(dtype).to(tl.float32) + (turned * s).to(dtype).to(tl.float32)).to(dtype)
    if h < HEADS:
        tl.store(q_ptr + t * stride_qt + h * stride_qh + offs, out.to(q_ptr.dtype.element_ty), mask=live)
    else:
        slot = tl.load(slots_ptr + t)
        if slot >= 0:
            kv = h - HEADS
            block = slot // block_size
            offset = slot % block_size
            tl.store(key_cache_ptr + block * stride_cb + kv * stride_ch + offset * stride_cp + offs,
                     out.to(key_cache_ptr.dtype.element_ty), mask=live)
            v = tl.load(qkv_ptr + t * stride_t + (HEADS + KVH + kv) * D + offs, mask=live, other=0.0)
            tl.store(value_cache_ptr + block * stride_vb + kv * stride_vh + offset * stride_vp + offs,
                     v.to(value_cache_ptr.dtype.element_ty), mask=live)


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int
                  ) -> torch.Tensor:
    """ops.reference_rope_kv_write's contract."""
    n = qkv.shape[0]
    d = key_cache.shape[-1]
    q = torch.empty(n, heads, d, dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q
    qkv = qkv.contiguous()
    _rope_kv_write_kernel[(n, heads + kv_heads)](
        qkv, cos, sin, positions.contiguous(), slots.contiguous(), q, key_cache, value_cache,
        qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), key_cache.shape[2],
        HEADS=heads, KVH=kv_heads, D=d, D_PAD=triton.next_power_of_2(d))
    return q


@triton.jit
def _act_mul_kernel(gu_ptr, out_ptr, stride_g, stride_o, inter, BLOCK: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < inter
    dtype = gu_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_g + offs, mask=live, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + inter + offs, mask=live, other=0.0).to(tl.float32)
    if GELU:
        # PyTorch's tanh GELU in float32: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh through exp
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (2.0 / (1.0 + tl.exp(-2.0 * inner)))
    else:
        act = g / (1.0 + tl.exp(-g))
    act = act.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * u).to(out_ptr.dtype.element_ty), mask=live)


def act_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """gate_up [N, 2 x inter] -> act(gate) x up [N, inter]: SiLU, or (`gelu`) GELU's tanh form."""
    n, width = gate_up.shape
    inter = width // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    if n == 0:
        return out
    gate_up = gate_up.contiguous()
    block = min(1024, triton.next_power_of_2(inter))
    _act_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                    BLOCK=block, GELU=gelu)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """ops.reference_silu_mul's contract: gate_up [N, 2 x inter] -> silu(gate) x up [N, inter]."""
    return act_mul(gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ops.reference_rms_norm's contract, one program a row."""
    n, width = x.shape
    out = torch.empty(n, width, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if n == 0:
        return out
    x = x.contiguous()
    _add_rms_norm_kernel[(n,)](x, x, weight, out, x, x.stride(0), x.stride(0), out.stride(0), x.stride(0),
                               float(eps), N=width, N_PAD=triton.next_power_of_2(width), HAS_RES=False)
    return out
