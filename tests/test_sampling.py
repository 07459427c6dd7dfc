"""Seeded sampling depends only on (seed, sample index, token index) and the logits."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from support.models import tiny

from workers.engine import Engine, EngineConfig
from workers.engine.params import SamplingParams
from workers.engine.sampler import SampleSpec, sample, uniform


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
    # the prompt's two full blocks are computed once and shared; each other sample computes only
    # the 8 tokens of the last, partial block
    bs = eng.scheduler.blocks.block_size
    assert bs == 16 and prefill_tokens == len(prompt) + 3 * (len(prompt) - 2 * bs)
    assert eng.stats()["prefix_cache_hits"] == 3 * 2 * bs


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


def _draws(logits: torch.Tensor, n: int, **kw) -> Counter:
    """n tokens drawn from one logits row, each with its own (seed, token index) key."""
    opts = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **kw}
    specs = [SampleSpec(row=i, seed=99, sample_index=0, token_index=i, num_top=None, **opts) for i in range(n)]
    tokens, _, _ = sample(logits.expand(n, -1).contiguous(), specs)
    return Counter(tokens)


def _chi_square(counts: Counter, probs: list[float], n: int) -> float:
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in enumerate(probs) if p > 0)


# chi-square critical values at p = 0.001: the draws are deterministic (fixed seeds), so this
# threshold only has to separate "the right distribution" from a wrong one, never flake
CHI2_999 = {1: 10.83, 3: 16.27, 7: 24.32}


def test_sampled_tokens_follow_the_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 4000
    for temperature in (1.0, 0.5, 2.0):
        probs = torch.softmax(logits / temperature, -1).tolist()
        got = _draws(logits, n, temperature=temperature)
        assert _chi_square(got, probs, n) < CHI2_999[7], (temperature, got)
    # and it is not just any distribution: the same draws against the untempered one fail the test
    assert _chi_square(_draws(logits, n, temperature=2.0), torch.softmax(logits, -1).tolist(), n) > CHI2_999[7]


def test_top_p_keeps_the_smallest_head_reaching_p_and_renormalizes():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    logits = probs.log()
    n = 4000
    # sorted: 0.4, 0.3 | 0.2, 0.1. The head before 0.3 holds 0.4 < 0.6, so 0.3 stays; 0.2 is past it.
    got = _draws(logits, n, top_p=0.6)
    assert set(got) == {1, 3}
    assert _chi_square(got, [0, 4 / 7, 0, 3 / 7], n) < CHI2_999[1]
    got = _draws(logits, n, top_p=0.75)  # 0.4 + 0.3 = 0.7 < 0.75: the 0.2 token is needed too
    assert set(got) == {1, 2, 3}
    assert _chi_square(got, [0, 4 / 9, 2 / 9, 3 / 9], n) < 13.82  # df 2


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    got = _draws(logits, 2000, top_k=2)
    assert set(got) == {1, 3}


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does():
    """bfloat16 logits tie often (8 bits of mantissa over a large vocabulary); transformers takes
    the first maximal index, and so must greedy here, in whatever dtype the logits come."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randint(0, 3, (64, 5000), generator=gen).to(dtype)  # every row has many tied maxima
        specs = [SampleSpec(row=r, temperature=0, top_k=0, top_p=1.0, seed=0, sample_index=0, token_index=0,
                            num_top=None, want_logprob=False) for r in range(64)]
        tokens, _, _ = sample(logits, specs)
        assert tokens == logits.float().argmax(-1).tolist()
    # a NaN wins its row, as in torch's argmax, whichever way the dtype takes
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        logits = torch.randn(3, 5000, generator=gen).to(dtype)
        logits[1, 4321] = float("nan")
        logits[2, 17] = logits[2, 4000] = 1e4
        spec = [SampleSpec(row=r, temperature=0, top_k=0, top_p=1.0, seed=0, sample_index=0, token_index=0,
                           num_top=None, want_logprob=False) for r in range(3)]
        assert sample(logits, spec)[0] == [logits[0].float().argmax().item(), 4321, 17], dtype


def test_sampler_makes_its_tensors_on_the_logits_device():
    """A tensor created without the logits' device lands on `meta` here, and mixing devices raises:
    the CPU stand-in for a CUDA run (where a CPU tensor among CUDA ones fails every sampled request)."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    specs = [SampleSpec(row=r, temperature=0.7, top_k=10, top_p=0.9, seed=1, sample_index=0, token_index=r,
                        num_top=2) for r in (2, 0)]
    with torch.device("meta"):
        tokens, chosen, tops = sample(logits, specs)
    assert all(0 <= t < 50 for t in tokens) and all(x <= 0 for x in chosen) and all(len(t) == 2 for t in tops)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampler_on_cuda_matches_cpu():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    specs = [SampleSpec(row=r, temperature=0.8, top_k=40, top_p=0.9, seed=7, sample_index=0, token_index=r,
                        num_top=3) for r in range(4)]
    cpu = sample(logits, specs)
    gpu = sample(logits.cuda(), specs)
    assert gpu[0] == cpu[0]
