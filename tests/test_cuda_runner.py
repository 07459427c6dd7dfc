"""The CUDA runner's decode step, run on the CPU: the same step function its graphs capture, eagerly,
with the reference paged ops (workers.engine.cuda.ops). Its buckets and padding, its persistent
buffers, the device sampler against the host's, and greedy tokens against transformers. On a GPU
the last test captures the graphs for real."""

from __future__ import annotations

import random

import pytest
import torch
from support.models import dequantized_reference, hf_greedy, tiny

from workers.engine import Engine, EngineConfig
from workers.engine.cuda.runner import CudaRunner, decode_buckets
from workers.engine.cuda.sampler import SamplingRows, sample_tokens, uniforms
from workers.engine.params import SamplingParams
from workers.engine.sampler import SampleSpec, sample, uniform
from workers.platform import CudaPlatform, for_model
from workers.quant.weight import INT4, INT8


def _greedy(m: int) -> SamplingParams:
    return SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)


def _engine(lm, device: str = "cpu", quantization: str = "none", **cfg) -> Engine:
    """An engine whose platform is CUDA's, on `device` (the CPU: reference ops, no graphs)."""
    prec = CudaPlatform.quantized(CudaPlatform.compute(lm.dtype, True), quantization, True, "tiny")
    platform = CudaPlatform(torch.device(device), prec, lean=True, deterministic=cfg.get("deterministic", False))
    cfg = {"max_batch_size": 6, "max_batch_tokens": 64, "kv_block_size": 4, "kv_cache_memory": 4 << 20, **cfg}
    return Engine(lm, EngineConfig(**cfg), platform=platform)


def _captured(eng: Engine) -> set[int]:
    """The buckets with both of their graphs captured: the all-greedy one and the sampling one."""
    graphs = set(eng.runner.graphs)
    return {b for b, _ in graphs if (b, True) in graphs and (b, False) in graphs}


def test_buckets_cover_every_batch_up_to_the_largest():
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    eng = _engine(tiny("llama", dtype="float32"))
    runner = eng.runner
    assert isinstance(runner, CudaRunner) and runner.device_lean is not None
    assert [runner.bucket(n) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    assert runner.cache.keys.shape[1] == eng.scheduler.blocks.num_blocks + 1  # the dummy block
    assert eng.compile_info.reason.startswith("its decode steps run as captured CUDA graphs")


def test_greedy_tokens_equal_transformers_and_buffers_stay_put():
    """A mixed batch (prefill chunks, then decode steps of 1 to 6 rows, padded up to buckets of 2,
    4 and 6) gives transformers' greedy tokens, and the decode buffers never move."""
    lm = tiny("llama", dtype="float32")
    eng = _engine(lm)
    buf = eng.runner.buffers
    addresses = [t.data_ptr() for t in (buf.device_inputs, buf.tokens, buf.logits, eng.runner.cache.keys)]
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 250) for _ in range(n)] for n in (3, 9, 1, 17, 5)]
    max_tokens = [7, 3, 12, 5, 9]
    decode_rows: list[int] = []
    step = eng.runner._decode_step
    eng.runner._decode_step = lambda seqs: decode_rows.append(len(seqs)) or step(seqs)
    outs = eng.generate(prompts, [_greedy(m) for m in max_tokens])
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.outputs[0].token_ids == hf_greedy(lm.model, p, m)
    assert {3, 5} & set(decode_rows)  # rows padded up to a bucket served
    assert addresses == [t.data_ptr() for t in (buf.device_inputs, buf.tokens, buf.logits, eng.runner.cache.keys)]


@pytest.mark.parametrize("arch,blocks", [("llama", 32), ("mistral", 31)])
def test_preemption_windows_and_samples_on_the_runner(arch, blocks):
    """A pool too small for the batch (preempted sequences come back from the prefix cache),
    Mistral's sliding window (48) crossed by long prompts, and n=2 samples sharing a prompt's
    blocks: transformers' greedy tokens throughout."""
    from workers.engine.kv_cache import bytes_per_block
    from workers.engine.runners.base import kv_dims

    lm = tiny(arch, dtype="float32")
    per_block = bytes_per_block(eng_groups(lm), 4, *kv_dims(lm), torch.float32)
    eng = _engine(lm, max_batch_size=4, kv_cache_memory=blocks * per_block)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 250) for _ in range(n)] for n in (3, 17, 60, 100)]
    outs = eng.generate(prompts, _greedy(20))
    assert eng.stats()["preemptions"] > 0 or arch == "mistral"  # its window keeps each sequence small
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(lm.model, p, 20)
    two = eng.generate([prompts[1]], SamplingParams(max_tokens=6, n=2, temperature=0.0, ignore_eos=True))[0]
    assert [c.token_ids for c in two.outputs] == [hf_greedy(lm.model, prompts[1], 6)] * 2


def eng_groups(lm):
    from support.models import cache_groups

    return cache_groups(lm)


def test_padding_changes_no_output():
    """The same three sequences decoded in a bucket of 4 and of 6 rows: the padded rows (the dummy
    block, length 0) change neither their tokens nor their logits."""
    lm = tiny("llama", dtype="float32")
    results = []
    for largest in (4, 6):
        eng = _engine(lm, max_batch_size=largest)
        eng.runner.buckets = [largest]  # every decode step in one bucket
        for i, p in enumerate(([5, 6, 7], [9] * 6, [11, 3])):
            eng.add_request(f"r{i}", p, _greedy(6))
        logits = []
        step = eng.runner._decode_step

        def keep(seqs, step=step, logits=logits):
            out, tokens = step(seqs)
            logits.append(out.clone())
            return out, tokens

        eng.runner._decode_step = keep
        tokens = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        results.append((tokens, logits))
    (tok4, log4), (tok6, log6) = results
    assert tok4 == tok6
    assert len(log4) == len(log6) and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(log4, log6))


def test_the_device_sampler_equals_the_host_sampler():
    """Greedy, temperature, top_k and top_p rows together, one tensor op each: the host sampler's
    tokens, row for row, and its uniform numbers bit for bit."""
    gen = torch.Generator().manual_seed(0)
    seeds = [0, 1, 2**63 - 1, 12345678901234, 7, 99]
    got = uniforms(torch.tensor(seeds), torch.tensor([0, 3, 1, 0, 2, 5]), torch.tensor([0, 1, 7, 1000, 3, 2]))
    want = [uniform(s, i, t) for s, i, t in zip(seeds, [0, 3, 1, 0, 2, 5], [0, 1, 7, 1000, 3, 2])]
    assert got.tolist() == want
    vocab = 50
    settings = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 3, 0.5), (2.0, vocab, 1.0)]
    for trial in range(20):
        logits = torch.randn(len(settings), vocab, generator=gen) * 3
        specs = [SampleSpec(i, t, k, p, 1000 + trial, i, trial, None, False) for i, (t, k, p) in enumerate(settings)]
        want, _, _ = sample(logits, specs)
        rows = SamplingRows.empty(len(settings), torch.device("cpu"))
        rows.fill({"temperature": [s[0] for s in settings], "top_k": [s[1] for s in settings],
                   "top_p": [s[2] for s in settings], "seed": [1000 + trial] * len(settings),
                   "sample_index": list(range(len(settings))), "token_index": [trial] * len(settings)})
        assert sample_tokens(logits, rows).tolist() == want, trial


def test_seeded_sampling_and_logprobs_through_the_runner():
    """Seeded random requests give the host engine's tokens (the same rule on the same logits);
    a request for log-probabilities takes the host sampler, with its values."""
    lm = tiny("llama", dtype="float32")
    params = [SamplingParams(max_tokens=8, temperature=0.8, top_k=20, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)]
    prompts = [[4, 5, 6], [7, 8], [9, 10, 11, 12]]
    got = _engine(lm).generate(prompts, params)
    want = Engine(lm, EngineConfig(max_batch_size=6, max_batch_tokens=64, kv_block_size=4)).generate(prompts, params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert got[2].outputs[0].logprobs == pytest.approx(want[2].outputs[0].logprobs, abs=1e-4)


def _run(eng: Engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]], abort: dict[int, str]):
    """Step an engine to the end: requests added and aborted before given steps; each request's tokens."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while eng.has_unfinished() or any(k >= step for k in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            eng.add_request(rid, prompt, params)
        if step in abort:
            eng.abort(abort[step])
        for out in eng.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    return tokens


@pytest.mark.parametrize("arch,blocks", [("llama", 200), ("llama", 24), ("mistral", 60)])
def test_steps_started_ahead_give_the_same_tokens(arch, blocks):
    """Host/device overlap: a decode step started before the last one's tokens reach the host
    (its inputs are those tokens, on the device) gives the tokens of steps run one after the
    other, with greedy, seeded and log-probability requests, arrivals and an abort mid-run, a pool
    too short to plan ahead at times (24 blocks) and a sliding window (Mistral's 48) crossed."""
    from workers.engine.kv_cache import bytes_per_block
    from workers.engine.runners.base import kv_dims

    lm = tiny(arch, dtype="float32")
    per_block = bytes_per_block(eng_groups(lm), 4, *kv_dims(lm), torch.float32)
    rng = random.Random(11)
    arrivals: dict[int, list] = {}
    for i, (at, n, m) in enumerate([(0, 5, 30), (0, 11, 40), (0, 2, 70), (3, 7, 12), (20, 40, 25), (21, 3, 1)]):
        prompt = [rng.randrange(1, 250) for _ in range(n)]
        params = (SamplingParams(max_tokens=m, temperature=0.9, top_k=30, seed=i, ignore_eos=True) if i % 2
                  else _greedy(m))
        arrivals.setdefault(at, []).append((f"r{i}", prompt, params))
    arrivals[30] = [("lp", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True))]
    abort = {15: "r1"}
    runs = []
    for overlap in (False, True):
        eng = _engine(lm, max_batch_size=4, kv_cache_memory=blocks * per_block)
        eng.runner.overlap = overlap
        runs.append((_run(eng, arrivals, abort), eng.steps_ahead))
    (sync, none_ahead), (ahead, steps_ahead) = runs
    assert none_ahead == 0 and steps_ahead > 10
    assert ahead == sync
    assert len(sync["r2"]) == 70 and len(sync["r1"]) < 40  # r1 aborted part-way


def test_a_step_started_ahead_whose_rows_all_end_is_dropped():
    """Every sequence of a step ends on its tokens: the step started ahead of them is waited for and
    dropped, the engine has nothing left, and the next request runs as usual."""
    lm = tiny("llama", dtype="float32")
    eng = _engine(lm)
    eng.runner.overlap = True
    first = eng.generate([[4, 5, 6], [7, 8]], [_greedy(5), _greedy(5)])
    assert eng.steps_ahead > 0 and eng._ahead is None and not eng.has_unfinished()
    again = eng.generate([[4, 5, 6]], _greedy(5))[0]
    assert again.outputs[0].token_ids == first[0].outputs[0].token_ids == hf_greedy(lm.model, [4, 5, 6], 5)


@pytest.mark.parametrize("arch,kind", [("llama", INT8), ("llama", INT4), ("qwen2", INT4), ("gemma3", INT4)])
def test_quantized_linears_give_transformers_greedy_on_their_values(arch, kind):
    """`quantization: int8` / `int4` on the device's lean forward (PagedOps.qlinear: the reference
    here, the Triton kernel on a GPU): every linear reads weight-only blocks, and the greedy tokens
    equal transformers' on a model holding the blocks' values. Qwen 2's q/k/v biases (random here:
    its initialisation zeroes them) are added; Gemma 3's layer takes the blocks alike."""
    lm = tiny(arch, dtype="float32")
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    ref = dequantized_reference(lm.model, kind)
    eng = _engine(lm, quantization=kind)
    lean = eng.runner.device_lean
    assert all(lin.quant is not None for lin in lean.linears())
    dense = sum(m.weight.numel() * 4 for m in lm.model.modules() if isinstance(m, torch.nn.Linear))
    assert sum(lin.own_bytes for lin in lean.linears()) < dense / 3
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 250) for _ in range(n)] for n in (3, 9, 17)]
    outs = eng.generate(prompts, [_greedy(8)] * len(prompts))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(ref, p, 8)


def test_a_quantized_engine_lets_the_16_bit_weights_of_its_blocks_go():
    """The linears an engine runs as blocks keep no 16-bit weights beside them, where the model is
    that engine's alone (a worker's): they go to `meta`, the embedding (an LM head tied to it reads
    it too) stays. An engine built on the model again runs the same blocks, and one asking another
    quantization is refused by name."""
    lm = tiny("llama", dtype="float32")
    ref = dequantized_reference(lm.model, INT4)
    kept = _engine(lm, quantization=INT4)  # a model other engines may run too keeps its weights
    assert not any(p.is_meta for p in lm.model.parameters()) and lm.quantized is None
    del kept
    lm.one_engine = True  # as a worker loads it
    linears = {name for name, m in lm.model.named_modules() if isinstance(m, torch.nn.Linear)}
    eng = _engine(lm, quantization=INT4)
    meta = {name.removesuffix(".weight") for name, p in lm.model.named_parameters() if p.is_meta}
    tied = lm.model.lm_head.weight is lm.model.model.embed_tokens.weight
    assert meta == linears - ({"lm_head"} if tied else set()) and meta
    assert not lm.model.model.embed_tokens.weight.is_meta
    assert lm.quantized.key == INT4 and set(lm.quantized.weights) == set(eng.runner.device_lean.quantized_weights())
    prompt = [7, 3, 99, 41, 5]
    want = hf_greedy(ref, prompt, 8)
    assert eng.generate([prompt], _greedy(8))[0].outputs[0].token_ids == want
    again = _engine(lm, quantization=INT4)
    assert again.generate([prompt], _greedy(8))[0].outputs[0].token_ids == want
    assert sum(lin.own_bytes for lin in again.runner.device_lean.linears()) > 0  # this process's memory still
    with pytest.raises(ValueError, match="holds its linears as int4 blocks only.*asks quantization int8"):
        _engine(lm, quantization=INT8)
    with pytest.raises(ValueError, match="asks quantization none"):
        _engine(lm)


def test_steps_with_prompt_chunks_run_padded_to_their_token_bucket():
    """A step with prompt chunks (prefill, and chunks beside decode rows) runs from the step buffers
    padded to its token bucket: the body its graph captures on a GPU (workers.engine.cuda.mixed_steps).
    Each such step's kept logits equal the eager forward's on the same step; a step whose kept rows
    the buffers cannot hold (a prompt's scores keep every row) runs eagerly; greedy tokens equal
    transformers'."""
    lm = tiny("llama", dtype="float32")
    eng = _engine(lm, max_batch_size=4, max_batch_tokens=32)
    runner = eng.runner
    assert runner.token_buckets == [16, 32] and runner.steps.seqs == 4
    paths = []
    padded = runner._forward

    def both(decode, chunks):
        got = padded(decode, chunks)
        paths.append(("buffers" if got.data_ptr() == runner.steps.logits.data_ptr() else "eager", len(decode),
                      len(chunks)))
        torch.testing.assert_close(got, runner._eager_forward(decode, chunks), atol=1e-5, rtol=1e-5)
        return got

    runner._forward = both
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 250) for _ in range(n)] for n in (5, 23, 11, 40)]
    outs = eng.generate(prompts, [_greedy(6)] * len(prompts))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(lm.model, p, 6)
    assert all(kind == "buffers" for kind, _, _ in paths), paths
    assert any(d and c for _, d, c in paths), paths  # chunks beside decode rows
    scored = eng.generate([prompts[1]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))[0]
    assert len(scored.prompt_logprobs) == len(prompts[1])
    assert paths[-1][0] == "eager"  # 23 kept rows: more than the buffers' 4


def test_the_lean_forward_fuses_linears_over_the_weights_with_no_copy():
    """A copy with weights of its own lays each layer's q/k/v and gate/up out side by side (Qwen 2's
    biases too): the fused linears are views of the model's weights, and its answers are unchanged."""
    lm = tiny("qwen2", dtype="float32")
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    want = hf_greedy(lm.model, [4, 5, 6, 7], 8)
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    eng = _engine(lm)
    lean = eng.runner.device_lean
    assert sum(lin.own_bytes for lin in lean.linears()) == 0
    layer, attn = lean.layers[0], lm.model.model.layers[0].self_attn
    assert layer.qkv.weight.data_ptr() == attn.q_proj.weight.data_ptr()
    assert layer.qkv.bias.data_ptr() == attn.q_proj.bias.data_ptr()
    assert torch.equal(layer.qkv.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert sum(p.numel() * p.element_size() for p in lm.model.parameters()) == weights
    assert eng.generate([[4, 5, 6, 7]], _greedy(8))[0].outputs[0].token_ids == want


def test_penalties_are_the_host_samplers_on_the_runner_too():
    """A request that changes its logits (here a repetition penalty) takes its tokens from the host
    sampler, not from the device's, and gets transformers' greedy tokens under that penalty."""
    lm = tiny("llama", dtype="float32")
    eng = _engine(lm)
    prompt = [5, 17, 33, 2, 99, 4]
    got = eng.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                repetition_penalty=1.3))
    assert got[0].outputs[0].token_ids == hf_greedy(lm.model, prompt, 40, repetition_penalty=1.3)


def test_qwen2_biases_are_added_on_the_dense_path_too():
    lm = tiny("qwen2", dtype="float32")
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    eng = _engine(lm)
    assert eng.runner.device_lean.layers[0].qkv.bias is not None
    outs = eng.generate([[4, 5, 6, 7], [9] * 5], [_greedy(8)] * 2)
    for p, o in zip([[4, 5, 6, 7], [9] * 5], outs):
        assert o.outputs[0].token_ids == hf_greedy(lm.model, p, 8)


def _deterministic_cases(lm, device: str = "cpu", quantization: str = "none") -> dict:
    """A greedy prompt's tokens and log-probabilities (a 100-token prefix and 12 more, 16 new) alone,
    with 31 other requests, after its prefix was cached, and with another max_batch_tokens."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, 250) for _ in range(100)]
    prompt = prefix + [rng.randrange(3, 250) for _ in range(12)]
    others = [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 60))] for _ in range(31)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)

    def engine(tokens: int = 128) -> Engine:
        return _engine(lm, device, quantization, max_batch_size=32, max_batch_tokens=tokens,
                       kv_cache_memory=16 << 20, deterministic=True)

    def answer(eng: Engine, prompts: list[list[int]]):
        out = eng.generate(prompts, [params] * len(prompts))[0].outputs[0]
        return out.token_ids, out.logprobs

    cached = engine()
    answer(cached, [prefix + [5, 6, 7]])
    return {"alone": answer(engine(), [prompt]), "with 31 others": answer(engine(), [prompt, *others]),
            "after its prefix was cached": answer(cached, [prompt]), "max_batch_tokens 32": answer(engine(32), [prompt])}


@pytest.mark.parametrize("arch,dtype,quantization", [("llama", "bfloat16", "none"), ("llama", "float32", "int4"),
                                                     ("gemma3", "bfloat16", "none")])
def test_deterministic_gives_an_answer_the_same_bits_whatever_runs_beside_it(arch, dtype, quantization):
    """`deterministic` on the device's lean forward (workers.engine.cuda.ops.batch_invariant: here the reference
    ops a row at a time; the Triton kernels' invariance is tests/test_triton_kernels.py's), tokens
    sampled by the host row by row: the same tokens and log-probabilities bit for bit."""
    lm = tiny(arch, dtype=dtype)
    cases = _deterministic_cases(lm, quantization=quantization)
    alone = cases.pop("alone")
    assert len(alone[0]) == 16 and None not in alone[1]
    for name, got in cases.items():
        assert got == alone, name
    eng = _engine(lm, quantization=quantization, deterministic=True)
    ops = eng.runner.ops
    assert ops.invariant and ops.name == "reference-invariant" and not eng.runner.overlap
    # every linear, norm and attention call of the device lean forward goes through those ops
    lean = eng.runner.device_lean
    assert lean.ops is ops and all(lin.dense is ops.linear if lin.quant is None else lin.qlinear is ops.qlinear
                                   for lin in lean.linears())


def test_settings_the_device_lean_forward_would_serve_are_refused_without_it():
    """CUDA's rules, before any runner is made: GPT-2 has no lean forward, so `deterministic` (and a
    quantization format) is refused; Gemma 3's layers of two windows take it, in bfloat16 too."""
    lm = tiny("gpt2", dtype="float32")
    with pytest.raises(ValueError, match="deterministic: true runs on cuda through the lean forward"):
        for_model(lm, True, deterministic=True, cls=CudaPlatform)
    with pytest.raises(ValueError, match="quantization 'int8' runs on the lean forward"):
        for_model(lm, True, "int8", cls=CudaPlatform)
    assert not for_model(lm, True, cls=CudaPlatform).lean
    gemma = tiny("gemma3", dtype="bfloat16")
    platform = for_model(gemma, True, "int8", deterministic=True, cls=CudaPlatform)
    assert platform.lean and platform.precision.quantization == "int8" and platform.deterministic


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deterministic_on_cuda_gives_the_same_bits_whatever_runs_beside_it():
    """On a GPU: the Triton batch-invariant kernels inside the decode graphs, bfloat16 and int4."""
    from workers.models import load_model

    for dtype, quantization in (("bfloat16", "none"), ("bfloat16", "int4")):
        lm = load_model("tiny:llama", dtype=dtype, device="cuda")
        cases = _deterministic_cases(lm, "cuda", quantization)
        alone = cases.pop("alone")
        for name, got in cases.items():
            assert got == alone, (dtype, quantization, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quantized_decode_graphs_on_cuda_give_transformers_greedy_on_their_values():
    """On a GPU: the Triton weight-only linears inside the captured decode graphs."""
    from workers.models import load_model

    lm = load_model("tiny:llama", dtype="float32", device="cuda")
    for kind in (INT8, INT4):
        eng = _engine(lm, device="cuda", quantization=kind)
        assert eng.runner.ops.name == "triton" and _captured(eng) == set(eng.runner.buckets)
        ref = dequantized_reference(lm.model, kind)
        for p in ([3, 9, 1], [17] * 5):
            got = eng.generate([p], _greedy(10))[0].outputs[0].token_ids
            assert got == hf_greedy(ref, p, 10), kind


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decode_graphs_on_cuda_equal_eager_and_transformers(arch):
    """On a GPU: every decode bucket and every token bucket of the steps with prompt chunks
    captured, the replayed steps' greedy tokens (decode steps started ahead of the last one's
    tokens) equal the same runner's eager steps and transformers' generate (Gemma 3's prompt of
    60 tokens crosses its sliding layers' window)."""
    from workers.models import load_model

    lm = load_model(f"tiny:{arch}", dtype="float32", device="cuda")
    eng = _engine(lm, device="cuda")
    assert _captured(eng) == set(eng.runner.buckets)
    assert set(eng.runner.step_graphs) == set(eng.runner.token_buckets) == {16, 32, 64}
    rng = random.Random(8)
    prompts = [[rng.randrange(1, 250) for _ in range(n)] for n in (3, 9, 1, 17, 5, 60)]
    outs = eng.generate(prompts, [_greedy(10)] * len(prompts))
    eager = _engine(lm, device="cuda")
    eager.runner.graphs.clear()
    eager.runner.step_graphs.clear()
    again = eager.generate(prompts, [_greedy(10)] * len(prompts))
    for p, o, a in zip(prompts, outs, again):
        assert o.outputs[0].token_ids == a.outputs[0].token_ids == hf_greedy(lm.model, p, 10)
    assert eng.runner.overlap and eng.steps_ahead > 0  # the host overlapped the device


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_runs_the_device_lean_forward_with_transformers_greedy(dtype):
    """Gemma 3 on the device's lean forward (workers.engine.cuda.lean.DeviceGemma3, in the weights'
    dtype): its norms, q/k norms, sandwich norms, GELU, a rotary table a layer type and each layer's
    window, every layer in one cache group. Prompts and answers cross the sliding layers' window
    (32 positions here), and the greedy tokens equal transformers'."""
    lm = tiny("gemma3", dtype=dtype)
    eng = _engine(lm, max_batch_size=4, max_batch_tokens=32, kv_cache_memory=8 << 20)
    runner = eng.runner
    assert type(runner.device_lean).__name__ == "DeviceGemma3"
    assert eng.scheduler.blocks.groups.windows == (None,)  # one group: each layer attends its window in it
    assert [layer.window for layer in runner.device_lean.layers] == [32, 32, 32, 0]
    rng = random.Random(8)
    prompts = [[rng.randrange(1, 250) for _ in range(n)] for n in (5, 29, 45)]
    max_tokens = [30, 12, 6]
    outs = eng.generate(prompts, [_greedy(m) for m in max_tokens])
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.outputs[0].token_ids == hf_greedy(lm.model, p, m), (len(p), m)
