"""Scheduler and paged cache state, step by step: limits, chunking, admission, preemption, prefix caching."""

from __future__ import annotations

import random

import pytest
import torch
from support.models import cache_groups, engine_with_pool, hf_greedy, tiny

from workers.engine import Engine, EngineConfig
from workers.engine.block_manager import NO_BLOCK, BlockManager, CacheGroups, peak_blocks
from workers.engine.params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import Sequence, SequenceGroup

PACKED = ["gpt2", "llama", "mistral", "opt", "gemma3"]  # the tiny architectures on the paged path


def _group(rid, prompt, n=1, max_tokens=4):
    g = SequenceGroup(rid, prompt, SamplingParams(n=n, max_tokens=max_tokens), seed=0)
    g.seqs = [Sequence(i, g, i, prompt) for i in range(n)]
    return g


def _greedy(m: int) -> SamplingParams:
    return SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)


def _run(eng: Engine, prompts, params, check=None) -> list:
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(ids, prompts, params):
        eng.add_request(rid, p, sp)
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids
        if check:
            check(eng)
    return [final[r] for r in ids]


def test_limits_hold_at_every_step():
    lm = tiny("llama")
    cfg = EngineConfig(max_batch_size=5, max_batch_tokens=24)
    eng = Engine(lm, cfg)
    rng = random.Random(3)
    for i in range(14):
        eng.add_request(f"r{i}", [rng.randrange(256) for _ in range(rng.randint(1, 70))],
                        SamplingParams(max_tokens=rng.randint(1, 12), temperature=0, ignore_eos=True))
    seen_chunked = False
    blocks = eng.scheduler.blocks
    while eng.has_unfinished():
        eng.step()
        plan = eng.last_plan
        assert plan.num_tokens <= cfg.max_batch_tokens
        assert len(eng.scheduler.running) <= cfg.max_batch_size
        held = {b for s in eng.scheduler.running for t in s.blocks.tables for b in t if b != NO_BLOCK}
        assert len(held) == blocks.num_used  # every used block is some running sequence's
        for s in eng.scheduler.running:  # a sequence holds the blocks of its own length, no more
            assert all(len(t) == -(-s.num_computed // blocks.block_size) for t in s.blocks.tables)
        seen_chunked |= any(c.length < len(c.seq.prompt) for c in plan.prefill)
    assert seen_chunked
    assert blocks.num_used == 0 and blocks.num_free == blocks.num_blocks


def test_plan_contents_step_by_step():
    groups = CacheGroups.from_windows([None, None])
    s = Scheduler(SchedulerConfig(max_batch_size=2, max_batch_tokens=8), BlockManager(64, 4, groups, 8))
    a, b, c = _group("a", list(range(10))), _group("b", [50] * 3), _group("c", [60] * 2)
    for g in (a, b, c):
        s.add(g)
    p1 = s.schedule()  # a takes the whole budget: 8 of its 10 prompt tokens, in 2 blocks
    assert [(ch.seq.group.request_id, ch.start, ch.length) for ch in p1.prefill] == [("a", 0, 8)]
    assert not p1.prefill[0].need_logits and len(p1.new_blocks) == 2
    assert a.seqs[0].blocks.tables == [p1.new_blocks]  # both layers in one group: one table
    a.seqs[0].num_computed += 8
    p2 = s.schedule()  # a finishes its prompt (2), then b is admitted (3 tokens), c waits: 2 sequences run
    assert [(ch.seq.group.request_id, ch.start, ch.length) for ch in p2.prefill] == [("a", 8, 2), ("b", 0, 3)]
    assert all(ch.need_logits for ch in p2.prefill)
    assert [g.request_id for g in s.waiting] == ["c"] and len(s.running) == 2
    for ch in p2.prefill:
        ch.seq.num_computed += ch.length
        ch.seq.output.append(1)
    p3 = s.schedule()  # both decode, one token each
    assert sorted(x.group.request_id for x in p3.decode) == ["a", "b"] and not p3.prefill
    used = s.blocks.num_used
    s.finish(b.seqs[0], "stop")
    assert s.blocks.num_used == used - 1
    p4 = s.schedule()  # b's place went back; c is admitted
    assert [ch.seq.group.request_id for ch in p4.prefill] == ["c"]


def test_group_waits_for_enough_room():
    s = Scheduler(SchedulerConfig(max_batch_size=3, max_batch_tokens=64),
                  BlockManager(64, 4, CacheGroups.from_windows([None]), 64))
    s.add(_group("a", [1, 2, 3]))
    s.add(_group("b", [4, 5, 6], n=3))
    s.schedule()
    assert len(s.running) == 1 and [g.request_id for g in s.waiting] == ["b"]


@pytest.mark.parametrize("arch", PACKED)
def test_preemption_recomputes_and_keeps_outputs_exact(arch):
    """A pool too small for the batch: the newest sequences are preempted, queued again and
    recomputed; every stream still equals transformers' greedy tokens, none repeated or missing."""
    lm = tiny(arch, dtype="float32")
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    max_tokens = [rng.randint(20, 40) for _ in prompts]
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    blocks = peak_blocks(cache_groups(lm), 4, 32, longest) + 6  # each fits alone, not all six together
    eng = engine_with_pool(lm, blocks=blocks, block_size=4, max_batch_size=6, max_batch_tokens=32)
    streamed: dict[str, list[int]] = {}
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        eng.add_request(f"r{i}", p, _greedy(m))
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            streamed.setdefault(o.request_id, []).extend(o.outputs[0].new_token_ids)
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids
        assert eng.scheduler.blocks.num_used <= blocks
    assert eng.stats()["preemptions"] > 0
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        want = hf_greedy(lm.model, p, m)
        assert final[f"r{i}"] == want
        assert streamed[f"r{i}"] == want  # the stream: no token twice, none missing


def test_a_request_that_can_never_fit_is_refused_at_once():
    lm = tiny("llama")
    eng = engine_with_pool(lm, blocks=8, block_size=4)  # 32 tokens
    with pytest.raises(ValueError, match=r"holds 32 tokens of one sequence.*kv_cache_memory"):
        eng.add_request("big", list(range(1, 30)), SamplingParams(max_tokens=4))
    assert not eng.has_unfinished()
    out = eng.generate([list(range(1, 29))], _greedy(4))[0]  # exactly the pool: served
    assert out.outputs[0].token_ids == hf_greedy(lm.model, list(range(1, 29)), 4)


def test_a_prompt_at_the_full_context_is_served_while_others_stream():
    lm = tiny("llama", dtype="float32")
    ctx = lm.max_model_len
    rng = random.Random(2)
    long = [rng.randrange(256) for _ in range(ctx - 4)]
    shorts = [[rng.randrange(256) for _ in range(5)] for _ in range(3)]
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64))
    for i, p in enumerate(shorts):
        eng.add_request(f"s{i}", p, _greedy(30))
    eng.step()
    eng.add_request("long", long, _greedy(4))
    decoding_steps = 0
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        plan = eng.last_plan
        if any(c.seq.group.request_id == "long" for c in plan.prefill):
            decoding_steps += len(plan.decode) == 3  # the short streams went on beside its chunks
    assert decoding_steps >= 5
    assert outs["long"] == hf_greedy(lm.model, long, 4)
    for i, p in enumerate(shorts):
        assert outs[f"s{i}"] == hf_greedy(lm.model, p, 30)


@pytest.mark.parametrize("floor", [1, 5])
def test_a_long_prompt_chunk_shrinks_as_its_attention_grows(floor):
    """Beside decoding sequences, a long prompt's chunk at position p counts 1 + p/attention_span
    per token: the chunk is long_prefill_tokens at its start and at most a quarter of it three
    spans on, but never fewer than min_long_chunk tokens."""
    blocks = BlockManager(200, 16, CacheGroups.from_windows([None]), 64)
    sched = Scheduler(SchedulerConfig(max_batch_size=4, max_batch_tokens=64, long_prefill_tokens=16,
                                      attention_span=100, min_long_chunk=floor), blocks)
    sched.add(_group("short", [1, 2, 3], max_tokens=500))
    (chunk,) = sched.schedule().prefill
    chunk.seq.num_computed = len(chunk.seq.prompt)
    sched.computed(chunk.seq)
    chunk.seq.output.append(0)  # its first token: from now on it decodes
    sched.add(_group("long", list(range(1000)), max_tokens=1))
    long_seq = sched.groups["long"].seqs[0]
    sizes = {}
    while long_seq.num_computed < 400:
        plan = sched.schedule()
        assert [s.group.request_id for s in plan.decode] == ["short"]
        for s in plan.decode:
            s.num_computed += 1
            s.output.append(0)
            sched.computed(s)
        (chunk,) = plan.prefill
        sizes[chunk.start] = chunk.length
        long_seq.num_computed += chunk.length
        sched.computed(long_seq)
    assert sizes[0] == 16 and {n for p, n in sizes.items() if p >= 300} <= ({3, 4} if floor == 1 else {floor})
    assert all(n == max(floor, int(16 / (1 + p / 100))) for p, n in sizes.items())


def _long_beside_short(sched: Scheduler, observe) -> tuple[dict[int, int], int]:
    """Chunk sizes of a 1,000-token prompt beside one decoding stream until 600 of its tokens are
    computed, and the steps that took; `observe(plan)` gives the seconds the engine would report."""
    sched.add(_group("short", [1, 2, 3], max_tokens=10_000))
    (chunk,) = sched.schedule().prefill
    chunk.seq.num_computed = len(chunk.seq.prompt)
    sched.computed(chunk.seq)
    chunk.seq.output.append(0)
    for _ in range(5):  # the stream alone: its own pace
        plan = sched.schedule()
        (s,) = plan.decode
        s.num_computed += 1
        s.output.append(0)
        sched.computed(s)
        sched.observe(plan, observe(plan))
    sched.add(_group("long", list(range(1000)), max_tokens=1))
    long_seq = sched.groups["long"].seqs[0]
    sizes = {}
    steps = 0
    while long_seq.num_computed < 600:
        plan = sched.schedule()
        steps += 1
        assert [s.group.request_id for s in plan.decode] == ["short"]  # the stream never waits
        for s in plan.decode:
            s.num_computed += 1
            s.output.append(0)
            sched.computed(s)
        for chunk in plan.prefill:
            assert plan.long_tokens == chunk.length and plan.long_want > 0
            sizes[chunk.start] = chunk.length
            long_seq.num_computed += chunk.length
            sched.computed(long_seq)
        sched.observe(plan, observe(plan))
    return sizes, steps


def test_a_long_chunk_shrinks_when_steps_show_it_slows_the_streams_more_than_priced():
    """The price of a long chunk is corrected by the clock: where each of its tokens costs four
    decode rows (memory-bound attention, a shared bus), the chunk shrinks to the floor and then
    runs on some steps only, until the streams' steps grow by about SLOWDOWN on average; where
    chunks are cheap, it stays at its price."""
    from workers.engine.pace import SLOWDOWN

    def fresh():
        return Scheduler(SchedulerConfig(max_batch_size=4, max_batch_tokens=64, long_prefill_tokens=16,
                                         attention_span=None, min_long_chunk=2),
                         BlockManager(1000, 16, CacheGroups.from_windows([None]), 64))

    row = 0.01

    def costly(plan):  # a chunk token costs 4 rows
        return row * len(plan.decode) + 4 * row * sum(c.length for c in plan.prefill)

    def cheap(plan):
        return row * len(plan.decode) + 0.01 * row * sum(c.length for c in plan.prefill)

    slow = fresh()
    sizes, steps = _long_beside_short(slow, costly)
    assert sizes[0] == 16 and min(sizes.values()) == 2
    assert {n for p, n in sizes.items() if p >= 300} == {2}  # the floor, on some steps only
    # on average a step carries SLOWDOWN of a row's cost: SLOWDOWN / 4 tokens (a little more
    # while the pace converges)
    assert SLOWDOWN / 4 <= 600 / steps <= 2 * SLOWDOWN / 4 + 0.05, steps
    fast = fresh()
    sizes, steps = _long_beside_short(fast, cheap)
    assert set(sizes.values()) == {16} and fast.pace.scale == 1.0 and steps == 600 // 16 + 1
    # without observations (the engine reports none) the chunk is its price
    assert set(_long_beside_short(fresh(), lambda plan: 0.0)[0].values()) == {16}


def test_a_chunk_owes_the_slower_step_after_it_and_the_streams_pace_stays_their_own():
    """A decode-only step right after a long chunk runs slower (the chunk's keys and values went
    through the caches): that time counts against the chunk, so the long prompt goes on over more
    steps than where the step after a chunk is as fast as any, and the streams' pace per row stays
    what their own steps take."""
    def fresh():
        return Scheduler(SchedulerConfig(max_batch_size=4, max_batch_tokens=64, long_prefill_tokens=16,
                                         attention_span=None, min_long_chunk=2),
                         BlockManager(1000, 16, CacheGroups.from_windows([None]), 64))

    row = 0.01

    def timing(polluted: bool):
        last = {"chunk": False}

        def observe(plan):
            seconds = row * len(plan.decode) + 0.5 * row * sum(c.length for c in plan.prefill)
            if polluted and not plan.prefill and last["chunk"]:
                seconds += 3 * row
            last["chunk"] = bool(plan.prefill)
            return seconds
        return observe

    clean, polluted = fresh(), fresh()
    _, clean_steps = _long_beside_short(clean, timing(False))
    _, polluted_steps = _long_beside_short(polluted, timing(True))
    assert polluted_steps > 1.5 * clean_steps, (clean_steps, polluted_steps)
    assert polluted.pace.per_row == pytest.approx(row) and clean.pace.per_row == pytest.approx(row)


def test_a_cpu_pool_reuses_touched_blocks_before_never_used_ones():
    """With cache_reserve, freed blocks (cached or not) are taken before never-used blocks once the
    cache holds more than the reserve: the resident pool stays near what is in use. Without it,
    cached blocks stay until no never-used block is left."""
    groups = CacheGroups.from_windows([None])

    def cycle(reserve):
        bm = BlockManager(100, 4, groups, 16, cache_reserve=reserve)
        touched = set()
        for r in range(6):
            sb = bm.new_seq()
            assert bm.allocate(sb, 0, 16)  # 4 blocks
            touched.update(sb.tables[0])
            bm.commit(sb, list(range(r * 100, r * 100 + 16)), 16)  # distinct prompts: all cached
            bm.free(sb)
        return bm, touched

    bm, touched = cycle(reserve=5)
    assert len(touched) <= 4 + 5 + 4 and len(bm.evictable) >= 5  # touched: one sequence, the reserve, one more
    assert bm.num_free == 100 and bm.untouched == 100 - len(touched)
    bm, touched = cycle(reserve=None)
    assert len(touched) == 24 and len(bm.evictable) == 24


def test_prefix_blocks_are_reused_without_copy_then_evicted_lru():
    lm = tiny("mistral", dtype="float32")
    rng = random.Random(9)
    shared = [rng.randrange(256) for _ in range(40)]
    eng = engine_with_pool(lm, blocks=40, block_size=8, max_batch_size=4, max_batch_tokens=64)
    blocks = eng.scheduler.blocks
    first = shared + [1, 2, 3]
    out = _run(eng, [first], [_greedy(6)])
    assert out[0] == hf_greedy(lm.model, first, 6)
    cached = {d: b for d, b in blocks.cached[0].items()}
    assert len(cached) == (len(first) + 6 - 1) // 8  # its full blocks, prompt and output, stay cached

    # a finished request's blocks serve the next prompt with the same prefix: 5 blocks, no copy
    second = shared + [7, 7]
    eng.add_request("second", second, _greedy(5))
    eng.step()
    seq = eng.scheduler.running[0]
    assert eng.last_plan.prefill[0].start == 40 and seq.blocks.tables[0][:5] == [cached[d] for d in seq.blocks.digests[:5]]
    assert all(blocks.ref[b] == 1 for b in seq.blocks.tables[0][:5])
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["prefix_cache_hits"] == 40

    # prompts that need most of the pool evict cached blocks to make room, and run exactly
    before = set(blocks.cached[0])
    filler = [[rng.randrange(256) for _ in range(70)] for _ in range(4)]
    assert _run(eng, filler, [_greedy(3)] * 4) == [hf_greedy(lm.model, f, 3) for f in filler]
    assert before - set(blocks.cached[0])  # some were evicted
    assert blocks.num_free == blocks.num_blocks


def test_sliding_window_layers_hold_only_their_window():
    lm = tiny("gemma3", dtype="float32")
    groups = cache_groups(lm)
    window = next(w for w in groups.windows if w is not None)
    rng = random.Random(4)
    prompt = [rng.randrange(256) for _ in range(min(lm.max_model_len - 40, 3 * window + 20))]
    eng = Engine(lm, EngineConfig(max_batch_size=2, max_batch_tokens=32, kv_block_size=8))
    eng.add_request("a", prompt, _greedy(30))
    most = [0] * len(groups.windows)
    out = None
    while eng.has_unfinished():
        for o in eng.step():
            out = o
        for s in eng.scheduler.running:
            for g, t in enumerate(s.blocks.tables):
                most[g] = max(most[g], sum(b != NO_BLOCK for b in t))
    bs = 8
    for g, w in enumerate(groups.windows):
        if w is None:
            assert most[g] >= -(-len(prompt) // bs)  # every position
        else:
            assert most[g] <= -(-(w - 1 + 32) // bs) + 1 < -(-len(prompt) // bs)
    assert out.outputs[0].token_ids == hf_greedy(lm.model, prompt, 30)


def test_decode_reads_only_the_blocks_each_sequence_holds():
    """Decode cost follows the sum of the lengths: one long sequence beside short ones adds its own
    blocks to the step, and the pool's tensors never change size."""
    lm = tiny("llama", dtype="float32")
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, kv_block_size=8))
    cache = eng.runner.cache
    ptr, size = cache.keys.data_ptr(), cache.nbytes()
    steps, run_call = [], eng.runner.run_call
    eng.runner.run_call = lambda ctx, call: steps.append(ctx) or run_call(ctx, call)
    rng = random.Random(6)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (400, 5, 6, 7)]
    outs = eng.generate(prompts, _greedy(10))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(lm.model, p, 10)
    decode_steps = [ctx for ctx in steps if ctx.num_decode == 4]
    assert decode_steps
    for ctx in decode_steps:
        pairs = ctx.groups[0].pair_blocks.numel()
        assert pairs <= 52 + 3 * 3 < 4 * 51  # 400-410 tokens in at most 52 blocks, the short ones 1-3 each
    assert cache.keys.data_ptr() == ptr and cache.nbytes() == size


def test_a_device_decode_kernel_plugs_in_at_one_seam():
    """The seam a CUDA paged kernel uses: an attention backend handed to the engine at load gets
    every decode call with the step's (row, block) pairs; here a CPU kernel that checks and delegates."""
    from workers.engine import attention
    from workers.engine.attention_backend import AttentionBackend

    lm = tiny("llama", dtype="float32")
    calls = []

    def kernel(gs, q, key, value, scaling, softcap):
        calls.append(gs.pair_blocks.numel())
        return attention.decode_attention(gs, q, key, value, scaling, softcap)

    prompts = [[5, 6, 7], list(range(1, 40))]
    eng = Engine(lm, EngineConfig(max_batch_size=2), attention=AttentionBackend("checked", kernel))
    outs = eng.generate(prompts, _greedy(6))
    assert calls and eng.attention_backend.name == "checked"
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(lm.model, p, 6)
    # chosen per engine, never for the process: another engine on the same weights runs its own
    assert Engine(lm, EngineConfig(max_batch_size=2)).attention_backend.name != "checked"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_paged_cache_on_cuda_matches_transformers(arch):
    from workers.models import load_model

    lm = load_model(f"tiny:{arch}", dtype="float32", device="cuda")
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 17, 60, 100)]
    eng = engine_with_pool(lm, blocks=110, block_size=4, max_batch_size=4, max_batch_tokens=64)  # small: it preempts
    outs = eng.generate(prompts, _greedy(20))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(lm.model, p, 20)


def test_a_sliding_window_pool_holds_sequences_longer_than_itself():
    """Mistral's layers all slide (window 48): a pool of 18 blocks of 4 positions (72) holds a
    sequence of 120 tokens, since it keeps only its window and a chunk (17 blocks); a model of
    full attention is refused."""
    lm = tiny("mistral", dtype="float32")
    eng = engine_with_pool(lm, blocks=18, block_size=4, max_batch_size=2, max_batch_tokens=16)
    prompt = [(7 * i) % 250 + 1 for i in range(100)]
    out = eng.generate([prompt], _greedy(20))[0]
    assert out.outputs[0].token_ids == hf_greedy(lm.model, prompt, 20)
    assert eng.stats()["tokens_capacity"] == lm.max_model_len
    full = engine_with_pool(tiny("llama", dtype="float32"), blocks=18, block_size=4, max_batch_size=2,
                            max_batch_tokens=16)
    with pytest.raises(ValueError, match="holds 72 tokens of one sequence"):
        full.add_request("r", prompt, _greedy(20))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_engine_gives_the_pace_each_steps_model_call_time(arch):
    """What the pace corrects a long chunk's price with is the time of the step's own model call, on
    the runner that serves, a runner whose launch runs the step at once included: after decode-only
    steps the streams' pace per row is known (were the seconds not reported, it would stay None and
    the chunk would keep its price however it slowed the streams)."""
    lm = tiny(arch, dtype="float32")
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, long_prefill_tokens=16))
    eng.add_request("stream", [1, 2, 3], _greedy(200))
    for _ in range(6):
        eng.step()
    per_row = eng.scheduler.pace.per_row
    assert per_row is not None and 0 < per_row < 1


def test_the_streams_pace_keeps_to_their_undisturbed_steps_and_follows_a_lasting_change():
    """Another copy's chunks on the same cores slow some of this copy's decode-only steps: the
    streams' pace stays near the undisturbed ones (else this copy's chunks would be granted the
    other's slowdown too), and still follows a change that lasts (contexts that grew)."""
    from workers.engine.pace import LongChunkPace

    row = 0.01
    pace = LongChunkPace()
    for i in range(400):  # every other step beside the other copy's chunk, 40% slower
        pace.observe(16, 0, 0, 0.0, 16 * row * (1.4 if i % 2 else 1.0))
    assert row <= pace.per_row <= 1.05 * row, pace.per_row
    for _ in range(400):  # the streams' steps themselves became half again as long
        pace.observe(16, 0, 0, 0.0, 16 * row * 1.5)
    assert pace.per_row == pytest.approx(1.5 * row, rel=0.01)
