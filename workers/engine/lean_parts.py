"""What every device's lean forward takes from a Llama-family model alike: its attention's
shape, the rotary tables in the form the rotation takes, and the biases of fused linears."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.weights.fused_layout import side_by_side


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """The Llama family's attention as its config and first layer give it."""

    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    eps: float  # the RMS norms'

    @classmethod
    def of(cls, model) -> AttentionShape:
        cfg = model.config.get_text_config()
        first = model.model.layers[0].self_attn
        heads = cfg.num_attention_heads
        return cls(heads, getattr(cfg, "num_key_value_heads", None) or heads, first.head_dim, first.scaling,
                   cfg.rms_norm_eps)


def rotation(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rows [N, head_dim] as the rotation takes them: rotate_half(x) * sin ==
    roll(x, half) * [-sin_low, sin_high], one roll and no cat of halves."""
    half = cos.shape[-1] // 2
    return cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)


def fused_bias(modules: list[torch.nn.Linear]) -> torch.Tensor | None:
    """The biases of `modules` side by side (zeros for a module without one), or None if none has one."""
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return None
    if all(b is not None for b in biases) and (span := side_by_side(biases)) is not None:
        return span  # laid out side by side already (workers.weights.fused_layout): no copy
    return torch.cat([b.detach() if b is not None else m.weight.new_zeros(m.out_features)
                      for m, b in zip(modules, biases)])
