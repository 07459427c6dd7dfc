"""Each decoder layer's q/k/v and gate/up weights laid out side by side in one tensor, every module's
weight a view of its rows.

A lean forward multiplies a layer's q/k/v (and gate/up) as one linear. Over weights laid out so, it
takes the span of the views (`side_by_side`) instead of a fused copy of its own, so a GPU copy holds
the weights once: a weight owner lays them out before it exports them (its copies receive views of
one storage and keep the layout), and a copy with weights of its own lays them out in place.
transformers' modules read the same views, so nothing else changes.
"""

from __future__ import annotations

import torch

# (the layer's submodule, the linears multiplied as one), as the Llama family names them
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def side_by_side(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one, their rows one after another, if they already lie so in one storage (a
    view of it, no copy); None where they do not."""
    first = parts[0]
    if len(parts) == 1:
        return first.detach()
    inner, offset = tuple(first.shape[1:]), first.storage_offset()
    storage = first.untyped_storage().data_ptr()
    for p in parts:
        if (p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset or not p.is_contiguous()
                or tuple(p.shape[1:]) != inner or p.dtype != first.dtype):
            return None
        offset += p.numel()
    shape = (sum(p.shape[0] for p in parts), *inner)
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return first.detach().as_strided(shape, strides, first.storage_offset())


def groups(model: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """Every decoder layer's groups of linears that a lean forward multiplies as one."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    found = []
    for layer in layers:
        for parent, names in GROUPS:
            mods = [getattr(getattr(layer, parent, None), n, None) for n in names]
            if all(isinstance(m, torch.nn.Linear) for m in mods):
                found.append(mods)
    return found


def lay_out_fused(model: torch.nn.Module) -> int:
    """Lay out every group's weights (and biases, where each has one) side by side, each module's
    tensor then a view of its rows; a group laid out so already is left. Returns the bytes laid out
    again. One group at a time: the memory it takes beyond the weights is one layer's group."""
    moved = 0
    with torch.no_grad():
        for mods in groups(model):
            for attr in ("weight", "bias"):
                parts = [getattr(m, attr) for m in mods]
                if any(p is None or p.is_meta for p in parts) or side_by_side(parts) is not None:
                    continue
                if len({(p.dtype, p.device, tuple(p.shape[1:])) for p in parts}) != 1:
                    continue
                whole = torch.cat([p.detach() for p in parts])
                start = 0
                for m, p in zip(mods, parts):
                    m._parameters[attr] = torch.nn.Parameter(whole[start:start + p.shape[0]], requires_grad=False)
                    start += p.shape[0]
                moved += whole.numel() * whole.element_size()
    return moved
