"""Greedy output equals transformers generate(do_sample=False), token for token."""

from __future__ import annotations

import random

import pytest
from support.models import (
    ARCHS,
    REAL_BATCH_MAX_TOKENS,
    cache_groups,
    engine_with_pool,
    hf_greedy,
    hf_greedy_real,
    real_batch_prompts,
    real_mixed_batch_matches_transformers,
    tiny,
)

from workers.engine import Engine, EngineConfig
from workers.engine.block_manager import peak_blocks
from workers.engine.params import SamplingParams


def _greedy(m: int) -> SamplingParams:
    return SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_transformers(arch):
    lm = tiny(arch)
    rng = random.Random(arch)
    lengths = [1, 2, 7, 33, 64, 120, 200] + [rng.randint(1, 200) for _ in range(3)]
    prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    # A small token budget forces chunked prefill of the long prompts alongside decoding.
    eng = Engine(lm, EngineConfig(max_batch_size=6, max_batch_tokens=48))
    outs = eng.generate(prompts, [_greedy(m) for m in max_tokens])
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.outputs[0].token_ids == hf_greedy(lm.model, p, m), f"prompt of {len(p)} tokens"
        assert o.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "gemma3", "bloom"])
def test_requests_joining_a_running_batch(arch):
    lm = tiny(arch)
    rng = random.Random(1)
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=40))
    prompts = {f"r{i}": [rng.randrange(256) for _ in range(rng.randint(1, 90))] for i in range(8)}
    max_tokens = {rid: rng.randint(3, 20) for rid in prompts}
    pending = list(prompts)
    done = {}
    step = 0
    while pending or eng.has_unfinished():
        # add one new request every other step, while earlier ones are mid-generation
        if pending and step % 2 == 0:
            rid = pending.pop(0)
            eng.add_request(rid, prompts[rid], _greedy(max_tokens[rid]))
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    for rid, p in prompts.items():
        assert done[rid] == hf_greedy(lm.model, p, max_tokens[rid]), rid


def _real_model_parity(fixture: str, request) -> None:
    """One test for the eager and a preempting engine: transformers' references for a real model
    take seconds, computed once. Compiled, the same modules are tiny Gemma 3's and tiny Llama's code
    paths, which test_compiled checks token for token; compiling a real model again here would only
    repeat them at many times the cost."""
    lm = request.getfixturevalue(fixture)
    cfg = {"max_batch_size": 4, "max_batch_tokens": 96}
    real_mixed_batch_matches_transformers(fixture, lm, Engine(lm, EngineConfig(**cfg, compile="false")))
    # the batch's four short requests in a pool with room for about two: the newest are preempted,
    # and still exact (the references are the ones above)
    prompts, max_tokens = real_batch_prompts(lm)[:4], REAL_BATCH_MAX_TOKENS[:4]
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    small = engine_with_pool(lm, peak_blocks(cache_groups(lm), 4, 96, longest) + 2, 4, **cfg, compile="false")
    outs = small.generate(prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens])
    assert small.stats()["preemptions"] > 0
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.outputs[0].token_ids == hf_greedy_real(fixture, lm.model, p, m)


# One class per real model: pytest-xdist (--dist loadscope) schedules a class as a unit of its
# own, so the two longest tests of the suite run side by side instead of one after the other.
@pytest.mark.slow
class TestSmolLM2:
    def test_matches_transformers_eager_and_preempted(self, request):
        _real_model_parity("smollm2_fp32", request)


@pytest.mark.slow
class TestGemma3:
    def test_matches_transformers_eager_and_preempted(self, request):
        _real_model_parity("gemma3_fp32", request)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt2"])
def test_equal_length_prompts_attend_as_one_batch(arch):
    """Whole prompts of one length in a step are one batched attention call: still transformers'
    tokens for each, next to prompts of other lengths and a chunked one."""
    from workers.engine.attention import Segment, StepContext

    segs = [Segment(0, 5, 0), Segment(5, 5, 0), Segment(10, 2, 0), Segment(12, 5, 0),
            Segment(17, 5, 9)]  # the last is a later chunk of a prompt: attended alone
    ctx = StepContext(0, 22, [], segs, position={}, windows=[None])
    groups, alone = ctx.whole_prompt_groups(None, "cpu")
    assert [(t.tolist(), n) for t, n in groups] == [([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 16], 5)]
    assert alone == [2, 4]
    assert ctx.whole_prompt_groups(4, "cpu") == ([], [0, 1, 2, 3, 4])  # a window shorter than them

    lm = tiny(arch)
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (6, 6, 6, 6, 3, 6, 40)]
    max_tokens = [rng.randint(1, 8) for _ in prompts]
    eng = Engine(lm, EngineConfig(max_batch_size=8, max_batch_tokens=64))
    outs = eng.generate(prompts, [_greedy(m) for m in max_tokens])
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.outputs[0].token_ids == hf_greedy(lm.model, p, m), f"prompt of {len(p)} tokens"
