"""Tiny random models and the transformers references the engine is compared with."""

from __future__ import annotations

import random

import torch

from workers.engine.attention import hf_attention
from workers.engine.params import SamplingParams
from workers.models import load_model

ARCHS = ["gpt2", "llama", "mistral", "opt", "bloom", "gemma3"]


def tiny(arch: str, dtype: str = "float64"):
    """A fresh engine-ready tiny model; weights are deterministic for (arch, dtype)."""
    return load_model(f"tiny:{arch}", dtype=dtype)


def hf_greedy(model, prompt: list[int], max_new: int, **generate) -> list[int]:
    """transformers generate(do_sample=False) on its own attention, never stopping early; `generate`:
    more of generate's arguments (a logits processor's, e.g. repetition_penalty)."""
    attn = "eager" if model.config.model_type == "bloom" else "sdpa"
    with hf_attention(model, attn), torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0, **generate)
    return out[0, len(prompt):].tolist()


_REAL_REFERENCES: dict = {}


def hf_greedy_real(name: str, model, prompt: list[int], max_new: int) -> list[int]:
    """hf_greedy for a session's real-model fixture `name`, computed once per session: the eager
    and the compiled parity tests ask for the same references, and each takes seconds."""
    key = (name, tuple(prompt), max_new)
    if key not in _REAL_REFERENCES:
        _REAL_REFERENCES[key] = hf_greedy(model, prompt, max_new)
    return _REAL_REFERENCES[key]


REAL_BATCH_MAX_TOKENS = [12, 20, 9, 16, 5, 24]


def real_batch_prompts(lm) -> list[list[int]]:
    """The real-model batch: text and random prompts of 1-200 tokens."""
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    rng = random.Random(0)
    prompts = [lm.tokenizer(t).input_ids for t in texts]
    return prompts + [[rng.randrange(1000, 30000) for _ in range(n)] for n in (1, 57, 200)]


def real_mixed_batch_matches_transformers(name: str, lm, eng) -> None:
    """Real-model parity in one mixed batch (real_batch_prompts): `eng`'s greedy output equals
    transformers generate for each, token for token."""
    prompts, max_tokens = real_batch_prompts(lm), REAL_BATCH_MAX_TOKENS
    outs = eng.generate(prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens])
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.outputs[0].token_ids == hf_greedy_real(name, lm.model, p, m)


def plain_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of one plain forward pass over `tokens`, on transformers' own attention."""
    attn = "eager" if model.config.model_type == "bloom" else "sdpa"
    with hf_attention(model, attn), torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def cache_groups(lm):
    """The KV cache groups an engine on `lm` uses (one group of every layer for the per-sequence runner)."""
    from workers.engine.attention import install
    from workers.engine.block_manager import CacheGroups

    holder = install(lm.model)
    return holder.groups if holder is not None else CacheGroups.from_windows(
        [None] * lm.model.config.get_text_config().num_hidden_layers)


def engine_with_pool(lm, blocks: int, block_size: int = 4, **kw):
    """An engine whose KV pool holds exactly `blocks` blocks of `block_size` positions."""
    from workers.engine import Engine, EngineConfig
    from workers.engine.kv_cache import bytes_per_block
    from workers.engine.runners.base import kv_dims

    per_block = bytes_per_block(cache_groups(lm), block_size, *kv_dims(lm), lm.dtype)
    eng = Engine(lm, EngineConfig(kv_cache_memory=blocks * per_block, kv_block_size=block_size, **kw))
    assert eng.scheduler.blocks.num_blocks == blocks
    return eng


def dequantized_reference(model, kind: str):
    """A copy of `model` whose linears hold the values the engine's `quantization: kind` computes
    with, quantized afresh (the LM head int8; int4 gives q/k/v, fused with v, and down int8:
    workers.quant.fuse.linear_kind)."""
    import copy

    from workers.quant.weight import INT4, INT8, quantize

    ref = copy.deepcopy(model)
    wider = ("lm_head", "q_proj", "k_proj", "v_proj", "down_proj") if kind == INT4 else ("lm_head",)
    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(quantize(module.weight, INT8 if name.endswith(wider) else kind).dequantize())
    return ref
