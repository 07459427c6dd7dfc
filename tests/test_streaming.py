"""Streaming: each step reports the new tokens; their concatenation is the final output."""

from __future__ import annotations

from support.models import tiny

from workers.engine import Engine, EngineConfig
from workers.engine.params import SamplingParams


def test_new_tokens_add_up_to_the_output():
    eng = Engine(tiny("gpt2"), EngineConfig(max_batch_size=8, max_batch_tokens=32))
    eng.add_request("a", list(range(1, 50)), SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    eng.add_request("b", [7, 8, 9], SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=4, ignore_eos=True))
    streamed: dict[tuple[str, int], list[int]] = {}
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            for c in out.outputs:
                streamed.setdefault((out.request_id, c.index), []).extend(c.new_token_ids)
                assert len(c.new_token_ids) <= 1  # one token per step per sequence
            if out.finished:
                final[out.request_id] = out
    assert streamed[("a", 0)] == final["a"].outputs[0].token_ids and len(streamed[("a", 0)]) == 9
    for c in final["b"].outputs:
        assert streamed[("b", c.index)] == c.token_ids and len(c.token_ids) == 5


def test_best_of_returns_the_n_best_by_mean_logprob():
    eng = Engine(tiny("llama"), EngineConfig(max_batch_size=8, max_batch_tokens=64))
    params = SamplingParams(n=2, best_of=5, max_tokens=6, temperature=1.2, seed=11, ignore_eos=True)
    out = eng.generate([[3, 4, 5]], params)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    everyone = Engine(tiny("llama"), EngineConfig(max_batch_size=8, max_batch_tokens=64)).generate(
        [[3, 4, 5]], SamplingParams(n=5, max_tokens=6, temperature=1.2, seed=11, ignore_eos=True, logprobs=0))[0]
    best = sorted(everyone.outputs, key=lambda c: -c.mean_logprob)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
