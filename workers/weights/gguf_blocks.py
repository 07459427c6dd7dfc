"""A GGUF file's quantized blocks, kept as they are for the lean forward's quantized linears
(workers.quant): the linears of the Llama family and Gemma 3 by transformers' module names,
their output rows in transformers' order.

transformers dequantizes a GGUF file at load and, for the Llama architecture, reorders the rows
of q and k (llama.cpp's converter interleaves the rotary halves); the same reordering of whole
rows applies to the blocks, exactly. Every tensor kept is checked against the model's own weight:
its dequantized values, in the model's dtype, must equal it bit for bit, or it is not kept (the
caller quantizes that linear afresh). Q4_K's block scales and offsets are products of a float16
and a 6-bit integer, rounded to the layout's float16: its values are checked to lie within that
rounding of the weight's (at most 2^-11 of the block's terms, under bfloat16's own rounding).
Q5_K and Q6_K do not fit the layout (an offset beside an int8 scale; two scales in a block of
32): their linears take int8 quantized afresh from the file's values, each within half an int8
step of its block, a quarter of Q6_K's own step.
"""

from __future__ import annotations

import logging
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workers.quant.formats import BLOCK, GGUF_TYPES, REQUANTIZED, ROUNDED
from workers.quant.gguf import from_gguf_blocks, rounding_bound
from workers.quant.weight import QuantizedWeight, quantize

log = logging.getLogger("mmfusion.gguf")

# GGUF's tensor names of a layer -> transformers' module under model.layers.{i}
LAYER_MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


# GGUF metadata value types -> bytes (8: string, 9: array); the tensor types kept are
# workers.quant.formats.GGUF_TYPES
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    type_id: int
    dims: tuple[int, ...]  # GGUF's order: the row length first
    offset: int  # of its data, from the start of the file


def read_tensors(path: Path) -> tuple[str, list[GGUFTensor], mmap.mmap]:
    """(general.architecture, the tensor table, the file mapped read-only). The metadata is walked,
    not decoded: gguf's reader builds an object for every token of the vocabulary (a few seconds
    for SmolLM2's file), and only the architecture and the alignment are wanted here."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if mm[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
    pos = 24
    arch, alignment = "", 32

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", mm, at)
        return mm[at + 8: at + 8 + n].decode("utf-8", "replace"), at + 8 + n

    def skip(vtype: int, at: int) -> int:
        if vtype in _SCALARS:
            return at + _SCALARS[vtype]
        if vtype == 8:
            return at + 8 + struct.unpack_from("<Q", mm, at)[0]
        if vtype == 9:
            item, count = struct.unpack_from("<IQ", mm, at)
            at += 12
            if item in _SCALARS:
                return at + count * _SCALARS[item]
            for _ in range(count):
                at = skip(item, at)
            return at
        raise ValueError(f"{path}: unknown GGUF value type {vtype}")

    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", mm, pos)
        pos += 4
        if key == "general.architecture" and vtype == 8:
            arch, pos = string(pos)
        elif key == "general.alignment" and vtype == 4:
            (alignment,) = struct.unpack_from("<I", mm, pos)
            pos += 4
        else:
            pos = skip(vtype, pos)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", mm, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
        type_id, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, type_id, tuple(dims), offset))
    start = -(-pos // alignment) * alignment
    return arch, [GGUFTensor(n, t, d, start + o) for n, t, d, o in infos], mm


def _rows_order(n: int, heads: int) -> torch.Tensor:
    """transformers' reverse permutation of q or k's rows (LlamaTensorProcessor), as an index."""
    dim = n // heads // 2
    return torch.arange(n).reshape(heads, dim, 2).transpose(1, 2).reshape(n)


def _equal(qw: QuantizedWeight, weight: torch.Tensor, rounded: bool) -> bool:
    """Whether the blocks give the model's weight: bit for bit in its dtype, or for blocks whose
    scales were rounded to float16 (Q4_K), within that rounding (quantized.rounding_bound)."""
    values = qw.dequantize().to(weight.device)
    if not rounded:
        return torch.equal(values.to(weight.dtype), weight)
    w = weight.float()
    # a 16-bit weight is the file's value rounded once more: one unit in its last place besides
    bound = rounding_bound(qw).to(weight.device) + w.abs() * torch.finfo(weight.dtype).eps
    return bool(((values - w).abs() <= bound).all())


def _module_name(gguf_name: str, tied: bool) -> str | None:
    m = _LAYER.fullmatch(gguf_name)
    if m is not None:
        module = LAYER_MODULES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{module}" if module else None
    if gguf_name == "output.weight" or (gguf_name == "token_embd.weight" and tied):
        return "lm_head"
    return None


def file_class(path: Path) -> str | None:
    """The class of a GGUF file's layers for `quantization: auto`: the kind (int4 or int8) of the
    kept types (Q4_0, Q4_1, Q4_K as int4; Q5_0, Q8_0, and Q5_K, Q6_K requantized, as int8) that
    holds most of its layers' linear weights, or None where most are of other types (16/32-bit,
    Q2_K, Q3_K)."""
    _, tensors, mm = read_tensors(path)
    mm.close()
    counts: dict[str | None, int] = {}
    for t in tensors:
        m = _LAYER.fullmatch(t.name)
        if m is not None and m.group(2) in LAYER_MODULES and len(t.dims) == 2:
            kind = GGUF_TYPES[t.type_id][1].name if t.type_id in GGUF_TYPES else None
            counts[kind] = counts.get(kind, 0) + t.dims[0] * t.dims[1]
    return max(counts, key=counts.get) if counts else None


def gguf_blocks(path: Path, model) -> dict[str, QuantizedWeight]:
    """Module name -> the file's blocks of that linear, for every linear whose GGUF type is kept
    (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K) and whose values equal the model's weight (see _equal); Q5_K
    and Q6_K linears as int8 quantized afresh from the weight, which holds the file's values."""
    arch, tensors, mm = read_tensors(path)
    cfg = model.config.get_text_config()
    tied = bool(getattr(model.config, "tie_word_embeddings", False)) and not any(
        t.name == "output.weight" for t in tensors)
    modules = dict(model.named_modules())
    out: dict[str, QuantizedWeight] = {}
    for t in tensors:
        name = _module_name(t.name, tied)
        if name is None or t.type_id not in GGUF_TYPES or name not in modules or len(t.dims) != 2:
            continue
        gtype, fmt = GGUF_TYPES[t.type_id]
        type_name = gtype.name
        weight = modules[name].weight
        k, n = t.dims
        if (n, k) != tuple(weight.shape) or k % gtype.row_multiple:
            continue
        if gtype.conversion == REQUANTIZED:  # the file's values (the model's weight), afresh in its format
            out[name] = quantize(weight.detach(), fmt.name)
            continue
        raw = np.frombuffer(mm, dtype=np.uint8, count=int(n * k // BLOCK * gtype.block_bytes), offset=t.offset)
        qw = from_gguf_blocks(type_name, raw.reshape(n, -1), (n, k))
        if arch == "llama" and name.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if name.endswith("q_proj") else (cfg.num_key_value_heads or cfg.num_attention_heads)
            qw = qw.rows(_rows_order(qw.out_features, heads))
        if not _equal(qw, weight.detach(), gtype.conversion == ROUNDED):
            log.warning("GGUF tensor %s (%s) does not equal %s's weight: quantized afresh", t.name, type_name, name)
            continue
        out[name] = qw
    return out
