"""torch's tinygemm for a linear's int4 blocks on a GPU: `aten._weight_int4pack_mm`, the int4 kernel
of gpt-fast and torchao (tensor-core tiles of 16 rows, each weight widened in registers from a
layout packed once for them), a well-kept alternative to the Triton kernel for steps of few rows.
Which of the two serves how many rows is measured at load (workers.engine.cuda.int4_rows).

tinygemm's weight is (q - 8) x scale + zero per group of 32 inputs, its scale and zero in
bfloat16; a block's is scale x q + offset with both in float16. So scale is the block's scale and
zero = offset + 8 x scale, each rounded to bfloat16: a weight then moves from the file's value by
about what rounding it to bfloat16 moves it (where the CPU's `packed` way and transformers on the
dequantized weights in bfloat16 put it), and the products are bfloat16's on the tensor cores. So
it serves bfloat16 activations only, and never `deterministic` (its tiles follow the rows).

The packing wants the inputs in tiles of 16 (`inner_k_tiles` of them a load: 2, 4 or 8) and the
outputs in multiples of 16: SmolLM2's 576 inputs take 4, 1,536 take 8. On a CPU (the tests) torch's
`_for_cpu` pair takes the same values and scales, in its own layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.devices import device_kind
from workers.quant.formats import BLOCK
from workers.quant.weight import INT4, QuantizedWeight

GROUP = BLOCK  # inputs a scale and zero: a block
TILE_K = 16  # inputs a tensor-core tile
INNER_K_TILES = (8, 4, 2)  # the widest load that divides the inputs first
OUT_MULTIPLE = 16  # CUDA packs outputs by 8, the CPU twin (the tests) by 16


def inner_k_tiles(in_features: int) -> int | None:
    """The tiles of 16 inputs packed side by side for one load (None: no packing fits)."""
    return next((t for t in INNER_K_TILES if in_features % (t * TILE_K) == 0), None)


def refusal(weight: QuantizedWeight, dtype: torch.dtype) -> str | None:
    """Why tinygemm cannot multiply `weight` for activations of `dtype` (None: it can)."""
    if weight.kind != INT4:
        return f"tinygemm multiplies int4 blocks, not {weight.kind}"
    if dtype != torch.bfloat16:
        return f"tinygemm takes bfloat16 activations, not {dtype}"
    if weight.out_features % OUT_MULTIPLE:
        return f"tinygemm wants outputs in multiples of {OUT_MULTIPLE}, got {weight.out_features}"
    if inner_k_tiles(weight.in_features) is None:
        return f"tinygemm wants inputs in multiples of {INNER_K_TILES[-1] * TILE_K}, got {weight.in_features}"
    return None


def values(weight: QuantizedWeight) -> torch.Tensor:
    """The blocks' integers 0-15 in input order, int32 [N, K]: a block's byte j holds value j in its
    low nibble and value j + 16 in its high one."""
    n, k = weight.out_features, weight.in_features
    q = weight.qs.view(n, k // BLOCK, BLOCK // 2)
    return torch.cat([q & 0x0F, q >> 4], dim=-1).view(n, k).to(torch.int32)


def scales_and_zeros(weight: QuantizedWeight) -> torch.Tensor:
    """tinygemm's [K / 32, N, 2] bfloat16: each group's scale and its zero (offset + 8 x scale,
    summed in float32 before the one rounding)."""
    scale = weight.scales.float()
    zero = weight.offsets.float() + 8.0 * scale
    return torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)


@dataclass(frozen=True, slots=True, eq=False)
class Int4Pack:
    """One int4 linear packed for tinygemm on the weight's device; called as x @ W.T (+ bias)."""

    packed: torch.Tensor
    scale_zero: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def of(cls, weight: QuantizedWeight) -> Int4Pack:
        why = refusal(weight, torch.bfloat16)
        if why is not None:
            raise ValueError(why)
        tiles = inner_k_tiles(weight.in_features)
        q = values(weight)
        if device_kind(q.device).host:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, tiles)
        else:  # two values a byte, the earlier input in the high nibble (int4mm.cu's layout)
            pairs = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
        return cls(packed, scales_and_zeros(weight), weight.out_features, weight.in_features)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zero))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.shape[-1] != self.in_features:
            raise ValueError(f"tinygemm: x must be bfloat16 [rows, {self.in_features}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        x = x.contiguous()
        if device_kind(x.device).host:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zero)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x, self.packed, GROUP, self.scale_zero)
        return y if bias is None else y + bias.to(y.dtype)
