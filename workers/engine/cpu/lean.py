"""A lean packed forward for the Llama family (Llama, SmolLM2, Mistral, Qwen 2) and Gemma 3:
transformers' weights and math in a fraction of its operations.

A decode step of a small model is mostly not its matmuls: transformers' modules issue some
sixty tensor operations per layer (norms in five steps, rotary embeddings for q and k apart,
three projections where one would do), and at a few rows each operation costs its dispatch.
Here a layer is one fused q/k/v projection, one fused gate/up projection (both prepacked for
oneDNN on CPU, workers.engine.cpu.linears), the rotary embedding of q and k together, the paged
attention op, and fused norms: about twenty operations.

Gemma 3 adds a norm after attention and after the MLP, q and k norms, GELU (tanh) for SiLU, a
scaled embedding, and rotary tables per layer type. Its norms scale by (1 + w) in float32 and
round once, so its lean forward runs where the math is float32 (float32 weights, or 16-bit
weights computing in float32); bfloat16 math runs transformers' modules.

The weights are the model's own parameters (norms, embeddings) or this process's fused and
packed copies of them (`own_bytes`); the transformers modules are left as they are, so a
reference run on the same model still runs transformers' code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.config_keys import FLOAT32_LEAN
from workers.engine import attention
from workers.engine.cpu import row_kernels
from workers.engine.cpu.decode_layers import FusedDecode
from workers.engine.cpu.linears import (
    Linear,
    Packs,
    float32_fits,
    fused,
    lay_out,
    quantized,
    tiles_fit,
    widen_to_float32,
)
from workers.engine.lean_parts import AttentionShape, rotation
from workers.lean_rules import layer_windows
from workers.precision import HALF, Precision
from workers.quant.fuse import all_kept, linear_key, linear_kind
from workers.quant.weight import QuantizedWeight


def lean_forward(model, precision: Precision, norms=None, blocks: dict[str, QuantizedWeight] | None = None,
                 fused: dict[str, QuantizedWeight] | None = None, invariant: bool = False) -> LeanLlama:
    """The lean forward of this model's family, its linears packed (or quantized) as `precision` says
    and computing in its compute dtype (the platform decided that it applies: workers.platform);
    `norms`: the C++ kernels' module (workers.engine.cpu.extension), or None for torch's norms;
    `blocks`: a GGUF file's own quantized blocks by module name (workers.weights.gguf_blocks);
    `fused`: its quantized linears as built before (LeanLlama.quantized_weights), by their keys;
    `invariant`: `deterministic`'s batch-invariant linears (LeanLlama's docstring)."""
    family = LeanGemma3 if type(model).__name__ in FLOAT32_LEAN else LeanLlama
    return family(model, precision, norms=norms, blocks=blocks, fused=fused, invariant=invariant)


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    window: int | None


class LeanLlama:
    """forward(ids, positions, keep, kv, ctx) -> logits of the kept rows, over the paged cache.

    `invariant` (`deterministic`): every linear multiplies each row the same way whatever rows come
    with it (Linear.make_invariant, checked on this machine once per path and shape), from the start."""

    def __init__(self, model, precision: Precision, norms=None, blocks: dict[str, QuantizedWeight] | None = None,
                 fused: dict[str, QuantizedWeight] | None = None, invariant: bool = False):
        cfg = model.config.get_text_config()
        self.compute = precision.compute
        self.precision = precision
        modules = dict(model.named_modules())
        self._names = {id(m): name for name, m in modules.items()}
        self._blocks = {id(modules[name]): qw for name, qw in (blocks or {}).items() if name in modules}
        self._fused = fused or {}
        self._keyed: dict[str, Linear] = {}  # every linear by its modules' names
        self.norms = norms  # the C++ norms (workers.engine.cpu.extension), or None for F.rms_norm
        inner = model.model
        shape = AttentionShape.of(model)
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.scaling, self.eps = shape.scaling, shape.eps
        self.hidden = cfg.hidden_size
        # C++ silu * up in one pass, where it rounds as torch does (the kernels' own rule, which the
        # fused decode layers follow too)
        self._silu_mul = (norms.silu_mul if norms is not None
                          and norms.silu_mul_rounds_as_torch(torch.empty(0, dtype=self.compute)) else None)
        # 16-bit weights under float32 math: the embedding stays 16-bit (a row is widened when
        # looked up); the norms' small weights are widened once
        self.embed = inner.embed_tokens.weight.detach()
        self.rotary = inner.rotary_emb
        self.final_norm = self._norm_weight(inner.norm)
        self.lm_head = self._linear([model.lm_head], head=True)
        windows = layer_windows(model, [layer.self_attn for layer in inner.layers])
        self.layers = [self._layer(layer, windows[i]) for i, layer in enumerate(inner.layers)]
        # a GGUF file's blocks of q, k, v, gate and up are now in their fused linears: held on here,
        # they would keep those linears' bytes twice
        self._blocks = {}
        # `deterministic`: the rows each linear path (as packed) multiplies a call (0: any number)
        self.invariant = invariant
        self.invariant_rows: dict[str, int] = self._invariant_linears(model) if invariant else {}
        self.decode_layers = self.fused_decode()

    def fused_decode(self) -> FusedDecode:
        """Decode steps' layers in one C++ call, where every layer linear runs in the C++ kernels, over
        the linears as they are now (their blocks, and the AMX tiles from where their choice takes them)."""
        return FusedDecode.of(self, self.norms)

    def _norm_weight(self, norm: torch.nn.Module) -> torch.Tensor:
        return norm.weight.detach().to(self.compute)

    def _layer(self, layer, window: int | None) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return _Layer(self._norm_weight(layer.input_layernorm),
                      self._linear([attn.q_proj, attn.k_proj, attn.v_proj]),
                      self._linear([attn.o_proj]),
                      self._norm_weight(layer.post_attention_layernorm),
                      self._linear([mlp.gate_proj, mlp.up_proj]),
                      self._linear([mlp.down_proj]),
                      window)

    def _linear(self, modules: list[torch.nn.Module], head: bool = False) -> Linear:
        """The outputs of `modules` as one linear: packed, or weight-only quantized."""
        names = [self._names[id(m)] for m in modules]
        key = linear_key(names)
        kind = linear_kind(self.precision, names, key in self._fused or all_kept(modules, self._blocks), head)
        if kind is not None:
            lin = quantized(modules, kind, self._blocks, self.compute, self.norms, self.precision.linears,
                            self._fused.get(key))
        else:
            lin = fused(modules, self.precision.linears, self.compute)
        self._keyed[key] = lin
        return lin

    def pick_row_kernels(self, max_rows: int, packs: Packs | None = None) -> dict[str, str]:
        """Each quantized layer linear's kernel by the step's row count, measured on this machine for
        steps of up to `max_rows` rows (row_kernels), the LM head's by the rows it multiplies (one a
        sequence; at 64 of them the blocks took 3x oneDNN's time on an AMX CPU). Not under
        `deterministic`, whose strips take every row count. Where the CPU has AMX tiles for
        bfloat16, the linears' values packed for them are a way too; where it computes in bfloat16
        without them, the values widened to float32 are (linears.float32_fits). `packs(way,
        weights)` gives them by key from the quantized weights (a file the copies share), else they
        are laid out here; none where a choice kept from an earlier load takes no such way, and those
        whose way is not chosen are let go. The tiles are laid out before measuring (an AMX CPU
        takes them for nearly every shape); the float32 way, which a CPU whose bfloat16 dot
        products run at twice float32's rate never takes, is measured on values widened here,
        layer by layer as the timing reaches them, and only those a choice takes are asked for.
        Where the kernels round a few rows' activations to 8 bits
        (bfloat16 on AVX512-VNNI, float32 on AVX2) and the model's weights are 16-bit, that is a way
        at up to row_kernels.ACT8_ROWS rows too. Returns the choice by linear, as the worker logs it
        and status shows it."""
        kernels = self.norms
        if self.invariant or kernels is None or self.compute not in (torch.float32, torch.bfloat16):
            return {}
        groups: dict[tuple, list] = {}
        for lin in self.linears():
            if lin.quant is not None and lin.kernels is not None:
                groups.setdefault((lin.quant.kind, lin.shape), []).append(lin)
        # the blocks with 8-bit activations at a few rows, where built for the activations' dtype, in a
        # model of 16-bit weights (a float32 model keeps float32's precision)
        act8 = (self.precision.weights in HALF and hasattr(kernels, "act8_dtypes")
                and str(self.compute).removeprefix("torch.") in kernels.act8_dtypes())
        provide = packs or (lambda way, weights: lay_out(kernels, way, weights))
        tiles = self.compute == torch.bfloat16 and tiles_fit(kernels)
        # AMX tiles take the packed values for nearly every shape: laid out before measuring. Without
        # them (vdpbf16ps over the same layout) they are measured on values packed here, as float32's
        early = tiles and kernels.amx_packs()
        wide = float32_fits(kernels, self.compute)
        extra = ((row_kernels.PACKED,) if tiles else ()) + ((row_kernels.FLOAT32,) if wide else ())
        names = (row_kernels.BLOCKS, row_kernels.WIDENED, *extra) + ((row_kernels.ACT8,) if act8 else ())
        keys = {id(lin): key for key, lin in self._keyed.items()}
        if early:

            def wanted(sig: tuple, lins: list) -> bool:  # not where a kept choice takes no tiles
                kept = row_kernels.recalled(sig[0], sig[1], self.compute, names, max_rows,
                                            kernels.__name__, layers=len(lins))
                return tiles_fit(kernels, sig[1]) and (kept is None or kept.uses(row_kernels.PACKED))

            want = {keys[id(lin)]: lin.quant for sig, lins in groups.items() if wanted(sig, lins) for lin in lins}
            for key, packed in (provide(row_kernels.PACKED, want) if want else {}).items():
                self._keyed[key].packed16 = packed

        def widened_here(lin: Linear) -> Linear:  # the float32 values for measuring, in this process
            if lin.wide32 is None:
                lin.wide32 = widen_to_float32({"": lin.quant})[""]
            return lin

        def packed_here(lin: Linear) -> Linear:  # the packed values for measuring, in this process
            if lin.packed16 is None:
                lin.packed16 = lay_out(kernels, row_kernels.PACKED, {"": lin.quant})[""]
            return lin

        chosen: dict[tuple, row_kernels.RowChoice] = {}
        for sig, lins in groups.items():
            # the layers' linears of the shape in turn, as a step multiplies them: their weights
            # stream from memory as they do in serving, not from a cache one linear would fit in
            ways = {row_kernels.BLOCKS: lambda x, n, lins=lins: [lin.blocks(x) for lin in lins[:n]],
                    row_kernels.WIDENED: lambda x, n, lins=lins: [lin.widened(x) for lin in lins[:n]]}
            if tiles and tiles_fit(kernels, sig[1]):
                ways[row_kernels.PACKED] = lambda x, n, lins=lins: [(lin if early else packed_here(lin)).tiles(x)
                                                                    for lin in lins[:n]]
            if wide:
                ways[row_kernels.FLOAT32] = lambda x, n, lins=lins: [widened_here(lin).float32(x) for lin in lins[:n]]
            if act8:
                ways[row_kernels.ACT8] = lambda x, n, lins=lins: [lin.blocks(x, row_kernels.ACT8_ROWS) for lin in lins[:n]]
            chosen[sig] = row_kernels.choose(sig[0], sig[1], self.compute, ways, max_rows, kernels.__name__,
                                             layers=len(lins))
            for lin in lins:
                lin.rows = chosen[sig]
                lin.wide32 = None  # widened here for measuring, if at all: the file's views replace them below
                if not early or not lin.rows.uses(row_kernels.PACKED):
                    lin.packed16 = None  # packed here for measuring (likewise), or not taken
        # the values of the linears whose choice takes a way measured on values laid out here: from the
        # file, once those are let go, so that the file's are the only copy
        for way, field in ((row_kernels.FLOAT32, "wide32"),) + (() if early else ((row_kernels.PACKED, "packed16"),)):
            late = {keys[id(lin)]: lin.quant for lins in groups.values() for lin in lins if lin.rows.uses(way)}
            for key, values in (provide(way, late) if late else {}).items():
                setattr(self._keyed[key], field, values)
        # the fused decode serves the layers (the LM head runs after it, by its own choice): their
        # blocks, and the AMX tiles from where a linear's choice takes them, up to the fewest rows
        # at which one takes a way of ATen's GEMMs (the widened values or the float32 ones)
        self.decode_layers = self.fused_decode()
        starts = [start for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
                  for way in (row_kernels.WIDENED, row_kernels.FLOAT32)
                  if lin.rows is not None and (start := lin.rows.first(way)) is not None]
        self.decode_layers.widened_from = min(starts) if starts else None
        return {f"{kind} {out}x{width}": c.describe() for (kind, (out, width)), c in chosen.items()}

    def quantized_weights(self) -> dict[str, QuantizedWeight]:
        """Its weight-only quantized linears by key (the modules' names they fuse), as `fused` takes them."""
        return {key: lin.quant for key, lin in self._keyed.items() if lin.quant is not None}

    def linears(self) -> list[Linear]:
        """Every linear it multiplies with: the LM head, then each layer's."""
        return [self.lm_head] + [x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    @property
    def own_bytes(self) -> int:
        """Memory this process holds of its own for the fused and packed weights."""
        return sum(x.own_bytes for x in self.linears())

    def _invariant_linears(self, model) -> dict[str, int]:
        """`deterministic`'s linears, as they are made: `model` is the one the lean forward is built
        from, whose weights the dense linears' strips read. Returns the rows a call by the path each
        linear was packed for (0: any number, through the C++ kernels' strips)."""
        modules = dict(model.named_modules())
        checked: dict[tuple, int] = {}
        for key, lin in self._keyed.items():
            parts = [modules[name].weight for name in key.split("+")] if lin.quant is None else []
            weight = torch.cat([w.detach() for w in parts]) if len(parts) > 1 else parts[0] if parts else None
            sig = (lin.path, lin.shape)
            checked[sig] = lin.make_invariant(self.compute, checked.get(sig), self.norms, weight, own=len(parts) > 1)
        return {path: max(r for (p, _), r in checked.items() if p == path) for path, _ in checked}

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # in float32 inside: transformers' LlamaRMSNorm rounds to the dtype once more, before the
        # scale (the same in float32; within a rounding in bfloat16)
        if self.norms is not None:
            return self.norms.rms_norm(x.contiguous(), weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its norm): one pass over the rows with the C++ norms, h updated in place."""
        if self.norms is not None:
            return h, self.norms.add_rms_norm(h, delta, weight, self.eps)
        h = h + delta
        return h, F.rms_norm(h, (self.hidden,), weight, self.eps)

    def _rope_write(self, h: torch.Tensor, cos: torch.Tensor):
        """C++: the rotation of q and k and the cache writes in one pass per layer (bit-equal)."""
        return getattr(self.norms, "rope_write", None) if cos.dtype == h.dtype else None

    def _qk_norm(self, qkv: torch.Tensor, layer: _Layer) -> torch.Tensor:
        return qkv

    def _attention(self, ctx: attention.StepContext, i: int, layer: _Layer, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], rope_write) -> torch.Tensor:
        """Layer i's attention over the paged cache, its output projection applied."""
        n, heads, kvh, d = x.shape[0], self.heads, self.kv_heads, self.head_dim
        key_cache, value_cache = kv
        qkv = self._qk_norm(layer.qkv(x), layer)
        if rope_write is not None:
            gs, kb, vb = attention.layer_cache(ctx, i, key_cache, value_cache)
            rope_write(qkv, cos, sin, kb, vb, gs.write_blocks, gs.write_offsets, heads, kvh)
            qk = qkv[:, : (heads + kvh) * d].view(n, heads + kvh, d)
        else:
            qk = qkv[:, : (heads + kvh) * d].view(n, heads + kvh, d)
            qk = qk * cos[:, None, :] + qk.roll(d // 2, -1) * sin[:, None, :]
        v = qkv[:, (heads + kvh) * d:].view(n, kvh, d)
        a = attention.attend(ctx, qk[:, :heads], qk[:, heads:], v, key_cache, value_cache, i,
                             self.scaling, layer.window, None, written=rope_write is not None)
        return layer.o(a.reshape(n, heads * d))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], ctx: attention.StepContext) -> torch.Tensor:
        """ids, positions: [N]; keep: the rows whose logits are returned; ctx: the step's attention
        metadata. Returns [len(keep), vocab]."""
        h = F.embedding(ids, self.embed).to(self.compute)
        cos, sin = rotation(*self.rotary(h, positions[None]))
        if self.decode_layers.applies(ctx, h, cos, kv):
            h = self.decode_layers.run(ctx, h, [(cos, sin)], kv)
        else:
            h = self._layers(h, cos, sin, kv, ctx)
        h = self._norm(h.index_select(0, keep), self.final_norm)
        return self.lm_head(h)

    def _layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                ctx: attention.StepContext) -> torch.Tensor:
        """The residual rows after every layer, one call at a time."""
        rope_write = self._rope_write(h, cos)
        silu_mul = self._silu_mul
        x = self._norm(h, self.layers[0].input_norm)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h, x = self._add_norm(h, self._attention(ctx, i, layer, x, cos, sin, kv, rope_write), layer.post_norm)
            gu = layer.gate_up(x)
            if silu_mul is not None:
                delta = layer.down(silu_mul(gu))
            else:
                inter = gu.shape[1] // 2
                delta = layer.down(F.silu(gu[:, :inter]) * gu[:, inter:])
            if i < last:
                h, x = self._add_norm(h, delta, self.layers[i + 1].input_norm)
            else:
                h = h + delta
        return h


@dataclass(slots=True)
class _GemmaLayer(_Layer):
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    attn_out_norm: torch.Tensor  # post_attention_layernorm: on the attention's output (post_norm is pre_feedforward's)
    mlp_out_norm: torch.Tensor  # post_feedforward_layernorm
    rope: str  # the layer type whose rotary table it takes


class LeanGemma3(LeanLlama):
    """Gemma 3 (text) on LeanLlama's pass, computing in float32 (see the module's docstring)."""

    def __init__(self, model, precision: Precision, norms=None, blocks: dict[str, QuantizedWeight] | None = None,
                 fused: dict[str, QuantizedWeight] | None = None, invariant: bool = False):
        cfg = model.config.get_text_config()
        self.layer_types = list(cfg.layer_types)
        super().__init__(model, precision, norms, blocks, fused, invariant)
        # transformers multiplies by the buffer in the weights' dtype; widened, the same value
        self.embed_scale = model.model.embed_tokens.embed_scale.to(self.compute)
        self.softcap = cfg.final_logit_softcapping

    def fused_decode(self) -> FusedDecode:
        return FusedDecode.of(self, self.norms, gemma=True)

    def _norm_weight(self, norm: torch.nn.Module) -> torch.Tensor:
        # Gemma3RMSNorm scales by (1 + w) computed in float32, as is everything here
        return 1.0 + norm.weight.detach().float()

    def _layer(self, layer, window: int | None) -> _GemmaLayer:
        base = super()._layer(layer, window)
        return _GemmaLayer(base.input_norm, base.qkv, base.o, self._norm_weight(layer.pre_feedforward_layernorm),
                           base.gate_up, base.down, window, self._norm_weight(layer.self_attn.q_norm),
                           self._norm_weight(layer.self_attn.k_norm), self._norm_weight(layer.post_attention_layernorm),
                           self._norm_weight(layer.post_feedforward_layernorm),
                           self.layer_types[layer.self_attn.layer_idx])

    def _qk_norm(self, qkv: torch.Tensor, layer: _GemmaLayer) -> torch.Tensor:
        n, d = qkv.shape[0], self.head_dim
        hq, hk = self.heads * d, self.kv_heads * d
        q = self._norm(qkv[:, :hq].reshape(n * self.heads, d), layer.q_norm)
        k = self._norm(qkv[:, hq:hq + hk].reshape(n * self.kv_heads, d), layer.k_norm)
        return torch.cat((q.view(n, hq), k.view(n, hk), qkv[:, hq + hk:]), dim=1)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], ctx: attention.StepContext) -> torch.Tensor:
        h = F.embedding(ids, self.embed).to(self.compute) * self.embed_scale
        tables = {t: rotation(*self.rotary(h, positions[None], t)) for t in set(self.layer_types)}
        fused = self.decode_layers
        if fused.applies(ctx, h, next(iter(tables.values()))[0], kv):
            h = fused.run(ctx, h, [tables[t] for t in fused.rope_types], kv)
        else:
            h = self._gemma_layers(h, tables, kv, ctx)
        logits = self.lm_head(self._norm(h.index_select(0, keep), self.final_norm))
        if self.softcap is not None:  # as Gemma3ForCausalLM: divide, tanh, multiply
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _gemma_layers(self, h: torch.Tensor, tables: dict, kv: tuple[torch.Tensor, torch.Tensor],
                      ctx: attention.StepContext) -> torch.Tensor:
        """The residual rows after every layer, one call at a time."""
        rope_write = self._rope_write(h, next(iter(tables.values()))[0])
        x = self._norm(h, self.layers[0].input_norm)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn = self._attention(ctx, i, layer, x, *tables[layer.rope], kv, rope_write)
            h, x = self._add_norm(h, self._norm(attn, layer.attn_out_norm), layer.post_norm)
            gu = layer.gate_up(x)
            inter = gu.shape[1] // 2
            mlp = layer.down(F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:])
            delta = self._norm(mlp, layer.mlp_out_norm)
            if i < last:
                h, x = self._add_norm(h, delta, self.layers[i + 1].input_norm)
            else:
                h = h + delta
        return h
