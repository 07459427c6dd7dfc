"""A lean packed forward for the Llama family (Llama, SmolLM2, Mistral, Qwen 2): transformers'
weights and math in a fraction of its operations.

A decode step of a small model is mostly not its matmuls: transformers' modules issue some
sixty tensor operations per layer (norms in five steps, rotary embeddings for q and k apart,
three projections where one would do), and at a few rows each operation costs its dispatch.
Here a layer is one fused q/k/v projection, one fused gate/up projection (both prepacked for
oneDNN on CPU, workers.engine.linears), the rotary embedding of q and k together, the paged
attention op, and fused norms: about twenty operations.

The weights are the model's own parameters (norms, embeddings) or this process's fused and
packed copies of them (`own_bytes`); the transformers modules are left as they are, so a
reference run on the same model still runs transformers' code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.config_keys import LEAN_ARCHITECTURES as LLAMA_FAMILY
from workers.engine import attention, cpu_kernels
from workers.engine.linears import Linear, fused
from workers.precision import Precision


def unsupported(model) -> str | None:
    """Why `model` cannot run the lean forward, or None when it can."""
    name = type(model).__name__
    if name not in LLAMA_FAMILY:
        return f"{name} is not of the Llama family ({', '.join(LLAMA_FAMILY)})"
    cfg = model.config.get_text_config()
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp is not 1"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if "dynamic" in rope or rope == "longrope":
        return f"rope_type {rope!r} changes with the sequence length"
    return None


def applies(model, device: torch.device, prepack: bool) -> bool:
    """Whether the lean forward runs this model: `prepack_weights` asks for it, on CPU, Llama family."""
    return prepack and device.type == "cpu" and unsupported(model) is None


def lean_forward(model, holder: attention.ContextHolder, device: torch.device, precision: Precision,
                 prepack: bool) -> LeanLlama | None:
    """The lean forward for this model when it applies, its linears packed as `precision` says
    and computing in its compute dtype; else None (transformers' modules)."""
    if not applies(model, device, prepack):
        return None
    return LeanLlama(model, holder, precision, norms=cpu_kernels.kernel_module())


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
    """forward(ids, positions, keep, kv) -> logits of the kept rows, over the paged cache."""

    def __init__(self, model, holder: attention.ContextHolder, precision: Precision, norms=None):
        cfg = model.config.get_text_config()
        compute, kind = precision.compute, precision.linears
        self.compute = compute
        self.norms = norms  # the C++ norms (cpu_kernels), or None for F.rms_norm
        inner = model.model
        self.holder = holder
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        first = inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.scaling = first.scaling
        self.eps = cfg.rms_norm_eps
        self.hidden = cfg.hidden_size
        # 16-bit weights under float32 math: the embedding stays 16-bit (a row is widened when
        # looked up); the norms' small weights are widened once
        self.embed = inner.embed_tokens.weight.detach()
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm.weight.detach().to(compute)
        self.lm_head = Linear(model.lm_head.weight, getattr(model.lm_head, "bias", None), kind, compute=compute)
        windows = attention.layer_windows(model, [layer.self_attn for layer in inner.layers])
        self.layers = [
            _Layer(layer.input_layernorm.weight.detach().to(compute),
                   fused([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], kind, compute),
                   fused([layer.self_attn.o_proj], kind, compute),
                   layer.post_attention_layernorm.weight.detach().to(compute),
                   fused([layer.mlp.gate_proj, layer.mlp.up_proj], kind, compute),
                   fused([layer.mlp.down_proj], kind, compute),
                   windows[i])
            for i, layer in enumerate(inner.layers)]

    @property
    def own_bytes(self) -> int:
        """Memory this process holds of its own for the fused and packed weights."""
        linears = [self.lm_head] + [x for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(x.own_bytes for x in linears)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # in float32 inside: transformers' LlamaRMSNorm rounds to the dtype once more, before the
        # scale (the same in float32; within a rounding in bfloat16)
        if self.norms is not None:
            return self.norms.rms_norm(x.contiguous(), weight, self.eps)
        return F.rms_norm(x, (self.hidden,), weight, self.eps)

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its norm): one pass over the rows with the C++ norms, h updated in place."""
        if self.norms is not None:
            return h, self.norms.add_rms_norm(h, delta, weight, self.eps)
        h = h + delta
        return h, F.rms_norm(h, (self.hidden,), weight, self.eps)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """ids, positions: [N]; keep: the rows whose logits are returned. Returns [len(keep), vocab]."""
        h = F.embedding(ids, self.embed).to(self.compute)
        cos, sin = self.rotary(h, positions[None])
        half = self.head_dim // 2
        cos = cos[0]
        # rotate_half(x) * sin == roll(x, half) * [-sin_low, sin_high]: one roll, no cat of halves
        sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
        n, heads, kvh, d = ids.shape[0], self.heads, self.kv_heads, self.head_dim
        key_cache, value_cache = kv
        # C++: the rotation of q and k and the cache writes in one pass per layer (bit-equal)
        rope_write = getattr(self.norms, "rope_write", None) if cos.dtype == h.dtype else None
        # C++ silu * up in one pass, where it rounds as torch does (float32 keeps torch's exp)
        silu_mul = getattr(self.norms, "silu_mul", None) if h.dtype in (torch.bfloat16, torch.float16) else None
        x = self._norm(h, self.layers[0].input_norm)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(x)
            if rope_write is not None:
                gs, kb, vb = attention.layer_cache(self.holder, i, key_cache, value_cache)
                rope_write(qkv, cos, sin, kb, vb, gs.write_blocks, gs.write_offsets, heads, kvh)
                qk = qkv[:, : (heads + kvh) * d].view(n, heads + kvh, d)
            else:
                qk = qkv[:, : (heads + kvh) * d].view(n, heads + kvh, d)
                qk = qk * cos[:, None, :] + qk.roll(half, -1) * sin[:, None, :]
            v = qkv[:, (heads + kvh) * d:].view(n, kvh, d)
            a = attention.attend(self.holder, qk[:, :heads], qk[:, heads:], v, key_cache, value_cache, i,
                                 self.scaling, layer.window, None, written=rope_write is not None)
            h, x = self._add_norm(h, layer.o(a.reshape(n, heads * d)), layer.post_norm)
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
        h = self._norm(h.index_select(0, keep), self.final_norm)
        return self.lm_head(h)
