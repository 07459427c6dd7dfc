"""Decode attention split over the context (flash-decoding), as Triton kernels: the paged ops'
`decode_attention` (workers.engine.cuda.ops).

At one row a sequence, one program per (row, KV head) walks the whole context alone: a handful of
programs on a GPU of a hundred SMs. Here the context is cut into segments of a fixed number of
positions (`SEGMENT`, aligned to position 0): one program per (row, KV head, segment) keeps an
online softmax over its segment's blocks, with the query heads of the KV head packed as one tile,
and writes its partial output with its running max and sum. A second kernel merges each row's
segments one after another, in order. The cut depends on positions only, never on the batch or the grid: a row's
answer is the same bits whatever runs beside it, so `deterministic` keeps this kernel
(vLLM's unified attention and SGLang's decode attention split a short batch the same way; they
size the split by the batch, which this does not).

The grid's segment count covers the block table's width (every position a row can name), so it
is a static shape inside a captured graph; programs past a row's length return at once.
Everything accumulates in float32. Set TRITON_INTERPRET before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.engine.cuda.triton_attention import walk_blocks

SEGMENT = 256  # positions a program walks: a multiple of every block size the pool uses (16, 32, ...)


@triton.jit
def _segment_kernel(q_ptr, key_cache_ptr, value_cache_ptr, tables_ptr, rows_ptr, lengths_ptr,
                    part_ptr, max_ptr, sum_ptr,
                    stride_qt, stride_qh, stride_cb, stride_ch, stride_cp, stride_vb, stride_vh, stride_vp,
                    stride_table, segments, scale, window, block_size,
                    HEADS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                    D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                    SEG_BLOCKS: tl.constexpr):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.program_id(2)
    row = tl.load(rows_ptr + t)
    length = tl.load(lengths_ptr + t)
    lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * G + offs_g
    live = offs_g < G
    # partials: [T, HEADS, segments, DV] and [T, HEADS, segments]
    stat = (t * HEADS + heads) * segments + seg
    first = tl.maximum(seg * SEG_BLOCKS, lo // block_size)
    last = tl.minimum((seg + 1) * SEG_BLOCKS, (length + block_size - 1) // block_size)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.full([G_PAD], 0.0, tl.float32)
    acc = tl.full([G_PAD, DV_PAD], 0.0, tl.float32)
    if first < last:
        q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=live[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        m_i, l_i, acc = walk_blocks(q, m_i, l_i, acc, key_cache_ptr, value_cache_ptr, tables_ptr, row, kv_head,
                                    first, last, lo, length, stride_cb, stride_ch, stride_cp, stride_vb, stride_vh,
                                    stride_vp, stride_table, scale, block_size, offs_n, offs_d, offs_v, D, DV)
    tl.store(part_ptr + stat[:, None] * DV + offs_v[None, :], acc, mask=live[:, None] & (offs_v[None, :] < DV))
    tl.store(max_ptr + stat, m_i, mask=live)
    tl.store(sum_ptr + stat, l_i, mask=live)


@triton.jit
def _merge_kernel(part_ptr, max_ptr, sum_ptr, out_ptr, stride_ot, stride_oh, segments,
                  HEADS: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_v = tl.arange(0, DV_PAD)
    base = (t * HEADS + h) * segments
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([DV_PAD], tl.float32)
    # the segments in order, one at a time: a segment with no position (max -inf) leaves every bit
    # as it was, so the grid's width (the block table's) changes nothing either
    for s in range(segments):
        m_s = tl.load(max_ptr + base + s)
        if m_s > float("-inf"):
            m_new = tl.maximum(m, m_s)
            alpha = tl.exp(m - m_new)
            w = tl.exp(m_s - m_new)
            total = total * alpha + tl.load(sum_ptr + base + s) * w
            acc = acc * alpha + tl.load(part_ptr + (base + s) * DV + offs_v, mask=offs_v < DV, other=0.0) * w
            m = m_new
    out = tl.where(total > 0, acc / tl.maximum(total, 1e-30), 0.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_v, out.to(out_ptr.dtype.element_ty), mask=offs_v < DV)


def segments_for(table_width: int, block_size: int, segment: int = SEGMENT) -> int:
    """Segments a row of `table_width` blocks can span: the grid's static third dimension."""
    per = max(1, segment // block_size)
    return max(1, -(-table_width // per))


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, scale: float,
                     window: int, segment: int = SEGMENT) -> torch.Tensor:
    """ops.reference_attention's contract, split over the context in segments of `segment` positions
    (rounded down to whole blocks, at least one)."""
    t, heads, d = query.shape
    kvh, bs, dv = key_cache.shape[1], key_cache.shape[2], value_cache.shape[-1]
    out = torch.empty(t, heads, dv, dtype=query.dtype, device=query.device)
    if t == 0:
        return out
    query, block_tables = query.contiguous(), block_tables.contiguous()
    g = heads // kvh
    seg_blocks = max(1, segment // bs)
    segments = segments_for(block_tables.shape[1], bs, segment)
    part = torch.empty(t, heads, segments, dv, dtype=torch.float32, device=query.device)
    maxes = torch.empty(t, heads, segments, dtype=torch.float32, device=query.device)
    sums = torch.empty_like(maxes)
    _segment_kernel[(t, kvh, segments)](
        query, key_cache, value_cache, block_tables, rows.contiguous(), lengths.contiguous(), part, maxes, sums,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        segments, float(scale), int(window), bs,
        HEADS=heads, G=g, G_PAD=max(2, triton.next_power_of_2(g)), D=d, D_PAD=triton.next_power_of_2(d), DV=dv,
        DV_PAD=triton.next_power_of_2(dv), BLOCK_N=max(2, triton.next_power_of_2(bs)), SEG_BLOCKS=seg_blocks)
    _merge_kernel[(t, heads)](part, maxes, sums, out, out.stride(0), out.stride(1), segments, HEADS=heads, DV=dv,
                              DV_PAD=triton.next_power_of_2(dv))
    return out
