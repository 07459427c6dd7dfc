"""Weight-only quantized linear weights: blocks of 32 values of one output row, as GGUF's Q4_0,
Q4_1 and Q8_0 lay them out (Q5_0's values, d x (q - 16), fit int8 with its scale), so a GGUF
file's blocks are kept as they are (the values it computes
with are the file's own dequantized values, bit for bit) and a 16-bit weight can be quantized
afresh into the same layout. Q4_K's sub-blocks of 32 fit int4 with their scales and offsets
rounded to float16 (_from_q4_k).

    int4: qs uint8 [N, K/2] (value j of a block in the low nibble of byte j, value j + 16 in its
          high nibble), scales and offsets float16 [N, K/32]:  w = scale * q + offset
    int8: qs int8 [N, K], scales float16 [N, K/32]:             w = scale * q

The C++ kernels (workers/engine/kernels/qlinear.cpp) multiply activations in the compute dtype
by these blocks in float32; `dequantize` is their reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
INT4, INT8 = "int4", "int8"
KINDS = (INT4, INT8)
# GGUF's block types that run quantized, and the kind each becomes (gguf.GGMLQuantizationType's
# names): kept as they are, but for GGUF_ROUNDED and GGUF_REQUANTIZED below
GGUF_KEPT = {"Q4_0": INT4, "Q4_1": INT4, "Q5_0": INT8, "Q8_0": INT8, "Q4_K": INT4, "Q5_K": INT8, "Q6_K": INT8}
# kept with their block scales and offsets rounded to float16 (the others' are float16 in the file)
GGUF_ROUNDED = ("Q4_K",)
# whose blocks this layout cannot hold (Q5_K's values need an offset beside an int8 scale; Q6_K
# has two scales in a block of 32): int8 quantized afresh from the file's values, each within half
# an int8 step of its block (a quarter of Q6_K's own step)
GGUF_REQUANTIZED = ("Q5_K", "Q6_K")
K_BLOCK = 256  # a K-quant's superblock


@dataclass(frozen=True, slots=True, eq=False)
class QuantizedWeight:
    kind: str  # INT4 or INT8
    qs: torch.Tensor
    scales: torch.Tensor  # float16 [N, K/32]
    offsets: torch.Tensor | None  # float16 [N, K/32] (int4 only)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"quantized weight kind must be one of {KINDS}, got {self.kind!r}")
        n = self.qs.shape[0]
        k = self.in_features
        if self.scales.dtype != torch.float16 or tuple(self.scales.shape) != (n, k // BLOCK):
            raise ValueError(f"scales must be float16 [{n}, {k // BLOCK}], got {self.scales.dtype} {tuple(self.scales.shape)}")
        if (self.kind == INT4) != (self.offsets is not None):
            raise ValueError("int4 weights take offsets, int8 weights none")

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * (2 if self.kind == INT4 else 1)

    @property
    def nbytes(self) -> int:
        parts = [self.qs, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the kernels compute with (GGUF's dequantized values)."""
        n, k = self.out_features, self.in_features
        d = self.scales.float().view(n, k // BLOCK, 1)
        if self.kind == INT8:
            return (d * self.qs.view(n, k // BLOCK, BLOCK).float()).view(n, k)
        q = self.qs.view(n, k // BLOCK, BLOCK // 2)
        values = torch.cat([q & 0x0F, q >> 4], dim=-1).float()  # low nibbles are values 0..15
        return (d * values + self.offsets.float().view(n, k // BLOCK, 1)).view(n, k)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        """The same blocks on `device`."""
        return QuantizedWeight(self.kind, self.qs.to(device), self.scales.to(device),
                               None if self.offsets is None else self.offsets.to(device))

    def rows(self, order: torch.Tensor) -> QuantizedWeight:
        """The same weight with its output rows in `order` (whole rows: exact)."""
        return QuantizedWeight(self.kind, self.qs[order].contiguous(), self.scales[order].contiguous(),
                               None if self.offsets is None else self.offsets[order].contiguous())


def concat(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Output rows of several weights of one kind stacked (q, k, v; gate, up)."""
    kinds = {w.kind for w in weights}
    if len(kinds) != 1:
        raise ValueError(f"cannot stack weights of kinds {sorted(kinds)}")
    offsets = None if weights[0].offsets is None else torch.cat([w.offsets for w in weights])
    return QuantizedWeight(weights[0].kind, torch.cat([w.qs for w in weights]), torch.cat([w.scales for w in weights]),
                           offsets)


def quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    """A 16- or 32-bit weight [N, K] quantized afresh, round to nearest: int8 symmetric (Q8_0's
    rule: scale = max |w| / 127), int4 with an offset (Q4_1's: the block's minimum and its range / 15).
    The scales are rounded to float16 before the values are, so the kernel's values are the ones
    chosen here."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"a quantized weight must be [N, K] with K a multiple of {BLOCK}, got {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    if kind == INT8:
        d = (w.abs().amax(-1, keepdim=True) / 127).half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        q = torch.round(w * inv).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(INT8, q.reshape(n, k).contiguous(), d.reshape(n, k // BLOCK).contiguous(), None)
    if kind != INT4:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d = ((hi - lo) / 15).half()
    m = lo.half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round((w - m.float()) * inv).clamp(0, 15).to(torch.uint8)
    packed = q[..., : BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return QuantizedWeight(INT4, packed.reshape(n, k // 2).contiguous(), d.reshape(n, k // BLOCK).contiguous(),
                           m.reshape(n, k // BLOCK).contiguous())


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
        raise ValueError(f"GGUF type {type_name} is not kept as blocks (kept: {sorted(GGUF_KEPT)})")
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
