"""Triton kernels of the paged ops (workers.engine.cuda.ops): the KV write through a slot mapping,
and paged attention with the query heads of one KV head packed together.

`paged_attention` runs one program per (query row, KV head). It loads the row's G query heads of
that KV head as one [G, d] tile, walks the row's blocks from the first one its window sees to its
length, and keeps an online softmax in float32 (flash-decoding's recurrence within one program),
as SGLang's triton decode attention and vLLM's unified attention do. Decode is one query row a
sequence; prefill and extend chunks are one row a token, each over its own prefix, so one kernel
serves every step. Everything is computed in float32: the values are upcast as loaded, which
also keeps Triton's interpreter (TRITON_INTERPRET=1, how the tests run them on a CPU) exact for
bfloat16.

Set TRITON_INTERPRET before this module is imported: Triton reads it when the kernels are defined.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slots_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ch, stride_cp, stride_vb, stride_vch, stride_vp,
                     block_size, D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        offs_d = tl.arange(0, D_PAD)
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + offs_d, mask=offs_d < D)
        tl.store(key_cache_ptr + block * stride_cb + h * stride_ch + offset * stride_cp + offs_d,
                 k.to(key_cache_ptr.dtype.element_ty), mask=offs_d < D)
        offs_v = tl.arange(0, DV_PAD)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + offs_v, mask=offs_v < DV)
        tl.store(value_cache_ptr + block * stride_vb + h * stride_vch + offset * stride_vp + offs_v,
                 v.to(value_cache_ptr.dtype.element_ty), mask=offs_v < DV)


def kv_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """ops.reference_kv_write's contract."""
    n, kvh, d = key.shape
    if n == 0:
        return
    dv = value.shape[-1]
    key, value = key.contiguous(), value.contiguous()
    _kv_write_kernel[(n, kvh)](
        key, value, key_cache, value_cache, slots.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        key_cache.shape[2], D=d, DV=dv, D_PAD=triton.next_power_of_2(d), DV_PAD=triton.next_power_of_2(dv))


@triton.jit
def walk_blocks(q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr, tables_ptr, row, kv_head, first, last, lo, length,
                stride_cb, stride_ch, stride_cp, stride_vb, stride_vh, stride_vp, stride_table, scale, block_size,
                offs_n, offs_d, offs_v, D: tl.constexpr, DV: tl.constexpr):
    """The online softmax of q [G, D] (one KV head's query heads, float32) over the row's blocks
    [first, last) of its table, the positions [lo, length) visible: the running max, sum and
    output (m_i, l_i, acc), carried on from the ones given."""
    for b in range(first, last):
        block = tl.load(tables_ptr + row * stride_table + b)
        pos = b * block_size + offs_n
        visible = (offs_n < block_size) & (pos < length) & (pos >= lo)
        k = tl.load(key_cache_ptr + block * stride_cb + kv_head * stride_ch + offs_n[:, None] * stride_cp
                    + offs_d[None, :], mask=visible[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + block * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vp
                    + offs_v[None, :], mask=visible[:, None] & (offs_v[None, :] < DV), other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BLOCK_N]
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # every walked block has a visible position: finite
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _paged_attention_kernel(q_ptr, key_cache_ptr, value_cache_ptr, tables_ptr, rows_ptr, lengths_ptr, out_ptr,
                            stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_cb, stride_ch, stride_cp, stride_vb, stride_vh, stride_vp, stride_table,
                            scale, window, block_size,
                            G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                            DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(rows_ptr + t)
    length = tl.load(lengths_ptr + t)
    lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * G + offs_g
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g[:, None] < G) & (offs_d[None, :] < D), other=0.0).to(tl.float32)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.full([G_PAD], 0.0, tl.float32)
    acc = tl.full([G_PAD, DV_PAD], 0.0, tl.float32)
    m_i, l_i, acc = walk_blocks(q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr, tables_ptr, row, kv_head,
                                lo // block_size, (length + block_size - 1) // block_size, lo, length,
                                stride_cb, stride_ch, stride_cp, stride_vb, stride_vh, stride_vp, stride_table,
                                scale, block_size, offs_n, offs_d, offs_v, D, DV)
    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + offs_v[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(offs_g[:, None] < G) & (offs_v[None, :] < DV))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, scale: float,
                    window: int) -> torch.Tensor:
    """ops.reference_attention's contract."""
    t, heads, d = query.shape
    kvh, bs, dv = key_cache.shape[1], key_cache.shape[2], value_cache.shape[-1]
    out = torch.empty(t, heads, dv, dtype=query.dtype, device=query.device)
    if t == 0:
        return out
    query, block_tables = query.contiguous(), block_tables.contiguous()
    g = heads // kvh
    _paged_attention_kernel[(t, kvh)](
        query, key_cache, value_cache, block_tables, rows.contiguous(), lengths.contiguous(), out,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        float(scale), int(window), bs,
        G=g, G_PAD=max(2, triton.next_power_of_2(g)), D=d, D_PAD=triton.next_power_of_2(d), DV=dv,
        DV_PAD=triton.next_power_of_2(dv), BLOCK_N=max(2, triton.next_power_of_2(bs)))
    return out
