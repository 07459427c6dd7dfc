"""Engine throughput against transformers on one workload, all measured in this run.

Prints one JSON line per system (useful tokens/s), a forward-only line (the engine's own
schedule of model calls replayed alone) and a summary line with the ratios.

    python bench/engine.py [--model smollm2-135m] [--dtype bfloat16] [--n 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

# run as a script, bench/ is first on sys.path, where bench/http.py would shadow the standard
# library's http package (which torch, httpx and uvicorn import): the repository root goes there
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from workers.attention import hf_attention  # noqa: E402
from workers.engine import Engine, EngineConfig  # noqa: E402
from workers.models import load_model  # noqa: E402
from workers.params import SamplingParams  # noqa: E402


def workload(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 256))] for _ in range(n)]
    max_tokens = [rng.randint(16, 128) for _ in range(n)]
    return prompts, max_tokens


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def run_engine(lm, prompts, max_tokens, args):
    eng = Engine(lm, EngineConfig(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens))
    eng.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    eng.runner.trace = []
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    t = time.perf_counter()
    steps0, fwd0 = eng.steps, eng.runner.forward_seconds
    outs = eng.generate(prompts, params)
    wall = time.perf_counter() - t
    fwd_in_run = eng.runner.forward_seconds - fwd0
    useful = sum(len(o.outputs[0].token_ids) for o in outs)
    assert useful == sum(max_tokens), "engine stopped early"
    trace, eng.runner.trace = eng.runner.trace, None
    t = time.perf_counter()
    eng.runner.replay(trace)
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


def run_hf_static(model, prompts, max_tokens, batch):
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
            out = model.generate(ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m, do_sample=False,
                                 pad_token_id=0)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--n", type=int, default=64, help="number of requests")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2,
                    help="best of N for the engine, its replay and the static batches (the slow peers run once)")
    ap.add_argument("--systems", default="engine,hf_static32,hf_cb,hf_single",
                    help="comma-separated subset to run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype)
    prompts, max_tokens = workload(args.n, lm.vocab_size)
    common = dict(model=args.model, dtype=args.dtype, threads=args.threads, requests=args.n,
                  prompt_tokens=sum(map(len, prompts)), target_tokens=sum(max_tokens))
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
    if "engine" in systems:
        runs = [run_engine(lm, prompts, max_tokens, args) for _ in range(args.repeats)]
        wall, useful, steps, _, fwd_in_run = min(runs, key=lambda r: r[0])
        fwd = min(r[3] for r in runs)
        record("engine", wall, useful, steps=steps, max_batch_size=args.max_batch_size,
               max_batch_tokens=args.max_batch_tokens,
               # time outside model calls during the run itself (scheduling, sampling, stops)
               bookkeeping_in_run=round(1 - fwd_in_run / wall, 4), repeats=args.repeats)
        if fwd is not None:
            # the same model calls replayed alone; the difference from the engine's wall is bookkeeping
            emit(system="engine_forward_only", wall_s=round(fwd, 2), tokens_per_s=round(useful / fwd, 2),
                 bookkeeping_fraction=round(1 - fwd / wall, 4), **common)
    if "engine" in rates:
        emit(summary=True, **{f"engine_vs_{k}": round(rates["engine"] / v, 2) for k, v in rates.items()
                              if k != "engine"})


if __name__ == "__main__":
    main()
