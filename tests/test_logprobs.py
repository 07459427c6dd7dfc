"""Chosen-token and prompt log-probabilities equal log_softmax of a plain forward pass."""

from __future__ import annotations

import random

import pytest
import torch
from support.models import plain_logits, tiny

from workers.engine import Engine, EngineConfig
from workers.engine.params import SamplingParams


def _check(lm, prompt, max_tokens, k=3):
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=32))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=k, prompt_logprobs=k)
    # a companion request keeps the batch mixed while the scored one runs
    out = eng.generate([prompt, prompt[::-1][:20]], [params, params])[0]
    gen = out.outputs[0].token_ids
    logp = torch.log_softmax(plain_logits(lm.model, prompt + gen).double(), dim=-1)
    full = prompt + gen
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i] == pytest.approx(logp[i - 1, full[i]].item(), abs=1e-4)
        top = sorted(out.prompt_top_logprobs[i].items(), key=lambda kv: -kv[1])
        assert [t for t, _ in top] == torch.topk(logp[i - 1], k).indices.tolist()
    for j, tok in enumerate(gen):
        row = logp[len(prompt) - 1 + j]
        assert out.outputs[0].logprobs[j] == pytest.approx(row[tok].item(), abs=1e-4)
        top = out.outputs[0].top_logprobs[j]
        assert len(top) == k and tok in top  # greedy: the chosen token is the best one
        for t, v in top.items():
            assert v == pytest.approx(row[t].item(), abs=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3", "bloom"])
def test_logprobs_tiny_float32(arch):
    rng = random.Random(arch)
    _check(tiny(arch, "float32"), [rng.randrange(256) for _ in range(70)], 10)


@pytest.mark.slow
def test_logprobs_smollm2_float32(smollm2_fp32):
    prompt = smollm2_fp32.tokenizer("The quick brown fox jumps over the lazy dog. Then it").input_ids
    _check(smollm2_fp32, prompt, 8)


def test_max_tokens_zero_scores_prompt_only():
    lm = tiny("llama", "float32")
    eng = Engine(lm, EngineConfig())
    prompt = list(range(10, 40))
    out = eng.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    logp = torch.log_softmax(plain_logits(lm.model, prompt), dim=-1)
    expect = [None] + [logp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert out.prompt_logprobs[1:] == pytest.approx(expect[1:], abs=1e-4)


def test_logprobs_only_for_requests_that_ask():
    eng = Engine(tiny("llama"), EngineConfig(max_batch_size=4, max_batch_tokens=32))
    plain = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    asked = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    ranked = SamplingParams(n=1, best_of=2, max_tokens=5, temperature=1.0, seed=3, ignore_eos=True)
    a, b, c = eng.generate([[1, 2, 3]] * 3, [plain, asked, ranked])
    assert a.outputs[0].logprobs is None and a.outputs[0].cumulative_logprob is None
    assert len(b.outputs[0].logprobs) == 5 and all(v <= 0 for v in b.outputs[0].logprobs)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids  # the same tokens either way
    assert len(c.outputs[0].logprobs) == 5  # best_of ranks its samples by them
