"""A model whose linears run as weight-only blocks lets their 16-bit weights go: each such
linear's weight becomes a tensor on `meta` of its shape and dtype. The lean forward reads only the
blocks, and a quantized model runs nowhere else (the platform refuses a quantization without the
lean forward), so transformers' modules never multiply those weights again; a stray read fails on
`meta` rather than computing with stale values. The embedding's storage stays, where the LM head
is tied to it: the lookup reads it."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def release_linears(model: torch.nn.Module, names: Iterable[str]) -> int:
    """Put the weights of the linear modules `names` on `meta`. Returns the bytes let go (memory
    that other views, a weight owner's for one, may still hold)."""
    embed = model.get_input_embeddings().weight.untyped_storage().data_ptr()
    freed = 0
    for name in names:
        mod = model.get_submodule(name)
        w = mod.weight
        if w.is_meta or w.untyped_storage().data_ptr() == embed:
            continue
        mod._parameters["weight"] = torch.nn.Parameter(torch.empty_like(w, device="meta"), requires_grad=False)
        freed += w.numel() * w.element_size()
    return freed


def released(model: torch.nn.Module) -> list[str]:
    """The parameters of `model` on `meta`: let go of (release_linears), or never bound."""
    return [name for name, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
