"""What every device's lean forward takes from a Llama-family model alike: its attention's
shape, the rotary tables in the form the rotation takes, the biases of fused linears, and the
weight-only blocks a model holds in place of its 16-bit linears."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.quant.fuse import QuantizedLinears
from workers.weights.blocks_only import release_linears
from workers.weights.fused_layout import side_by_side

if TYPE_CHECKING:
    from workers.precision import Precision
    from workers.quant.weight import QuantizedWeight
    from workers.weights.loaded_model import LoadedModel


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


def held_blocks(lm: LoadedModel, prec: Precision, lean: bool) -> dict[str, QuantizedWeight] | None:
    """The model's linears as blocks, where it holds no 16-bit weights for them (a weight owner's
    copy, or a model an engine was built on before: keep_blocks_only), if they are what this engine
    runs (`prec` on the lean forward, `lean`); None where it holds none. Any other precision has
    nothing to run: refused by name."""
    built = lm.quantized
    if built is None:
        return None
    held = (f"{lm.source} on {lm.device} holds its linears as {built.key} blocks only "
            f"({'its weight owner let' if lm.weights is not None and lm.weights.shared else 'an engine built on it let'}"
            " their 16-bit weights go)")
    if not lean:
        raise ValueError(f"{held}, which the lean forward runs, and this engine does not run it (prepack_weights: "
                         "false?): give every copy of the model on the device the same settings, or load it again")
    if not prec.quantized or built.key != prec.quantized_key:
        asked = prec.quantized_key if prec.quantized else "none"
        raise ValueError(f"{held}, and this engine asks quantization {asked}: give every copy of the model on the "
                         "device the same quantization, or load it again")
    return built.weights


def keep_blocks_only(lm: LoadedModel, prec: Precision, blocks: dict[str, QuantizedWeight]) -> int:
    """Let the 16-bit weights of the linears `blocks` serve go (workers.weights.blocks_only), where the
    model is one engine's alone (LoadedModel.one_engine), keeping the blocks with the model for an
    engine built on it again (held_blocks). Returns the bytes let go."""
    if not (lm.one_engine and blocks) or (lm.weights is not None and lm.weights.shared):
        return 0
    lm.quantized = QuantizedLinears(prec.quantized_key, blocks)
    return release_linears(lm.model, lm.quantized.modules)
