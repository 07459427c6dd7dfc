"""Decode attention split over the context (flash-decoding), as Triton kernels: the paged ops'
`decode_attention` (workers.engine.cuda.ops).

At one row a sequence, a program per (row, KV head) that walks the whole context alone is a
handful of programs on a GPU of a hundred SMs, each a chain of dependent loads (the block table,
then a block's keys) one block at a time. Here the context is cut into segments of a fixed number
of positions (`SEGMENT`, aligned to position 0), and a segment is one tile: its positions' blocks
are looked up together and its keys and values gathered at once, the query heads of its KV head
packed as the tile's rows. A program computes the segments `s, s + P, s + 2P, ...` of its row
(P programs a row and KV head, sized so that the grid fills the GPU) and writes each segment's
partial output with its max and sum. A second kernel merges a row's segments, a fixed number at a
time in position order.

What a segment computes depends on its positions only, never on the batch, the grid or which
program ran it, and the merge's order depends on the row's length only: a row's answer is the same
bits whatever runs beside it, so `deterministic` keeps this kernel (vLLM's unified attention and
SGLang's decode attention split a short batch the same way; they size the split by the batch,
which changes a row's sums; this sizes only the programs that do the fixed split).

The grid is a static shape inside a captured graph (rows, KV heads, P); programs with no segment
of their row return at once. Everything accumulates in float32. Set TRITON_INTERPRET before this
module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SEGMENT = 64  # positions a segment: one tile of keys (a power of two, 16 or more; blocks need not divide it)
MERGE = 32  # segments the merge reads at a time
PROGRAMS = 1024  # programs the segment kernel's grid aims at: enough to fill a GPU's SMs


@triton.jit
def _segment_kernel(q_ptr, key_cache_ptr, value_cache_ptr, tables_ptr, rows_ptr, lengths_ptr,
                    part_ptr, max_ptr, sum_ptr,
                    stride_qt, stride_qh, stride_cb, stride_ch, stride_cp, stride_vb, stride_vh, stride_vp,
                    stride_table, segments, scale, window, block_size,
                    HEADS: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                    D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, SEG: tl.constexpr):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(rows_ptr + t)
    length = tl.load(lengths_ptr + t)
    lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    offs_n = tl.arange(0, SEG)
    heads = kv_head * G + offs_g
    live = offs_g < G
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=live[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
    # partials: [T, HEADS, segments, DV] and [T, HEADS, segments]
    stat = (t * HEADS + heads) * segments
    for seg in range(lo // SEG + tl.program_id(2), tl.cdiv(length, SEG), tl.num_programs(2)):
        pos = seg * SEG + offs_n
        visible = (pos < length) & (pos >= lo)  # every segment walked has one
        block = tl.load(tables_ptr + row * stride_table + pos // block_size, mask=visible, other=0)
        at = pos % block_size
        k = tl.load(key_cache_ptr + block[:, None] * stride_cb + kv_head * stride_ch + at[:, None] * stride_cp
                    + offs_d[None, :], mask=visible[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + block[:, None] * stride_vb + kv_head * stride_vh + at[:, None] * stride_vp
                    + offs_v[None, :], mask=visible[:, None] & (offs_v[None, :] < DV), other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G_PAD, SEG]
        s = tl.where(visible[None, :], s, float("-inf"))
        m = tl.max(s, axis=1)
        p = tl.exp(s - m[:, None])
        acc = tl.dot(p, v, input_precision="ieee")  # [G_PAD, DV_PAD]
        tl.store(part_ptr + (stat + seg)[:, None] * DV + offs_v[None, :], acc,
                 mask=live[:, None] & (offs_v[None, :] < DV))
        tl.store(max_ptr + stat + seg, m, mask=live)
        tl.store(sum_ptr + stat + seg, tl.sum(p, axis=1), mask=live)


@triton.jit
def _merge_kernel(part_ptr, max_ptr, sum_ptr, lengths_ptr, out_ptr, stride_ot, stride_oh, segments, window,
                  HEADS: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr, SEG: tl.constexpr,
                  CHUNK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(lengths_ptr + t)
    lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    offs_v = tl.arange(0, DV_PAD)
    offs_c = tl.arange(0, CHUNK)
    base = (t * HEADS + h) * segments
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([DV_PAD], tl.float32)
    last = tl.cdiv(length, SEG)
    # the row's segments in position order, CHUNK at a time: the order depends on the length alone
    for c in range(lo // SEG, last, CHUNK):
        seg = c + offs_c
        here = seg < last
        m_s = tl.load(max_ptr + base + seg, mask=here, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(m_s, axis=0))
        alpha = tl.exp(m - m_new)
        w = tl.where(here, tl.exp(m_s - m_new), 0.0)
        total = total * alpha + tl.sum(w * tl.load(sum_ptr + base + seg, mask=here, other=0.0), axis=0)
        part = tl.load(part_ptr + (base + seg)[:, None] * DV + offs_v[None, :],
                       mask=here[:, None] & (offs_v[None, :] < DV), other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * part, axis=0)
        m = m_new
    out = tl.where(total > 0, acc / tl.maximum(total, 1e-30), 0.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_v, out.to(out_ptr.dtype.element_ty), mask=offs_v < DV)


def segments_for(table_width: int, block_size: int, segment: int = SEGMENT) -> int:
    """Segments a row of `table_width` blocks can span: the partials' static width."""
    return max(1, -(-table_width * block_size // segment))


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, scale: float,
                     window: int, segment: int = SEGMENT, programs: int | None = None) -> torch.Tensor:
    """ops.reference_attention's contract, split over the context in segments of `segment`
    positions (a power of two). `programs`: programs a row and KV head (None: enough to fill a
    GPU); any number gives the same bits."""
    if segment < 16 or segment & (segment - 1):
        raise ValueError(f"decode_attention: a segment is a power of two of at least 16 positions, not {segment}")
    t, heads, d = query.shape
    kvh, bs, dv = key_cache.shape[1], key_cache.shape[2], value_cache.shape[-1]
    out = torch.empty(t, heads, dv, dtype=query.dtype, device=query.device)
    if t == 0:
        return out
    query, block_tables, lengths = query.contiguous(), block_tables.contiguous(), lengths.contiguous()
    g = heads // kvh
    segments = segments_for(block_tables.shape[1], bs, segment)
    spread = programs or min(segments, max(1, -(-PROGRAMS // (t * kvh))))
    part = torch.empty(t, heads, segments, dv, dtype=torch.float32, device=query.device)
    maxes = torch.empty(t, heads, segments, dtype=torch.float32, device=query.device)
    sums = torch.empty_like(maxes)
    _segment_kernel[(t, kvh, spread)](
        query, key_cache, value_cache, block_tables, rows.contiguous(), lengths, part, maxes, sums,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        segments, float(scale), int(window), bs,
        # a dot's inner dimension is at least 16 on every Triton version the kernels meet
        HEADS=heads, G=g, G_PAD=max(2, triton.next_power_of_2(g)), D=d, D_PAD=max(16, triton.next_power_of_2(d)),
        DV=dv, DV_PAD=triton.next_power_of_2(dv), SEG=segment)
    _merge_kernel[(t, heads)](part, maxes, sums, lengths, out, out.stride(0), out.stride(1), segments, int(window),
                              HEADS=heads, DV=dv, DV_PAD=triton.next_power_of_2(dv), SEG=segment,
                              CHUNK=MERGE)
    return out
