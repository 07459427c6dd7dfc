"""Weight-only quantized linear weights: blocks of 32 values of one output row, as GGUF's Q4_0,
Q4_1 and Q8_0 lay them out, so a GGUF file's blocks are kept as they are (workers.quant.gguf) and
a 16-bit weight can be quantized afresh into the same layout. The formats and what each holds are
workers.quant.formats' rows.

    int4: qs uint8 [N, K/2] (value j of a block in the low nibble of byte j, value j + 16 in its
          high nibble), scales and offsets float16 [N, K/32]:  w = scale * q + offset
    int8: qs int8 [N, K], scales float16 [N, K/32]:             w = scale * q

The kernels (the CPU's workers/engine/cpu/kernels/qlinear*.cpp, the GPU's Triton kernel) multiply activations in the compute dtype
by these blocks in float32; `dequantize` is their reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.quant.formats import BLOCK, FORMATS, INT4_BLOCKS, INT8_BLOCKS, QuantFormat

INT4, INT8 = INT4_BLOCKS.name, INT8_BLOCKS.name
KINDS = tuple(FORMATS)


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
        if self.format.offsets != (self.offsets is not None):
            raise ValueError(f"{self.kind} weights take {'offsets' if self.format.offsets else 'no offsets'}")

    @property
    def format(self) -> QuantFormat:
        return FORMATS[self.kind]

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def in_features(self) -> int:
        return self.qs.shape[1] * 8 // self.format.bits

    @property
    def nbytes(self) -> int:
        parts = [self.qs, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the kernels compute with (GGUF's dequantized values)."""
        n, k = self.out_features, self.in_features
        d = self.scales.float().view(n, k // BLOCK, 1)
        if self.format.bits == 8:
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


def to_tensors(weights: dict[str, QuantizedWeight]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Each weight's tensors by `<name>.qs`, `<name>.scales` and `<name>.offsets`, and its kind by
    name: the form a file (workers.weights.quantized_cache) or another process (a weight owner's
    copies) takes them in. from_tensors turns them back."""
    tensors, kinds = {}, {}
    for name, w in weights.items():
        kinds[name] = w.kind
        tensors[f"{name}.qs"], tensors[f"{name}.scales"] = w.qs, w.scales
        if w.offsets is not None:
            tensors[f"{name}.offsets"] = w.offsets
    return tensors, kinds


def from_tensors(tensors: dict[str, torch.Tensor], kinds: dict[str, str]) -> dict[str, QuantizedWeight]:
    return {name: QuantizedWeight(kind, tensors[f"{name}.qs"], tensors[f"{name}.scales"], tensors.get(f"{name}.offsets"))
            for name, kind in kinds.items()}
