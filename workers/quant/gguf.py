"""A GGUF file's block types read into workers.quant's layout (the types each format holds are
workers.quant.formats' rows): Q4_0, Q4_1 and Q8_0 as they are (Q5_0's values, d x (q - 16), fit
int8 with its scale), Q4_K's sub-blocks of 32 as int4 with their scales and offsets rounded to
float16 (_from_q4_k), so the values the kernels compute with are the file's own dequantized
values (Q4_K's within that rounding)."""

from __future__ import annotations

import numpy as np
import torch

from workers.quant.formats import BLOCK, K_BLOCK, gguf_type
from workers.quant.weight import INT4, INT8, QuantizedWeight


def from_gguf_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor's blocks as they are: `raw` its bytes ([N, bytes a row], as gguf's reader
    gives them), `shape` (N, K). Q4_0's value is d * (q - 8): an offset of -8 d, exact in float16."""
    n, k = shape
    if type_name == "Q4_K":
        return _from_q4_k(raw, shape)
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // BLOCK, -1)
    if type_name == "Q8_0":  # d (f16), 32 x int8
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        q = blocks[..., 2:].copy().view(np.int8)
        return QuantizedWeight(INT8, torch.from_numpy(q.reshape(n, k)), torch.from_numpy(d.copy()), None)
    if type_name == "Q5_0":  # d (f16), 32 fifth bits (u32), 16 bytes of nibbles: d * (q - 16), q - 16 in int8
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        high = blocks[..., 2:6].copy().view("<u4")[..., 0]
        nib = blocks[..., 6:]
        low = np.concatenate([nib & 0x0F, nib >> 4], axis=-1).astype(np.int16)
        fifth = ((high[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4
        q = (low | fifth) - 16
        return QuantizedWeight(INT8, torch.from_numpy(q.astype(np.int8).reshape(n, k)), torch.from_numpy(d.copy()), None)
    if type_name == "Q4_1":  # d (f16), m (f16), 16 bytes of nibbles
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        qs = blocks[..., 4:]
    elif type_name == "Q4_0":  # d (f16), 16 bytes of nibbles
        d = blocks[..., :2].copy().view(np.float16)[..., 0]
        m = (-8 * d.astype(np.float32)).astype(np.float16)
        if not np.array_equal(m.astype(np.float32), -8 * d.astype(np.float32)):
            raise ValueError("a Q4_0 scale whose -8x overflows float16")
        qs = blocks[..., 2:]
    else:
        gguf_type(type_name)  # a ValueError naming the types kept
        raise ValueError(f"GGUF type {type_name} is not kept as blocks: its format quantizes it afresh from the "
                         "file's values")
    return QuantizedWeight(INT4, torch.from_numpy(np.ascontiguousarray(qs).reshape(n, k // 2)),
                           torch.from_numpy(d.copy()), torch.from_numpy(m.copy()))


def _from_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """Q4_K (llama.cpp's ggml-quants: superblocks of 256 values, d and dmin in float16, eight 6-bit
    scales and mins packed in 12 bytes, 128 bytes of nibbles) as int4 blocks of 32: sub-block j's
    values are d * sc_j * q - dmin * m_j, so its scale is d * sc_j and its offset -dmin * m_j.
    Those products take up to 17 significant bits; rounded to the layout's float16 they move a
    value by at most 2^-11 of its block's terms, under bfloat16's own rounding of the weights
    (gguf_blocks checks the bound)."""
    n, k = shape
    if k % K_BLOCK:
        raise ValueError(f"Q4_K rows hold superblocks of {K_BLOCK} values, got {k}")
    s = k // K_BLOCK
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, s, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = b[..., 4:16]
    sc = np.empty((n, s, 8), np.uint8)
    mins = np.empty((n, s, 8), np.uint8)
    sc[..., :4], mins[..., :4] = packed[..., 0:4] & 63, packed[..., 4:8] & 63
    sc[..., 4:] = (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)
    # sub-blocks 2g and 2g + 1 are the low and the high nibbles of the same 32 bytes
    q = b[..., 16:].reshape(n, s, 4, 32)
    values = np.stack([q & 0x0F, q >> 4], axis=3).reshape(n, s, 8, BLOCK)
    # this layout's nibbles: value j of a block in the low nibble of byte j, value j + 16 in the high
    qs = values[..., : BLOCK // 2] | (values[..., BLOCK // 2:] << 4)
    scales = (d[..., None] * sc).astype(np.float16).reshape(n, k // BLOCK)
    offsets = (-(dmin[..., None] * mins)).astype(np.float16).reshape(n, k // BLOCK)
    return QuantizedWeight(INT4, torch.from_numpy(np.ascontiguousarray(qs).reshape(n, k // 2)),
                           torch.from_numpy(scales), torch.from_numpy(offsets))


def rounding_bound(qw: QuantizedWeight) -> torch.Tensor:
    """[N, K]: how far a value of int4 blocks whose scales and offsets were rounded to float16 may
    lie from the value before the rounding (twice the rounding of each term, in float32)."""
    n, k = qw.out_features, qw.in_features
    per_block = (qw.scales.float().abs() * 15 + qw.offsets.float().abs()) * 2.0 ** -10
    return per_block.repeat_interleave(BLOCK, dim=1).view(n, k)
