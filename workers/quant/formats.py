"""The quantization formats: one row each, the one place a format is described.

A format is what `quantization: int4` or `int8` names and what a QuantizedWeight's `kind` is. Its
row says everything the rest of the project asks of it:
- its layout: bits a value, whether a block carries an offset beside its scale, and the bytes a
  block of BLOCK values takes (the plan sizes a copy with `plan_block_bytes`);
- the GGUF block types it keeps and how each converts (as it is, scales rounded to float16, or
  quantized afresh from the file's values): `quantization: auto` and workers.weights.gguf_blocks
  read the file through these;
- the device kinds that have its kernels (workers.platform asks once, at load: a device without
  them refuses the setting by name) and the kernels themselves: the C++ function of the CPU's
  extension (workers/engine/cpu/kernels/) and its kind in the fused decode layers.

Adding a format is one row in FORMATS plus its kernels (docs/architecture.md shows the steps).
This module imports nothing of torch: the planner and the platform read it before any load.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK = 32  # values of one output row that share a scale (and an offset)

# how a GGUF block type becomes a format's blocks
KEPT = "kept"  # its bytes as they are: the values the kernels compute with are the file's own
ROUNDED = "rounded"  # its block scales and offsets rounded to float16 (checked within that rounding)
REQUANTIZED = "requantized"  # quantized afresh from the file's values (its blocks do not fit the layout)


@dataclass(frozen=True, slots=True)
class GgufType:
    name: str  # gguf.GGMLQuantizationType's name
    type_id: int  # its number in a GGUF file's tensor table
    block_bytes: float  # bytes a block of BLOCK values takes in the file
    conversion: str  # KEPT, ROUNDED or REQUANTIZED
    row_multiple: int = BLOCK  # a row's length must be a multiple of this (a K-quant's superblock)


@dataclass(frozen=True, slots=True)
class QuantFormat:
    name: str  # the `quantization` setting and QuantizedWeight.kind
    bits: int  # of a value
    offsets: bool  # w = scale * q + offset (else scale * q)
    block_bytes: int  # bytes a block of BLOCK values holds: the values, a float16 scale (and offset)
    plan_block_bytes: int  # what the plan counts a block at (the LM head kept wider included)
    devices: tuple[str, ...]  # device kinds (workers.devices) that have its kernels
    cpu_kernel: str  # the CPU extension's function: (x, qs, scales, offsets, bias, strips)
    kernel_kind: int  # its kind in the C++ fused decode layers (kernels/decode_layers.h)
    gguf: tuple[GgufType, ...]  # the GGUF types this format holds


K_BLOCK = 256  # a K-quant's superblock

INT4_BLOCKS = QuantFormat(
    "int4", 4, True, 20, 24, ("cpu", "cuda"), "qlinear_int4", 0,
    (GgufType("Q4_0", 2, 18, KEPT), GgufType("Q4_1", 3, 20, KEPT), GgufType("Q4_K", 12, 18, ROUNDED, K_BLOCK)))
INT8_BLOCKS = QuantFormat(
    "int8", 8, False, 34, 34, ("cpu", "cuda"), "qlinear_int8", 1,
    (GgufType("Q5_0", 6, 22, KEPT), GgufType("Q8_0", 8, 34, KEPT),
     GgufType("Q5_K", 13, 22, REQUANTIZED), GgufType("Q6_K", 14, 26.25, REQUANTIZED)))

FORMATS: dict[str, QuantFormat] = {f.name: f for f in (INT4_BLOCKS, INT8_BLOCKS)}
# a GGUF tensor type's number -> (the type, the format that holds it)
GGUF_TYPES: dict[int, tuple[GgufType, QuantFormat]] = {t.type_id: (t, f) for f in FORMATS.values() for t in f.gguf}


def quant_format(name: str) -> QuantFormat:
    """The format of this name; a ValueError names the ones there are."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"quantization format must be one of {', '.join(FORMATS)}, got {name!r}") from None


def gguf_type(name: str) -> tuple[GgufType, QuantFormat]:
    """A GGUF block type by name, with the format that holds it."""
    for t, f in GGUF_TYPES.values():
        if t.name == name:
            return t, f
    kept = sorted(t.name for t, _ in GGUF_TYPES.values())
    raise ValueError(f"GGUF type {name} is not kept as blocks (kept: {', '.join(kept)})")
