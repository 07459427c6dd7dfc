"""The lean forward of the Llama family (Llama, SmolLM2, Mistral, Qwen 2) and of Gemma 3
(DeviceGemma3) on a GPU: transformers' weights and math over tensors of fixed shape, so a decode step
is capturable as one CUDA graph. Every layer's keys and values are in one cache group; each layer
attends its own window.

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
    window: int  # the positions it attends back (0: all)
    rope: str  # the rotary table it takes (DeviceLean.rope)


@dataclass(slots=True)
class _GemmaLayer(_Layer):
    q_norm: torch.Tensor  # each of Gemma's norms as (1 + w) in float32
    k_norm: torch.Tensor
    attn_out_norm: torch.Tensor  # post_attention_layernorm, on the attention's output (post_norm: pre_feedforward's)
    mlp_out_norm: torch.Tensor  # post_feedforward_layernorm


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

    def __init__(self, model, ops: PagedOps, cache_index: dict[int, int], windows: list[int | None],
                 max_positions: int, precision: Precision | None = None,
                 blocks: dict[str, QuantizedWeight] | None = None, fused: dict[str, QuantizedWeight] | None = None,
                 fused_own: bool = False):
        """`windows`: each layer's attention window (None: all its positions), every layer's keys and
        values in one cache group (`cache_index`: a layer's place in its storage). `precision`: whether
        and how its linears are weight-only quantized (None: not), their blocks built here
        (workers.quant.fuse.quantized_linears; `blocks`: a GGUF file's own by module name,
        workers.weights.gguf_blocks, kept where they apply) unless `fused` holds them: built before, by
        key (a weight owner's on this device, or an engine's before on the same model). The modules'
        16-bit weights of those linears are not read. `fused_own`: `fused` is this process's memory (not
        an owner's)."""
        inner = model.model
        self.ops = ops
        if fused is None and precision is not None and precision.quantized:
            fused, fused_own = quantized_linears(model, precision, blocks), True
        self._fused, self._fused_own = fused or {}, fused_own
        self._names = {id(m): name for name, m in model.named_modules()}
        shape = AttentionShape.of(model)
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.scaling, self.eps = shape.scaling, shape.eps
        self.embed = inner.embed_tokens.weight.detach()
        self.final_norm = self._norm_weight(inner.norm)
        self.lm_head = self._linear([model.lm_head])
        with torch.inference_mode():
            # transformers' rotary embedding of every position once: a step looks its rows up
            positions = torch.arange(max_positions, device=self.embed.device)[None]
            self.rope = self._rotary_tables(inner, positions)
        self.layers = [self._layer(layer, cache_index[i], windows[i] or 0) for i, layer in enumerate(inner.layers)]

    def _norm_weight(self, norm: torch.nn.Module) -> torch.Tensor:
        return norm.weight.detach()

    def _rotary_tables(self, inner, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The rotary tables (cos, sin) of every position by name (a layer's `rope`)."""
        return {"default": rotation(*inner.rotary_emb(self.embed[:1][None], positions))}

    def _layer(self, layer, cache_index: int, window: int) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return _Layer(self._norm_weight(layer.input_layernorm), self._linear([attn.q_proj, attn.k_proj, attn.v_proj]),
                      self._linear([attn.o_proj]), self._norm_weight(layer.post_attention_layernorm),
                      self._linear([mlp.gate_proj, mlp.up_proj]), self._linear([mlp.down_proj]), cache_index, window,
                      "default")

    def _linear(self, modules: list[torch.nn.Linear]) -> DeviceLinear:
        """The outputs of `modules` as one linear: its weight-only blocks where it has them, else their
        weights: one tensor where they lie side by side already, else a fused copy of this process's
        own."""
        bias = fused_bias(modules)
        names = [self._names[id(m)] for m in modules]
        qw = self._fused.get(linear_key(names))
        if qw is not None:
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
                + sum(t.numel() * t.element_size() for table in self.rope.values() for t in table))

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
        cos, sin = self.rope["default"]
        # each layer: x, the normed input of its attention; h, the residual stream it adds to
        for i, layer in enumerate(self.layers):
            kc, vc = key_cache[layer.cache_index], value_cache[layer.cache_index]
            q = ops.rope_kv_write(layer.qkv(x), cos, sin, step.positions, kc, vc, step.slots, heads, kvh)
            a = attend(q, kc, vc, step.tables, step.rows, step.lengths, self.scaling, layer.window)
            x, h = ops.add_rms_norm(layer.o(a.reshape(n, heads * d)), h, layer.post_norm, self.eps)
            delta = layer.down(ops.silu_mul(layer.gate_up(x)))
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            x, h = ops.add_rms_norm(delta, h, after, self.eps)
        if keep is not None:
            x = x.index_select(0, keep)
        return self.lm_head(x)


class DeviceGemma3(DeviceLean):
    """Gemma 3 (text) on the same pass, in the weights' dtype as transformers computes it: the
    embedding scaled by sqrt(hidden), each norm in float32 scaled by (1 + w) (ops.gemma_rms_norm),
    the q and k heads normed before the rotary embedding, a sublayer's output normed before it joins
    the residual stream (ops.sandwich_norm), GELU x up, a rotary table a layer type (sliding layers'
    local base, full layers' global one), each layer's own window, and the final logits' softcap."""

    def __init__(self, model, *args, **kwargs):
        cfg = model.config.get_text_config()
        self.layer_types = list(cfg.layer_types)
        super().__init__(model, *args, **kwargs)
        # transformers multiplies by the buffer in the weights' dtype
        self.embed_scale = model.model.embed_tokens.embed_scale.to(self.embed.dtype)
        self.softcap = cfg.final_logit_softcapping

    def _norm_weight(self, norm: torch.nn.Module) -> torch.Tensor:
        return 1.0 + norm.weight.detach().float()  # Gemma3RMSNorm's scale, computed in float32

    def _rotary_tables(self, inner, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        x = self.embed[:1][None]
        return {t: rotation(*inner.rotary_emb(x, positions, t)) for t in set(self.layer_types)}

    def _layer(self, layer, cache_index: int, window: int) -> _GemmaLayer:
        base, attn = super()._layer(layer, cache_index, window), layer.self_attn
        return _GemmaLayer(base.input_norm, base.qkv, base.o, self._norm_weight(layer.pre_feedforward_layernorm),
                           base.gate_up, base.down, cache_index, window, self.layer_types[attn.layer_idx],
                           self._norm_weight(attn.q_norm), self._norm_weight(attn.k_norm),
                           self._norm_weight(layer.post_attention_layernorm),
                           self._norm_weight(layer.post_feedforward_layernorm))

    def forward(self, step: DeviceStep, kv: tuple[torch.Tensor, torch.Tensor],
                keep: torch.Tensor | None = None, decode: bool = False) -> torch.Tensor:
        ops, n, heads, kvh, d, eps = self.ops, step.ids.shape[0], self.heads, self.kv_heads, self.head_dim, self.eps
        key_cache, value_cache = kv
        attend = ops.decode_attention if decode or ops.invariant else ops.attention
        h = F.embedding(step.ids, self.embed) * self.embed_scale
        x = ops.gemma_rms_norm(h, self.layers[0].input_norm, eps) if self.layers else h
        for i, layer in enumerate(self.layers):
            kc, vc = key_cache[layer.cache_index], value_cache[layer.cache_index]
            cos, sin = self.rope[layer.rope]
            qkv = ops.qk_norm(layer.qkv(x), layer.q_norm, layer.k_norm, heads, kvh, eps)
            q = ops.rope_kv_write(qkv, cos, sin, step.positions, kc, vc, step.slots, heads, kvh)
            a = attend(q, kc, vc, step.tables, step.rows, step.lengths, self.scaling, layer.window)
            x, h = ops.sandwich_norm(layer.o(a.reshape(n, heads * d)), h, layer.attn_out_norm, layer.post_norm, eps)
            delta = layer.down(ops.gelu_mul(layer.gate_up(x)))
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            x, h = ops.sandwich_norm(delta, h, layer.mlp_out_norm, after, eps)
        if keep is not None:
            x = x.index_select(0, keep)
        logits = self.lm_head(x)
        if self.softcap is not None:  # as Gemma3ForCausalLM: divide, tanh, multiply
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def device_lean(model, *args, **kwargs) -> DeviceLean:
    """The device's lean forward of `model`'s family (DeviceLean's arguments)."""
    cls = DeviceGemma3 if type(model).__name__ == "Gemma3ForCausalLM" else DeviceLean
    return cls(model, *args, **kwargs)
