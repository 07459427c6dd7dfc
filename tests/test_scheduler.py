"""Scheduler state, step by step: limits, chunking, admission, prefix sharing."""

from __future__ import annotations

import random

from support.models import hf_greedy, tiny

from workers.engine import Engine, EngineConfig
from workers.engine.params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import Sequence, SequenceGroup


def _group(rid, prompt, n=1, max_tokens=4):
    g = SequenceGroup(rid, prompt, SamplingParams(n=n, max_tokens=max_tokens), seed=0, arrival=0)
    g.seqs = [Sequence(i, g, i, prompt) for i in range(n)]
    return g


def test_limits_hold_at_every_step():
    lm = tiny("llama")
    cfg = EngineConfig(max_batch_size=5, max_batch_tokens=24)
    eng = Engine(lm, cfg)
    rng = random.Random(3)
    for i in range(14):
        eng.add_request(f"r{i}", [rng.randrange(256) for _ in range(rng.randint(1, 70))],
                        SamplingParams(max_tokens=rng.randint(1, 12), temperature=0, ignore_eos=True))
    seen_chunked = False
    while eng.has_unfinished():
        eng.step()
        plan = eng.last_plan
        assert plan.num_tokens <= cfg.max_batch_tokens
        assert len(eng.scheduler.running) <= cfg.max_batch_size
        assert eng.scheduler.slots_in_use() <= cfg.max_batch_size
        assert len({s.slot for s in eng.scheduler.running}) == len(eng.scheduler.running)  # no shared slot
        seen_chunked |= any(c.length < len(c.seq.prompt) for c in plan.prefill)
    assert seen_chunked
    assert eng.scheduler.slots_in_use() == 0


def test_plan_contents_step_by_step():
    s = Scheduler(SchedulerConfig(max_batch_size=2, max_batch_tokens=8, min_shared_prefix=4))
    a, b, c = _group("a", list(range(10))), _group("b", [50] * 3), _group("c", [60] * 2)
    for g in (a, b, c):
        s.add(g)
    p1 = s.schedule()  # a takes the whole budget: 8 of its 10 prompt tokens
    assert [(ch.seq.group.request_id, ch.start, ch.length) for ch in p1.prefill] == [("a", 0, 8)]
    assert not p1.prefill[0].need_logits
    a.seqs[0].num_computed += 8
    p2 = s.schedule()  # a finishes its prompt (2), then b is admitted (3 tokens), c waits: no slot left
    assert [(ch.seq.group.request_id, ch.start, ch.length) for ch in p2.prefill] == [("a", 8, 2), ("b", 0, 3)]
    assert all(ch.need_logits for ch in p2.prefill)
    assert [g.request_id for g in s.waiting] == ["c"] and s.slots_in_use() == 2
    for ch in p2.prefill:
        ch.seq.num_computed += ch.length
        ch.seq.output.append(1)
    p3 = s.schedule()  # both decode, one token each
    assert sorted(x.group.request_id for x in p3.decode) == ["a", "b"] and not p3.prefill
    s.finish(b.seqs[0], "stop")
    p4 = s.schedule()  # b's slot went back; c is admitted
    assert [ch.seq.group.request_id for ch in p4.prefill] == ["c"]
    assert c.seqs[0].slot == 1


def test_shared_prefix_is_copied_not_recomputed():
    lm = tiny("mistral")
    rng = random.Random(9)
    shared = [rng.randrange(256) for _ in range(60)]
    prompts = [shared + [rng.randrange(256) for _ in range(rng.randint(1, 10))] for _ in range(4)]
    eng = Engine(lm, EngineConfig(max_batch_size=8, max_batch_tokens=128, min_shared_prefix=16))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    computed, copies, outs = 0, [], {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        computed += sum(c.length for c in eng.last_plan.prefill)
        copies += eng.last_plan.copies
    assert len(copies) == 3 and all(n == 60 for _, _, n in copies)
    assert computed == sum(map(len, prompts)) - 3 * 60
    for i, p in enumerate(prompts):  # and the results are those of an unshared run
        assert outs[f"r{i}"] == hf_greedy(lm.model, p, 8)


def test_group_waits_for_enough_slots():
    s = Scheduler(SchedulerConfig(max_batch_size=3, max_batch_tokens=64))
    s.add(_group("a", [1, 2, 3]))
    s.add(_group("b", [4, 5, 6], n=3))
    s.schedule()
    assert s.slots_in_use() == 1 and [g.request_id for g in s.waiting] == ["b"]


def test_finished_slots_are_compacted():
    s = Scheduler(SchedulerConfig(max_batch_size=4, max_batch_tokens=64))
    groups = [_group(r, [i + 1, i + 2]) for i, r in enumerate("abcd")]
    for g in groups:
        s.add(g)
    plan = s.schedule()
    for ch in plan.prefill:
        ch.seq.num_computed += ch.length
        ch.seq.output.append(7)
    assert [g.seqs[0].slot for g in groups] == [0, 1, 2, 3]
    s.finish(groups[0].seqs[0], "stop")  # slot 0 becomes a hole
    s.finish(groups[2].seqs[0], "stop")  # and slot 2
    plan = s.schedule()
    assert plan.moves == [(3, 0, 2)]  # d (slot 3, 2 tokens cached) moves into the lowest hole
    assert sorted(x.slot for x in plan.decode) == [0, 1]
    assert s.free_slots == [2, 3]
