"""How a model's linears take a quantization format: which kind each fused linear gets
(`linear_kind`), and its blocks: a GGUF file's own where every part has them, or the weights
quantized afresh (`quantized_weight`). Every device's lean forward asks these."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.precision import Precision
from workers.quant.weight import INT4, INT8, QuantizedWeight, concat, quantize


def linear_kind(precision: Precision, names: list[str], kept: bool, head: bool = False) -> str | None:
    """The weight-only kind (a format's name: workers.quant.formats) of the linear fusing the modules `names`, or None where it
    runs as loaded. `kept`: each has a GGUF file's own blocks, of one kind; `head`: the LM head.
    - `quantization: auto` quantizes only what the file holds as kept blocks: the file's own values.
    - The LM head stays 8-bit even for int4, as llama.cpp's 4-bit mixes keep it: in 4 bits it alone
      raised SmolLM2's perplexity by 8% (tests/test_quantized.py).
    - Quantized afresh to int4, the attention's values (so the fused q/k/v) and the MLP's down
      projection take int8, as llama.cpp's Q4_K_M mix gives them more bits: in int4 throughout,
      Gemma 3 270M's perplexity rose 11%, with these in int8 3.4%. A GGUF file's own blocks stay as
      they are (quantized_weight keeps them whatever the kind)."""
    if not precision.quantized or (precision.file_classes and not kept):
        return None
    more_bits = any(name.endswith(("v_proj", "down_proj")) for name in names)
    return INT8 if head or (precision.quantization == INT4 and more_bits) else precision.quantization


def all_kept(modules: list[torch.nn.Linear], blocks: dict[int, QuantizedWeight]) -> bool:
    """Every module has a GGUF file's own blocks in `blocks` (by id), all of one kind: they fuse as
    they are."""
    kept = [blocks.get(id(m)) for m in modules]
    return all(k is not None for k in kept) and len({k.kind for k in kept}) == 1


def quantized_weight(modules: list[torch.nn.Linear], kind: str, blocks: dict[int, QuantizedWeight]) -> QuantizedWeight:
    """The outputs of `modules` side by side as one weight of blocks: a GGUF file's own blocks
    (`blocks`, by id(module)) where every module has them, of one kind; otherwise the modules'
    weights quantized afresh to `kind`, or to int8 where a part's blocks are int8 (the wider of its
    parts': a Q4_K file's q and k beside its Q6_K v)."""
    kept = [blocks.get(id(m)) for m in modules]
    if all_kept(modules, blocks):
        return concat(kept) if len(kept) > 1 else kept[0]
    wider = any(k is not None and k.kind == INT8 for k in kept)
    return quantize(torch.cat([m.weight.detach() for m in modules]), INT8 if wider else kind)


@dataclass(frozen=True, slots=True)
class QuantizedLinears:
    """A model's weight-only linears built once for several users (a weight owner's copies): the
    precision's `quantized_key` they were built for, and the blocks by linear_key."""

    key: str
    weights: dict[str, QuantizedWeight]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())

    @property
    def modules(self) -> list[str]:
        """The names of the modules whose outputs the blocks give."""
        return [name for key in self.weights for name in key.split("+")]


def linear_key(names: list[str]) -> str:
    """The name of the linear fusing the modules `names`: the key its blocks go by wherever they are
    built once for several users (a shared file's, a weight owner's)."""
    return "+".join(names)


def lean_linears(model) -> list[tuple[list[torch.nn.Linear], bool]]:
    """The linears a Llama-family lean forward multiplies, each as (its modules, whether it is the LM
    head): the LM head, then each layer's q/k/v, o, gate/up and down."""
    out = [([model.lm_head], True)]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out += [([attn.q_proj, attn.k_proj, attn.v_proj], False), ([attn.o_proj], False),
                ([mlp.gate_proj, mlp.up_proj], False), ([mlp.down_proj], False)]
    return out


def quantized_linears(model, precision: Precision, blocks: dict[str, QuantizedWeight] | None = None,
                      device: torch.device | None = None) -> dict[str, QuantizedWeight]:
    """Every linear of `model`'s lean forward that `precision` runs as weight-only blocks, by its
    key (linear_key), on `device` (None: the embedding's): `blocks`, a GGUF file's own blocks by
    module name (workers.weights.gguf_blocks), kept where they apply."""
    modules = dict(model.named_modules())
    names = {id(m): name for name, m in modules.items()}
    kept = {id(modules[name]): qw for name, qw in (blocks or {}).items() if name in modules}
    device = device or model.get_input_embeddings().weight.device
    out = {}
    for mods, head in lean_linears(model):
        group = [names[id(m)] for m in mods]
        kind = linear_kind(precision, group, all_kept(mods, kept), head)
        if kind is not None:
            out[linear_key(group)] = quantized_weight(mods, kind, kept).to(device)
    return out
