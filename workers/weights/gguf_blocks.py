"""A GGUF file's quantized blocks, kept as they are for the lean forward's quantized linears
(workers.quantized): the linears of the Llama family and Gemma 3 by transformers' module names,
their output rows in transformers' order.

transformers dequantizes a GGUF file at load and, for the Llama architecture, reorders the rows
of q and k (llama.cpp's converter interleaves the rotary halves); the same reordering of whole
rows applies to the blocks, exactly. Every tensor kept is checked against the model's own weight:
its dequantized values, in the model's dtype, must equal it bit for bit, or it is not kept (the
caller quantizes that linear afresh).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from workers.quantized import GGUF_KEPT, QuantizedWeight, from_gguf_blocks

log = logging.getLogger("mmfusion.gguf")

# GGUF's tensor names of a layer -> transformers' module under model.layers.{i}
LAYER_MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def _rows_order(n: int, heads: int) -> torch.Tensor:
    """transformers' reverse permutation of q or k's rows (LlamaTensorProcessor), as an index."""
    dim = n // heads // 2
    return torch.arange(n).reshape(heads, dim, 2).transpose(1, 2).reshape(n)


def _module_name(gguf_name: str, tied: bool) -> str | None:
    m = _LAYER.fullmatch(gguf_name)
    if m is not None:
        module = LAYER_MODULES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{module}" if module else None
    if gguf_name == "output.weight" or (gguf_name == "token_embd.weight" and tied):
        return "lm_head"
    return None


def gguf_blocks(path: Path, model) -> dict[str, QuantizedWeight]:
    """Module name -> the file's blocks of that linear, for every linear whose GGUF type is kept
    (Q4_0, Q4_1, Q8_0) and whose values equal the model's weight."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    cfg = model.config.get_text_config()
    tied = bool(getattr(model.config, "tie_word_embeddings", False)) and not any(
        t.name == "output.weight" for t in reader.tensors)
    modules = dict(model.named_modules())
    out: dict[str, QuantizedWeight] = {}
    for t in reader.tensors:
        name = _module_name(t.name, tied)
        type_name = t.tensor_type.name
        if name is None or type_name not in GGUF_KEPT or name not in modules:
            continue
        weight = modules[name].weight
        qw = from_gguf_blocks(type_name, t.data, tuple(weight.shape))
        if arch == "llama" and name.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if name.endswith("q_proj") else (cfg.num_key_value_heads or cfg.num_attention_heads)
            qw = qw.rows(_rows_order(qw.out_features, heads))
        if not torch.equal(qw.dequantize().to(weight.dtype), weight.detach()):
            log.warning("GGUF tensor %s (%s) does not equal %s's weight: quantized afresh", t.name, type_name, name)
            continue
        out[name] = qw
    return out
