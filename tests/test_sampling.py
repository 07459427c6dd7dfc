"""Seeded sampling depends only on (seed, sample index, token index) and the logits."""

from __future__ import annotations

import random

from conftest import tiny

from workers.engine import Engine, EngineConfig
from workers.params import SamplingParams
from workers.sampler import uniform


def _engine(lm, **kw):
    return Engine(lm, EngineConfig(max_batch_size=kw.pop("max_batch_size", 20), max_batch_tokens=256, **kw))


def test_same_seed_alone_and_in_a_batch_of_16():
    lm = tiny("llama")
    prompt = [11, 22, 33, 44, 55]
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    alone = _engine(lm).generate([prompt], params)[0].outputs[0].token_ids
    rng = random.Random(5)
    others = [[rng.randrange(256) for _ in range(rng.randint(1, 60))] for _ in range(16)]
    other_params = [SamplingParams(max_tokens=rng.randint(1, 25), temperature=1.3, seed=i, ignore_eos=True)
                    for i in range(16)]
    batch = _engine(lm).generate(others[:7] + [prompt] + others[7:], other_params[:7] + [params] + other_params[7:])
    assert batch[7].outputs[0].token_ids == alone
    again = _engine(lm).generate([prompt], params)[0].outputs[0].token_ids
    assert again == alone


def test_n_samples_differ_and_share_one_prefill():
    lm = tiny("llama")
    eng = _engine(lm)
    prompt = list(range(1, 41))
    eng.add_request("r", prompt, SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True))
    prefill_tokens, final = 0, None
    while eng.has_unfinished():
        outs = eng.step()
        prefill_tokens += sum(c.length for c in eng.last_plan.prefill)
        final = next((o for o in outs if o.finished), final)
    seqs = [c.token_ids for c in final.outputs]
    assert len(seqs) == 4 and len({tuple(s) for s in seqs}) == 4
    assert prefill_tokens == len(prompt)  # computed once, not four times


def test_top_k_1_and_tiny_top_p_are_greedy():
    lm = tiny("gpt2")
    prompt = [5, 6, 7, 8]
    greedy = _engine(lm).generate([prompt], SamplingParams(max_tokens=15, temperature=0, ignore_eos=True))
    k1 = _engine(lm).generate([prompt], SamplingParams(max_tokens=15, temperature=1.5, top_k=1, seed=3,
                                                       ignore_eos=True))
    p0 = _engine(lm).generate([prompt], SamplingParams(max_tokens=15, temperature=1.5, top_p=1e-9, seed=3,
                                                       ignore_eos=True))
    assert k1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids == p0[0].outputs[0].token_ids


def test_different_seeds_differ():
    lm = tiny("llama")
    outs = _engine(lm).generate([[1, 2, 3]] * 2, [SamplingParams(max_tokens=16, temperature=1.0, seed=s,
                                                                   ignore_eos=True) for s in (1, 2)])
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_uniform_is_keyed_and_spread():
    vals = [uniform(42, s, t) for s in range(4) for t in range(250)]
    assert all(0 <= v < 1 for v in vals)
    assert abs(sum(vals) / len(vals) - 0.5) < 0.05
    assert uniform(42, 1, 7) == uniform(42, 1, 7) != uniform(42, 2, 7)
