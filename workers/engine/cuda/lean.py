"""The lean forward of the Llama family (Llama, SmolLM2, Mistral, Qwen 2) on a GPU: transformers'
weights and math over tensors of fixed shape, so a decode step is capturable as one CUDA graph.

Per layer, about ten kernels on a GPU (the runner's PagedOps, workers.engine.cuda.ops: the Triton
kernels on CUDA, their PyTorch references elsewhere):
- one fused q/k/v linear and one fused gate/up linear in the weights' dtype (bfloat16 for `auto`;
  with `quantization: int8` or `int4`, weight-only blocks multiplied by PagedOps.qlinear, by the
  same rules as the CPU's lean forward: workers.quant.fuse.linear_kind), and the o and down linears;
- the rotary embedding, looked up in a table of every position (no shape depends on the step),
  with the KV write, in one op;
- paged attention: split over the context in decode steps, one row a token in prefill and extend;
- the residual add with the next RMS norm in one op (transformers' arithmetic, rounded where it
  rounds), and SiLU times up in one.
The step's layout is tensors only: each token's position, KV slot, block-table row and attended
length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from workers.engine.cuda.int4pack import Int4Pack
from workers.engine.cuda.ops import PagedOps
from workers.engine.lean_parts import AttentionShape, fused_bias, rotation
from workers.precision import Precision
from workers.quant.fuse import linear_key, quantized_linears
from workers.quant.weight import INT4, QuantizedWeight
from workers.weights.fused_layout import side_by_side

if TYPE_CHECKING:  # the Triton kernels' modules: imported where Triton runs them
    from workers.engine.cuda.triton_invariant import Tiles
    from workers.engine.cuda.triton_qlinear import Gemv


@dataclass(slots=True, frozen=True)
class DeviceLinear:
    """x @ W.T + bias for the outputs of one or more modules side by side: W dense (`weight`), or
    weight-only blocks (`quant`) through `qlinear` (PagedOps.qlinear), or through torch's tinygemm
    (`packed`) for calls of up to `packed_rows` rows (int4 blocks, where it measured faster)."""

    weight: torch.Tensor | None
    quant: QuantizedWeight | None
    bias: torch.Tensor | None
    qlinear: Callable[..., torch.Tensor] | None = None
    own: bool = False  # a tensor of this process (a fused copy, the blocks), not the model's
    dense: Callable[..., torch.Tensor] = F.linear  # PagedOps.linear under `deterministic`
    packed: Int4Pack | None = None
    packed_rows: int = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] <= self.packed_rows:
            return self.packed(x, self.bias)
        if self.quant is not None:
            return self.qlinear(x, self.quant, self.bias)
        return self.dense(x, self.weight, self.bias)

    @property
    def own_bytes(self) -> int:
        if not self.own:
            return 0
        if self.quant is not None:
            return self.quant.nbytes + (self.packed.nbytes if self.packed is not None else 0)
        return self.weight.numel() * self.weight.element_size()


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: DeviceLinear  # [(heads + 2 kv heads) x head_dim, hidden]
    o: DeviceLinear
    post_norm: torch.Tensor
    gate_up: DeviceLinear  # [2 x intermediate, hidden]
    down: DeviceLinear
    cache_index: int  # the layer's index in its cache group's storage


@dataclass(slots=True)
class DeviceStep:
    """One forward's layout, every field a tensor on the device. `rows` index `tables`."""

    ids: torch.Tensor  # [N] token IDs
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [N] KV slots (block x block_size + offset)
    rows: torch.Tensor  # [N] each token's block-table row
    lengths: torch.Tensor  # [N] positions each token attends (its own included; 0 for a padded row)
    tables: torch.Tensor  # [S, blocks a sequence can hold]


class DeviceLean:
    """forward(step, kv) -> logits of every row (or of `keep`). Every linear, norm and attention call
    goes through `ops`: under `deterministic` their batch-invariant set (workers.engine.cuda.ops)."""

    def __init__(self, model, ops: PagedOps, cache_index: dict[int, int], window: int | None, max_positions: int,
                 precision: Precision | None = None, blocks: dict[str, QuantizedWeight] | None = None,
                 fused: dict[str, QuantizedWeight] | None = None, fused_own: bool = False):
        """`precision`: whether and how its linears are weight-only quantized (None: not), their blocks
        built here (workers.quant.fuse.quantized_linears; `blocks`: a GGUF file's own by module name,
        workers.weights.gguf_blocks, kept where they apply) unless `fused` holds them: built before, by
        key (a weight owner's on this device, or an engine's before on the same model). The modules'
        16-bit weights of those linears are not read. `fused_own`: `fused` is this process's memory (not
        an owner's)."""
        inner = model.model
        self.ops = ops
        if fused is None and precision is not None and precision.quantized:
            fused, fused_own = quantized_linears(model, precision, blocks), True
        self._fused, self._fused_own = fused or {}, fused_own
        self.quantized_modules: list[str] = []  # the modules its blocks serve: their 16-bit weights unread
        self._names = {id(m): name for name, m in model.named_modules()}
        shape = AttentionShape.of(model)
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.scaling, self.eps = shape.scaling, shape.eps
        self.window = window or 0
        self.embed = inner.embed_tokens.weight.detach()
        self.final_norm = inner.norm.weight.detach()
        self.lm_head = self._linear([model.lm_head])
        with torch.inference_mode():
            # transformers' rotary embedding of every position once: a step looks its rows up
            positions = torch.arange(max_positions, device=self.embed.device)[None]
            self.cos, self.sin = rotation(*inner.rotary_emb(self.embed[:1][None], positions))
        self.layers = [_Layer(layer.input_layernorm.weight.detach(),
                              self._linear([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                              self._linear([layer.self_attn.o_proj]), layer.post_attention_layernorm.weight.detach(),
                              self._linear([layer.mlp.gate_proj, layer.mlp.up_proj]),
                              self._linear([layer.mlp.down_proj]), cache_index[i])
                       for i, layer in enumerate(inner.layers)]

    def _linear(self, modules: list[torch.nn.Linear]) -> DeviceLinear:
        """The outputs of `modules` as one linear: its weight-only blocks where it has them, else their
        weights: one tensor where they lie side by side already, else a fused copy of this process's
        own."""
        bias = fused_bias(modules)
        names = [self._names[id(m)] for m in modules]
        qw = self._fused.get(linear_key(names))
        if qw is not None:
            self.quantized_modules += names
            return DeviceLinear(None, qw, bias, self.ops.qlinear, own=self._fused_own, dense=self.ops.linear)
        span = side_by_side([m.weight for m in modules])
        if span is not None:  # one module, or several laid out side by side (workers.weights.fused_layout)
            return DeviceLinear(span, None, bias, dense=self.ops.linear)
        return DeviceLinear(torch.cat([m.weight.detach() for m in modules]), None, bias, own=True, dense=self.ops.linear)

    def pack_int4(self, rows: dict[tuple[int, int], int]) -> None:
        """Give every int4 linear whose (outputs, inputs) `rows` names with rows > 0 a tinygemm
        packing (Int4Pack), serving its calls of up to that many rows."""
        def packed(lin: DeviceLinear) -> DeviceLinear:
            q = lin.quant
            upto = rows.get((q.out_features, q.in_features), 0) if q is not None and q.kind == INT4 else 0
            return replace(lin, packed=Int4Pack.of(q), packed_rows=upto) if upto > 0 else lin

        self.lm_head = packed(self.lm_head)
        for layer in self.layers:
            layer.qkv, layer.o = packed(layer.qkv), packed(layer.o)
            layer.gate_up, layer.down = packed(layer.gate_up), packed(layer.down)

    def set_shapes(self, tiles: dict[tuple[int, int], Tiles], gemv: dict[tuple[str, int, int], Gemv]) -> None:
        """Give each linear the shape measured for its weight (workers.engine.cuda.tile_choice): a dense
        one of (outputs, inputs) in `tiles` its batch-invariant tiles (PagedOps.linear takes them under
        `deterministic`), weight-only blocks of (kind, outputs, inputs) in `gemv` their row kernel's."""
        def shaped(lin: DeviceLinear) -> DeviceLinear:
            q = lin.quant
            if q is not None and (q.kind, q.out_features, q.in_features) in gemv:
                return replace(lin, qlinear=partial(self.ops.qlinear, gemv=gemv[q.kind, q.out_features, q.in_features]))
            if lin.weight is not None and tuple(lin.weight.shape) in tiles:
                return replace(lin, dense=partial(self.ops.linear, tiles=tiles[tuple(lin.weight.shape)]))
            return lin

        self.lm_head = shaped(self.lm_head)
        for layer in self.layers:
            layer.qkv, layer.o = shaped(layer.qkv), shaped(layer.o)
            layer.gate_up, layer.down = shaped(layer.gate_up), shaped(layer.down)

    def quantized_weights(self) -> dict[str, QuantizedWeight]:
        """Its weight-only linears' blocks by key (workers.quant.fuse.linear_key), as `fused` takes them."""
        return dict(self._fused)

    def linears(self) -> list[DeviceLinear]:
        return [self.lm_head] + [x for lay in self.layers for x in (lay.qkv, lay.o, lay.gate_up, lay.down)]

    @property
    def own_bytes(self) -> int:
        """Memory of its own: the fused or quantized linears and the rotary tables."""
        return (sum(lin.own_bytes for lin in self.linears())
                + sum(t.numel() * t.element_size() for t in (self.cos, self.sin)))

    def forward(self, step: DeviceStep, kv: tuple[torch.Tensor, torch.Tensor],
                keep: torch.Tensor | None = None, decode: bool = False) -> torch.Tensor:
        """`decode`: one row a sequence (the decode graphs), whose attention is split over the
        context. Under `deterministic` every row's attention is split so (a decode row's bits may
        not depend on whether a prompt's chunk shares its step)."""
        ops, n, heads, kvh, d = self.ops, step.ids.shape[0], self.heads, self.kv_heads, self.head_dim
        key_cache, value_cache = kv
        attend = ops.decode_attention if decode or ops.invariant else ops.attention
        h = F.embedding(step.ids, self.embed)
        x = ops.rms_norm(h, self.layers[0].input_norm, self.eps) if self.layers else h
        # each layer: x, the normed input of its attention; h, the residual stream it adds to
        for i, layer in enumerate(self.layers):
            kc, vc = key_cache[layer.cache_index], value_cache[layer.cache_index]
            q = ops.rope_kv_write(layer.qkv(x), self.cos, self.sin, step.positions, kc, vc, step.slots, heads, kvh)
            a = attend(q, kc, vc, step.tables, step.rows, step.lengths, self.scaling, self.window)
            x, h = ops.add_rms_norm(layer.o(a.reshape(n, heads * d)), h, layer.post_norm, self.eps)
            delta = layer.down(ops.silu_mul(layer.gate_up(x)))
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            x, h = ops.add_rms_norm(delta, h, after, self.eps)
        if keep is not None:
            x = x.index_select(0, keep)
        return self.lm_head(x)
