"""A decode step through the lean forward's layers in one C++ call (kernels/decode_layers.cpp).

At one row a Llama layer is a dozen kernel calls of a few microseconds each (the q/k/v, output,
gate/up and down linears, the rotary write, decode attention, two fused norms, silu * up). Called
from Python, each costs about as much again in the interpreter and in dispatch: about 1 ms of
SmolLM2's 7 ms a token. The C++ loop calls the same kernels in the same order, so a step gives
bit-equal results either way (tests/test_decode_layers.py).

It serves a step whose every row is a decode row attending through the C++ decode kernel, in a
model whose every layer linear runs in the C++ kernels (int4 or int8 blocks, or the dense strips of
`deterministic`): the Llama family, and Gemma 3 with its q/k norms, output norms, GELU and a
rotary table per layer type. Other steps, and models whose linears are oneDNN's or FBGEMM's packed
weights, take the layer loop in Python (LeanLlama._layers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.engine import attention
from workers.engine.cpu.backend import CPU_KERNELS
from workers.engine.cpu.extension import KERNEL_DTYPES
from workers.engine.cpu.row_kernels import PACKED

if TYPE_CHECKING:
    from workers.engine.cpu.linears import Linear

# KernelLinear's kind of a dense weight through the strips (kernels/decode_layers.h); a quantized
# weight's is its format's (workers.quant.formats: QuantFormat.kernel_kind)
_DENSE = 2


def kernel_linear(lin: Linear, kernels):
    """The C++ KernelLinear of a Linear that runs in the C++ kernels `kernels`, or None where it does
    not (oneDNN or FBGEMM packed weights, or tiles of rows: Linear.rows_per_call)."""
    if lin.rows_per_call or lin.kernels is not kernels:
        return None
    if lin.dense is not None:
        return kernels.KernelLinear(_DENSE, lin.dense, None, None, lin.bias, False)
    q = lin.quant
    if q is None:
        return None
    # the AMX tiles' way where the linear's choice takes it from some rows on (row_kernels)
    packed_from = (lin.rows.first(PACKED) or 0) if lin.rows is not None and lin.packed16 is not None else 0
    return kernels.KernelLinear(q.format.kernel_kind, q.qs, q.scales, q.offsets, lin.bias, lin.strips,
                                lin.packed16 if packed_from else None, packed_from, lin.act8)


class FusedDecode:
    """The layers of a LeanLlama as one C++ call for decode steps; `layers` None where it does not
    apply to the model (then `applies` is always false)."""

    __slots__ = ("layers", "windows", "rope_types", "widened_from", "_position")

    def __init__(self, layers=None, windows: list[int | None] | None = None, rope_types: list[str] | None = None):
        self.layers = layers
        self.windows = windows or []
        # Gemma 3: the layer types whose rotary tables `run` takes, in this order (None: one table)
        self.rope_types = rope_types
        # the fewest rows at which a layer linear takes the widened GEMM (LeanLlama.pick_row_kernels),
        # which the fused call has not: such steps take the layer loop in Python
        self.widened_from: int | None = None
        self._position = None  # the ContextHolder's layer placement the layers were placed by

    @classmethod
    def of(cls, lean, kernels, gemma: bool = False) -> FusedDecode:
        """`lean`'s layers through `kernels` (the C++ module; None: not built), where every layer's
        linears run in them. `gemma`: Gemma 3's layers (lean.LeanGemma3)."""
        if kernels is None or not hasattr(kernels, "DecodeLayers"):
            return cls()
        fused = kernels.DecodeLayers(lean.heads, lean.kv_heads, lean.head_dim, lean.scaling, lean.eps, gemma)
        rope_types = sorted({layer.rope for layer in lean.layers}) if gemma else None
        for layer in lean.layers:
            parts = [kernel_linear(lin, kernels) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(p is None for p in parts) or layer.input_norm.dtype != lean.compute:
                return cls()
            fused.add(layer.input_norm, layer.post_norm, *parts)
            if gemma:
                fused.add_gemma(layer.q_norm, layer.k_norm, layer.attn_out_norm, layer.mlp_out_norm,
                                rope_types.index(layer.rope))
        return cls(fused, [layer.window for layer in lean.layers], rope_types)

    def applies(self, ctx: attention.StepContext, h: torch.Tensor, cos: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether this step is one it serves: decode rows alone, fewer than widened_from, through the
        C++ decode kernel, with the rotary tables in the rows' dtype (the C++ rotary write's condition)."""
        n = h.shape[0]
        return (self.layers is not None and n > 0 and (self.widened_from is None or n < self.widened_from)
                and not ctx.segments and ctx.num_decode == ctx.num_tokens == n
                and ctx.backend is not None and ctx.backend.name == CPU_KERNELS and kv[0].dtype in KERNEL_DTYPES
                and cos.dtype == h.dtype)

    def run(self, ctx: attention.StepContext, h: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]],
            kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The residual rows after every layer (h is updated in place). `tables`: the rotary (cos,
        sin) of the step's rows, one pair (Gemma 3: one per layer type, in rope_types' order)."""
        if self._position is not ctx.position:
            self._place(ctx)
        steps = []
        for gs in ctx.groups:
            if gs.span_table is None:
                gs.span_table = torch.tensor(gs.spans, dtype=torch.long)
            steps += (gs.write_blocks, gs.write_offsets, gs.pair_blocks, gs.span_table)
        return self.layers.run(h, [t for pair in tables for t in pair], kv[0], kv[1], steps)

    def _place(self, ctx: attention.StepContext) -> None:
        groups, pool = [], []
        for i, window in enumerate(self.windows):
            g, p = ctx.position[i]
            planned = ctx.windows[g]
            if planned is not None and (window is None or window > planned):
                raise RuntimeError(f"layer {i} attends over a window of {window}, but its cache group keeps {planned}")
            groups.append(g)
            pool.append(p)
        self.layers.place(groups, pool)
        self._position = ctx.position
