"""The lean forward of the Llama family (Llama, SmolLM2, Mistral, Qwen 2) on a GPU: transformers'
weights and math over tensors of fixed shape, so a decode step is capturable as one CUDA graph.

Per layer: one fused q/k/v linear and one fused gate/up linear in the weights' dtype (bfloat16
for `auto`), the rotary embedding from a table of every position (looked up, not computed, so no
shape depends on the step), the KV write and paged attention as the runner's PagedOps
(workers.engine.paged_ops: the Triton kernels on CUDA), and RMS norms as transformers computes
them. The step's layout is tensors only: each token's position, KV slot, block-table row and
attended length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.engine.lean import AttentionShape, rotation
from workers.engine.paged_ops import PagedOps


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 kv heads) x head_dim, hidden]
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 x intermediate, hidden]
    down: torch.Tensor
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
    """forward(step, kv) -> logits of every row (or of `keep`)."""

    def __init__(self, model, ops: PagedOps, cache_index: dict[int, int], window: int | None, max_positions: int):
        inner = model.model
        self.ops = ops
        shape = AttentionShape.of(model)
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.scaling, self.eps = shape.scaling, shape.eps
        self.window = window or 0
        self.embed = inner.embed_tokens.weight.detach()
        self.final_norm = inner.norm.weight.detach()
        self.lm_head = model.lm_head.weight.detach()
        with torch.inference_mode():
            # transformers' rotary embedding of every position once: a step looks its rows up
            positions = torch.arange(max_positions, device=self.embed.device)[None]
            self.cos, self.sin = rotation(*inner.rotary_emb(self.embed[:1][None], positions))
        self.layers = [_Layer(layer.input_layernorm.weight.detach(),
                              torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                         layer.self_attn.v_proj.weight]).detach(),
                              layer.self_attn.o_proj.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                              torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).detach(),
                              layer.mlp.down_proj.weight.detach(), cache_index[i])
                       for i, layer in enumerate(inner.layers)]

    @property
    def own_bytes(self) -> int:
        """Memory of its own: the fused linears and the rotary tables."""
        fused = sum(t.numel() * t.element_size() for lay in self.layers for t in (lay.qkv, lay.gate_up))
        return fused + sum(t.numel() * t.element_size() for t in (self.cos, self.sin))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # as LlamaRMSNorm: in float32, rounded to the input's dtype before the scale
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def forward(self, step: DeviceStep, kv: tuple[torch.Tensor, torch.Tensor],
                keep: torch.Tensor | None = None) -> torch.Tensor:
        n, heads, kvh, d = step.ids.shape[0], self.heads, self.kv_heads, self.head_dim
        key_cache, value_cache = kv
        h = F.embedding(step.ids, self.embed)
        cos, sin = self.cos[step.positions][:, None, :], self.sin[step.positions][:, None, :]
        for layer in self.layers:
            x = self._norm(h, layer.input_norm)
            qkv = F.linear(x, layer.qkv)
            qk = qkv[:, : (heads + kvh) * d].view(n, heads + kvh, d)
            qk = qk * cos + qk.roll(d // 2, -1) * sin
            v = qkv[:, (heads + kvh) * d:].view(n, kvh, d)
            kc, vc = key_cache[layer.cache_index], value_cache[layer.cache_index]
            self.ops.kv_write(qk[:, heads:], v, kc, vc, step.slots)
            a = self.ops.attention(qk[:, :heads], kc, vc, step.tables, step.rows, step.lengths, self.scaling,
                                   self.window)
            h = h + F.linear(a.reshape(n, heads * d), layer.o)
            x = self._norm(h, layer.post_norm)
            gu = F.linear(x, layer.gate_up)
            inter = gu.shape[1] // 2
            h = h + F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], layer.down)
        if keep is not None:
            h = h.index_select(0, keep)
        return F.linear(self._norm(h, self.final_norm), self.lm_head)
