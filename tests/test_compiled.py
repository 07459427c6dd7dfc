"""The compiled engine: bucketed graphs, exact against transformers, cached on disk by compile_only."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from support.models import engine_with_pool, hf_greedy, tiny

from workers.buckets import Buckets, compile_mode, default_buckets
from workers.engine import Engine, EngineConfig, compile_cache
from workers.engine.compiled import graphs_compiled
from workers.engine.params import SamplingParams
from workers.models import load_engine

PACKED = ["gpt2", "llama", "mistral", "opt", "gemma3"]  # the tiny architectures on the packed slot path
BUCKETS = (8, 48)  # small for CI: every step pads to one of two graphs
# the other architectures compile one graph: every step pads to it (a compile costs seconds each)
ONE_BUCKET = (48,)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A $MMFUSION_CACHE of the module's own: its compiled artifacts start cold. Inductor's kernels
    stay in the session's test cache (TORCHINDUCTOR_CACHE_DIR), shared by every compile of the same
    graph in the suite: the tiny Llama graphs here (buckets 8 and 48, 5 slots) are compile_only's too."""
    d = tmp_path_factory.mktemp("mmfusion-cache")
    old = os.environ["MMFUSION_CACHE"]
    os.environ["MMFUSION_CACHE"] = str(d)
    yield d
    os.environ["MMFUSION_CACHE"] = old


def _greedy(m: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, **kw)


def _mixed(seed) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 9, 40, 100] + [rng.randint(1, 120) for _ in range(3)]
    prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]
    return prompts, [rng.randint(1, 20) for _ in prompts]


def test_buckets_pad_up_and_reject_bad_sets():
    b = Buckets((1, 8, 48))
    assert [b.pad(n) for n in (1, 2, 8, 9, 48, 49)] == [1, 8, 8, 48, 48, None]
    assert default_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_buckets(300) == (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 300)
    for bad in [(), (0, 8), (8, 4), (4, 4), (2.5,)]:
        with pytest.raises(ValueError, match="compile buckets"):
            Buckets(bad)
    with pytest.raises(ValueError, match="compile must be one of auto, true, false"):
        EngineConfig(compile="sometimes")
    assert compile_mode(True) == "true" and compile_mode(False) == "false"


@pytest.fixture
def copy_threads():
    """The torch threads each of compile_only's two copies gets here (test_batch_modes): inductor
    generates its C++ kernels for a thread count and keys its cache by it, so the tiny Llama's
    graphs are compiled once in the suite only at the same count."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("arch", PACKED)
def test_compiled_greedy_matches_transformers_in_mixed_batches(arch, cache_dir, copy_threads):
    """fp32, compiled: token for token equal to transformers generate, while prefill chunks and
    decodes share steps (in one graph, or one of two for Llama); chosen-token logprobs within 1e-4
    of the eager engine; and serving the whole workload builds no graph beyond the warm-up's one
    per bucket."""
    lm = tiny(arch, dtype="float32")
    prompts, max_tokens = _mixed(arch)
    cfg = dict(max_batch_size=5, max_batch_tokens=48, prepack_weights=False)  # compile applies to transformers' modules
    buckets = BUCKETS if arch == "llama" else ONE_BUCKET  # several buckets: one architecture shows it
    before = graphs_compiled()
    eng = Engine(lm, EngineConfig(**cfg, compile="true", compile_buckets=buckets))
    assert eng.compile_info.compiled and eng.compile_info.buckets == buckets
    # inductor's precompiled headers are in its cache directory, not in /tmp (compile_cache.keep_headers_in)
    assert list(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).glob("precompiled_headers/*.gch"))
    built = graphs_compiled() - before
    # one graph per bucket, times the distinct attention variants (gemma3: sliding and full layers),
    # unless an earlier test of this process built the same layer graphs already
    assert built <= len(buckets) * (2 if arch == "gemma3" else 1)
    after_warmup = graphs_compiled()
    params = [_greedy(m, logprobs=2) for m in max_tokens]
    outs = eng.generate(prompts, params)
    assert graphs_compiled() == after_warmup, "a step recompiled: its shapes left the bucket set"
    for p, m, o in zip(prompts, max_tokens, outs):
        assert o.outputs[0].token_ids == hf_greedy(lm.model, p, m), f"prompt of {len(p)} tokens"
    eager = Engine(lm, EngineConfig(**cfg, compile="false")).generate(prompts, params)
    assert graphs_compiled() == after_warmup, "the eager engine on the same weights ran compiled layers"
    for o, e in zip(outs, eager):
        assert o.outputs[0].token_ids == e.outputs[0].token_ids
        diff = max(abs(a - b) for a, b in zip(o.outputs[0].logprobs, e.outputs[0].logprobs))
        assert diff < 1e-4, diff


def test_steps_past_the_largest_bucket_run_eagerly(cache_dir):
    lm = tiny("llama", dtype="float32")
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, compile="true", compile_buckets=(8,),
                                  prepack_weights=False))
    after_warmup = graphs_compiled()
    prompt = list(range(5, 60))  # one 55-token prefill step: past the bucket of 8
    out = eng.generate([prompt], _greedy(6))[0]
    assert out.outputs[0].token_ids == hf_greedy(lm.model, prompt, 6)
    assert graphs_compiled() == after_warmup


def test_a_pool_of_another_size_reuses_the_graphs(cache_dir):
    """The number of KV blocks is dynamic in the graphs: workers with other budgets compile nothing new."""
    lm = tiny("llama", dtype="float32")
    cfg = {"max_batch_size": 4, "max_batch_tokens": 48, "compile": "true", "compile_buckets": (8, 48),
           "prepack_weights": False}
    engine_with_pool(lm, 40, 16, **cfg)
    built = graphs_compiled()
    second = engine_with_pool(lm, 60, 16, **cfg)
    out = second.generate([list(range(5, 30))], _greedy(6))[0]
    assert graphs_compiled() == built
    assert out.outputs[0].token_ids == hf_greedy(lm.model, list(range(5, 30)), 6)


def test_the_lean_forward_is_preferred_to_a_compiled_one(cache_dir):
    """Where the lean forward applies, neither auto nor true trades it for transformers' modules
    compiled (eager lean runs about twice as fast): nothing is compiled and it answers as eager."""
    lm = tiny("llama", dtype="float32")
    before = graphs_compiled()
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=48, compile="true", compile_buckets=(8,)))
    assert eng.runner.lean is not None and eng.runner.compiled is None
    assert not eng.compile_info.compiled and "lean forward" in eng.compile_info.reason
    prompt = list(range(5, 30))
    assert eng.generate([prompt], _greedy(6))[0].outputs[0].token_ids == hf_greedy(lm.model, prompt, 6)
    assert graphs_compiled() == before


def test_bloom_has_no_packed_path_and_stays_eager(cache_dir):
    eng = Engine(tiny("bloom", dtype="float32"), EngineConfig(compile="true", compile_buckets=(8,)))
    assert not eng.compile_info.compiled and "packed" in eng.compile_info.reason


def test_artifacts_make_auto_start_compiled_and_bad_ones_compile_again(tmp_path, cache_dir, monkeypatch, caplog):
    """compile: true saves the artifacts; a later engine with auto starts from them; a corrupt or
    stale entry gets one log line, a compile from scratch and a rewritten entry, never a crash. (A
    fresh process starting from them: test_batch_modes' compile_only, whose predict workers do.)"""
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path))  # nothing cached here: auto stays eager
    cfg = {"dtype": "float32", "max_batch_size": 5, "max_batch_tokens": 48, "compile_buckets": (8, 48),
           "prepack_weights": False}
    prompt, sp = [[5, 6, 7, 8, 9, 10, 11]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    eng = load_engine("tiny:llama", **cfg, compile="auto")
    assert not eng.compile_info.compiled and "no compiled artifacts" in eng.compile_info.reason
    cold = eng.generate(prompt, sp)[0].outputs[0].token_ids
    made = load_engine("tiny:llama", **cfg, compile="true")
    assert made.compile_info.compiled and not made.compile_info.warm
    entry = Path(made.compile_info.as_dict()["cache"])
    assert (entry / compile_cache.ARTIFACTS).stat().st_size > 0
    assert made.generate(prompt, sp)[0].outputs[0].token_ids == cold

    warm = load_engine("tiny:llama", **cfg, compile="auto")
    assert warm.compile_info.compiled and warm.compile_info.warm, warm.compile_info
    assert warm.generate(prompt, sp)[0].outputs[0].token_ids == cold

    # a bad entry is refused before torch reads it, so this process may check the rest itself
    def bad_entry_compiles_again(what: str) -> None:
        caplog.clear()
        eng = load_engine("tiny:llama", **cfg, compile="auto")
        assert eng.compile_info.compiled and not eng.compile_info.warm
        assert [r for r in caplog.records if "unusable" in r.getMessage() and what in r.getMessage()], caplog.text
        assert eng.generate(prompt, sp)[0].outputs[0].token_ids == cold

    caplog.set_level("WARNING", logger="mmfusion.compile")
    (entry / compile_cache.ARTIFACTS).write_bytes(b"not an artifact")
    bad_entry_compiles_again("checksum")
    meta = json.loads((entry / compile_cache.META).read_text())  # rewritten, valid again
    assert meta["bytes"] == (entry / compile_cache.ARTIFACTS).stat().st_size

    meta["key"]["torch_version"] = "0.0.1"
    (entry / compile_cache.META).write_text(json.dumps(meta))
    bad_entry_compiles_again("stale")
    assert json.loads((entry / compile_cache.META).read_text())["key"]["torch_version"] == torch.__version__


def test_cuda_graph_seam_is_inert_on_cpu_and_asks_for_graphs_on_cuda():
    from workers.engine.compiled import GraphReplay
    from workers.platform import CpuPlatform, CudaPlatform

    cpu = GraphReplay(CpuPlatform.cuda_graphs)
    assert not cpu.enabled and cpu.compile_options() == {}
    cpu.step_begin()  # nothing to mark on CPU
    with torch._inductor.config.patch(graph_partition=False):
        cuda = GraphReplay(CudaPlatform.cuda_graphs)
        assert cuda.enabled and cuda.compile_options() == {"mode": "reduce-overhead"}
        # the partition around the attention op is what lets the rest of a layer replay
        assert torch._inductor.config.graph_partition
    assert torch._C.Tag.cudagraph_unsafe in torch.ops.mmfusion.attend.default.tags


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cuda_compiled_with_graphs_matches_eager(arch, cache_dir):
    from workers.models import load_model

    lm = load_model(f"tiny:{arch}", dtype="float32", device="cuda")
    prompts, max_tokens = _mixed(arch)
    # transformers' modules (the llama family's lean forward captures its decode steps itself:
    # tests/test_cuda_runner.py)
    cfg = dict(max_batch_size=5, max_batch_tokens=48, prepack_weights=False)
    eng = Engine(lm, EngineConfig(**cfg, compile="true", compile_buckets=BUCKETS))
    assert eng.compile_info.compiled and eng.runner.compiled.graphs.enabled
    outs = eng.generate(prompts, [_greedy(m) for m in max_tokens])
    again = eng.generate(prompts, [_greedy(m) for m in max_tokens])  # replays, not captures
    eager = Engine(lm, EngineConfig(**cfg, compile="false")).generate(prompts, [_greedy(m) for m in max_tokens])
    for o, a, e in zip(outs, again, eager):
        assert o.outputs[0].token_ids == a.outputs[0].token_ids == e.outputs[0].token_ids


def test_engines_sharing_weights_share_graphs_and_take_turns(cache_dir):
    """A second compiled engine on the same weights builds nothing new, and engines on one model
    can step in turns (each step brings its own cache to the shared attention holder)."""
    lm = tiny("llama", dtype="float32")
    cfg = dict(max_batch_size=3, max_batch_tokens=48, compile_buckets=BUCKETS, prepack_weights=False)
    a = Engine(lm, EngineConfig(**cfg, compile="true"))
    built = graphs_compiled()
    b = Engine(lm, EngineConfig(**cfg, compile="true"))
    c = Engine(lm, EngineConfig(**{**cfg, "prepack_weights": True}, compile="false"))  # the lean forward
    assert graphs_compiled() == built
    prompts = {e: [[3 + i, 9, 27 + i, 81] for i in range(2)] for e in (a, b, c)}
    for e in (a, b, c):
        for i, p in enumerate(prompts[e]):
            e.add_request(f"r{i}", p, _greedy(8))
    done: dict = {a: {}, b: {}, c: {}}
    while any(e.has_unfinished() for e in (a, b, c)):
        for e in (a, b, c):  # interleaved steps of three engines on one model
            for out in e.step():
                if out.finished:
                    done[e][out.request_id] = out.outputs[0].token_ids
    assert graphs_compiled() == built
    for e in (a, b, c):
        for i, p in enumerate(prompts[e]):
            assert done[e][f"r{i}"] == hf_greedy(lm.model, p, 8)
