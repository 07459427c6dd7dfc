"""Penalties, biases and min_tokens (SamplingParams.adjusts_logits, sampler.LogitsAdjust): the
engine's greedy tokens against transformers' generate and a step-by-step reference, a request's
adjustments its own inside a batch, and the checks of their values."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from support.models import hf_attention, hf_greedy, tiny

from workers.engine import Engine, EngineConfig
from workers.engine.params import SamplingParams
from workers.request_params import sampling_params
from workers.validate import ParamError


def _engine(lm) -> Engine:
    return Engine(lm, EngineConfig(max_batch_size=8, max_batch_tokens=64))


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(1, 250) for _ in range(n)] for n in (4, 9)]


def test_repetition_penalty_gives_transformers_greedy_and_stays_its_requests_own():
    lm = tiny("llama", dtype="float32")
    eng = _engine(lm)
    prompts = _prompts()
    plain = [o.outputs[0].token_ids for o in eng.generate(prompts, _greedy(60))]
    penalized = [o.outputs[0].token_ids for o in eng.generate(prompts, _greedy(60, repetition_penalty=1.3))]
    for p, got in zip(prompts, penalized):
        assert got == hf_greedy(lm.model, p, 60, repetition_penalty=1.3)
    assert penalized != plain  # the random model repeats itself within 60 tokens
    # side by side in one batch, each request keeps its own tokens
    mixed = eng.generate([prompts[0], prompts[1]], [_greedy(60), _greedy(60, repetition_penalty=1.3)])
    assert [o.outputs[0].token_ids for o in mixed] == [plain[0], penalized[1]]


def _penalized_reference(model, prompt: list[int], n: int, frequency: float, presence: float) -> list[int]:
    """Greedy, each output token's count times `frequency` plus `presence` off its logit."""
    ids, out = list(prompt), []
    with hf_attention(model, "sdpa"), torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for t, k in Counter(out).items():
                logits[t] -= frequency * k + presence
            out.append(int(torch.argmax(logits)))
            ids.append(out[-1])
    return out


def test_frequency_and_presence_penalties_count_the_output_tokens():
    lm = tiny("llama", dtype="float32")
    eng = _engine(lm)
    for p in _prompts():
        plain = eng.generate([p], _greedy(40))[0].outputs[0].token_ids
        got = eng.generate([p], _greedy(40, frequency_penalty=0.75, presence_penalty=0.5))[0].outputs[0].token_ids
        assert got == _penalized_reference(lm.model, p, 40, 0.75, 0.5) != plain


def test_logit_bias_and_min_tokens_hold_back_the_end():
    """A bias of 100 on the end token ends the answer at once; min_tokens 5 holds it back for five
    tokens. A sampled answer with a bias of 100 on one token is that token. The log-probabilities
    reported are the model's own, before the bias."""
    lm = tiny("llama", dtype="float32")
    eng = _engine(lm)
    eos = lm.eos_token_ids[0]
    prompt = [5, 17, 33, 2]
    ended = eng.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, logit_bias={str(eos): 100}))
    assert ended[0].outputs[0].token_ids == [eos] and ended[0].outputs[0].finish_reason == "stop"
    held = eng.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, logit_bias={str(eos): 100},
                                                 min_tokens=5, logprobs=0))[0].outputs[0]
    assert len(held.token_ids) == 6 and eos not in held.token_ids[:5] and held.token_ids[5] == eos
    with hf_attention(lm.model, "sdpa"), torch.inference_mode():
        raw = torch.log_softmax(lm.model(torch.tensor([prompt + held.token_ids[:5]])).logits[0, -1].float(), -1)
    assert held.logprobs[5] == pytest.approx(float(raw[eos]), abs=1e-4)  # the bias is not in it
    sampled = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=1.0, seed=4, ignore_eos=True,
                                                    logit_bias={7: 100}))
    assert sampled[0].outputs[0].token_ids == [7] * 8
    first = eng.generate([prompt], _greedy(1))[0].outputs[0].token_ids[0]
    assert eng.generate([prompt], _greedy(1, logit_bias={first: -100}))[0].outputs[0].token_ids[0] != first


@pytest.mark.parametrize("params,name", [
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
])
def test_bad_values_are_refused_by_name(params, name):
    with pytest.raises(ParamError) as info:
        sampling_params(params)
    assert info.value.param == name


def test_a_bias_past_the_vocabulary_is_refused_and_the_engine_serves_on():
    lm = tiny("llama", dtype="float32")
    eng = _engine(lm)
    with pytest.raises(ParamError, match="logit_bias token ID 100000 is not in the vocabulary"):
        eng.add_request("r", [1, 2], SamplingParams(max_tokens=2, logit_bias={100000: 1}))
    assert len(eng.generate([[1, 2]], _greedy(3))[0].outputs[0].token_ids) == 3


def test_min_tokens_holds_back_stop_strings_too():
    """A stop string that the first tokens' text holds ends the answer there; with min_tokens 6 it
    is not looked for until six tokens are out (vLLM's rule)."""
    lm = tiny("llama", dtype="float32")
    eng = _engine(lm)
    prompt = [5, 17, 33, 2]
    full = eng.generate([prompt], _greedy(12))[0].outputs[0]
    stop = lm.tokenizer.decode(full.token_ids[:2])[-1]  # a character of the second token's text
    cut = eng.generate([prompt], _greedy(12, stop=[stop]))[0].outputs[0]
    assert len(cut.token_ids) <= 2 and cut.finish_reason == "stop"
    held = eng.generate([prompt], _greedy(12, stop=[stop], min_tokens=6))[0].outputs[0]
    assert len(held.token_ids) >= 7 and held.token_ids == full.token_ids[:len(held.token_ids)]
    assert held.text.startswith(lm.tokenizer.decode(full.token_ids[:6]))
