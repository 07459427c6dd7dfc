"""Linear layers with their weights prepacked once for oneDNN, as vLLM's CPU backend does.

A plain `F.linear` on CPU hands oneDNN a row-major weight on every call, and a decode step's
matmuls (a few rows against every weight) then read the weights at about half the memory's
speed. `torch.ops.mkldnn._reorder_linear_weight` lays a weight out once in oneDNN's blocked
format and `_linear_pointwise` multiplies against it: the same products, read contiguously.

Packed weights are oneDNN tensors of this process (an opaque layout, not a plain buffer), so
they cannot live in the shared-weights file: each process that packs holds its own copy, which
the plan counts (`own_bytes`). Other devices and dtypes (CUDA, float64) keep `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACKABLE_DTYPES = (torch.bfloat16, torch.float32)


def can_pack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether weights of this dtype on this device are prepacked (oneDNN on CPU, bf16 or fp32)."""
    return (torch.device(device).type == "cpu" and dtype in PACKABLE_DTYPES
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """y = x @ weight.T + bias over rows x [M, in]; the weight prepacked when `pack` is true."""

    __slots__ = ("weight", "bias", "packed", "own_bytes")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, own: bool = False):
        """`own`: the weight is a tensor of this process already (not the model's parameter)."""
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight) if pack else None
        self.weight = None if pack else weight  # packed: the plain copy is not needed again
        self.own_bytes = weight.numel() * weight.element_size() if pack or own else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def fused(modules: list[torch.nn.Linear], pack: bool) -> Linear:
    """One Linear computing the outputs of `modules` side by side (q, k, v; gate, up): one weight
    read and one call instead of several. Its weight is a new tensor of this process."""
    weight = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight
    own = len(modules) > 1
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        bias = None
    else:
        bias = torch.cat([b.detach() if b is not None else m.weight.new_zeros(m.out_features)
                          for m, b in zip(modules, biases)])
    return Linear(weight, bias, pack, own)
