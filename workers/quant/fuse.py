"""How a model's linears take a quantization format: which kind each fused linear gets
(`linear_kind`), and its blocks: a GGUF file's own where every part has them, or the weights
quantized afresh (`quantized_weight`). Every device's lean forward asks these."""

from __future__ import annotations

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
