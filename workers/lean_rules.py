"""Which models the lean forward (workers.engine.cpu.lean) runs: its families, and the configs of theirs
it computes exactly. The platform asks this at load (workers.platform.for_model)."""

from __future__ import annotations

import torch

from workers.config_keys import FLOAT32_LEAN, LEAN_ARCHITECTURES


def unsupported(model, compute: torch.dtype, float32_lean: tuple[str, ...] = FLOAT32_LEAN) -> str | None:
    """Why `model` cannot run the lean forward computing in `compute` (the dtype its platform would
    compute its weights in on the lean forward), or None when it can. `float32_lean`: the classes
    whose lean forward on the device computes in float32 only."""
    name = type(model).__name__
    if name not in LEAN_ARCHITECTURES:
        return f"{name} has no lean forward (it has for {', '.join(LEAN_ARCHITECTURES)})"
    cfg = model.config.get_text_config()
    if name == "Gemma3ForCausalLM":
        return _gemma3_unsupported(model, cfg, compute, name in float32_lean)
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp is not 1"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if "dynamic" in rope or rope == "longrope":
        return f"rope_type {rope!r} changes with the sequence length"
    return None


def _gemma3_unsupported(model, cfg, compute: torch.dtype, float32_only: bool) -> str | None:
    if float32_only and compute != torch.float32:
        return f"Gemma 3's lean forward computes in float32, and {model.dtype} weights compute in {compute} here"
    if getattr(cfg, "hidden_activation", None) != "gelu_pytorch_tanh":
        return f"hidden_activation {getattr(cfg, 'hidden_activation', None)!r} is not gelu_pytorch_tanh"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "use_bidirectional_attention is set"
    ropes = (getattr(cfg, "rope_parameters", None) or {}).values()
    if any((r or {}).get("rope_type", "default") != "default" for r in ropes):
        return "a rope_type other than default"
    return None


def unquantizable(model) -> str | None:
    """Why the lean forward's linears of `model` cannot be weight-only quantized (blocks of 32
    values of a row: every linear's input size a multiple of 32), or None."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    sizes = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_attention_heads x head_dim": heads * head_dim}
    bad = [f"{name} {size}" for name, size in sizes.items() if size % 32]
    return f"its linears' input sizes are not multiples of 32 ({', '.join(bad)})" if bad else None


def attention_modules(model) -> list:
    """The model's attention modules (those that carry a layer index and projections)."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and (hasattr(m, "q_proj") or hasattr(m, "c_attn"))]


def layer_windows(model, attention_modules: list) -> list[int | None]:
    """The sliding window of each layer (None: full attention), as its attention module passes
    it: Gemma 3 and Qwen 2 modules carry `sliding_window`; Mistral's pass the config's."""
    cfg = model.config.get_text_config()
    windows: list[int | None] = [None] * (max(m.layer_idx for m in attention_modules) + 1)
    for mod in attention_modules:
        w = mod.sliding_window if hasattr(mod, "sliding_window") else getattr(cfg, "sliding_window", None)
        windows[mod.layer_idx] = int(w) if w else None
    return windows
