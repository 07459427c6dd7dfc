"""Whether a greedy answer's tokens and log-probabilities depend on what else the engine does:
the same prompt (a 1,500-token prefix and 12 more tokens, 24 greedy tokens) alone on a fresh
deployment, then sent at once with 31 other requests of random lengths, after another request
cached its prefix, and on a deployment with max_batch_tokens 128 instead of 512. One JSON line per
(dtype, deterministic): for each case, whether the tokens are equal and the log-probabilities bit
for bit, and the largest log-probability difference.

`--through serve` (the default) sends the requests through `run_mm.py --mode serve` subprocesses
and the ZeroMQ client; `--through engine` runs in-process engines.

    python bench/determinism.py [--model smollm2-135m] [--dtypes bfloat16,float32]
                                [--deterministic off,on] [--quantization auto] [--threads 2]
                                [--through serve|engine]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])
ROOT = Path(__file__).resolve().parents[1]

from bench.engine import emit  # noqa: E402
from bench.machine import describe  # noqa: E402
from bench.router import free_port  # noqa: E402

NEW = 24


def prompts(vocab: int) -> tuple[list[int], list[int], list[list[int]]]:
    rng = random.Random(0)
    prefix = [rng.randrange(100, vocab) for _ in range(1500)]
    prompt = prefix + [rng.randrange(100, vocab) for _ in range(12)]
    others = [[rng.randrange(100, vocab) for _ in range(rng.randrange(16, 300))] for _ in range(31)]
    return prefix, prompt, others


def through_engine(args, dtype: str, deterministic: bool, vocab_of: dict) -> tuple[dict, str]:
    import torch

    from workers.engine import Engine, EngineConfig
    from workers.engine.params import SamplingParams
    from workers.models import load_model

    torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=dtype)
    prefix, prompt, others = prompts(lm.vocab_size)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)

    def engine(tokens: int = 512) -> Engine:
        return Engine(lm, EngineConfig(max_batch_size=32, max_batch_tokens=tokens, quantization=args.quantization,
                                       deterministic=deterministic))

    def answer(eng: Engine, batch: list) -> tuple[list[int], list[float]]:
        out = eng.generate(batch, [params] * len(batch))[0].outputs[0]
        return out.token_ids, out.logprobs

    cached = engine()
    answer(cached, [prefix + [5, 6, 7]])
    cases = {"alone": answer(engine(), [prompt]), "batched_with_31": answer(engine(), [prompt, *others]),
             "after_prefix_cached": answer(cached, [prompt]), "max_batch_tokens_128": answer(engine(128), [prompt])}
    return cases, engine().precision.describe()


def serve(args, dtype: str, deterministic: bool, max_batch_tokens: int):
    params = {"variants": {"m": {"model": {"source": args.model, "dtype": dtype, "quantization": args.quantization,
                                           "deterministic": deterministic, "max_batch_size": 32,
                                           "max_batch_tokens": max_batch_tokens}}},
              "runconfig": {"threads_per_worker": args.threads, "devices": "cpu"}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=ROOT / "bench", delete=False) as f:
        json.dump(params, f)
    front = f"tcp://127.0.0.1:{free_port()}"
    from routing.entrypoints import CLI, command

    proc = subprocess.Popen([*command(CLI), "--mode", "serve", "--params", f.name, "--variants", "m,1",
                             "--frontend", front, "--backend", f"tcp://127.0.0.1:{free_port()}"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    from routing.client import Client

    with Client(front, timeout=60) as c:
        deadline = time.monotonic() + 600
        while not any(w["loaded"] for w in c.status()["workers"]):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("serve did not start:\n" + "".join(log[-30:]))
            time.sleep(0.5)
    return proc, front, Path(f.name)


def through_serve(args, dtype: str, deterministic: bool, vocab_of: dict) -> tuple[dict, str]:
    from routing.client import Client

    def ask(front: str, p: list[int]) -> tuple[list[int], list[float]]:
        with Client(front, timeout=900) as c:
            choice = c.complete("m", p, max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0,
                                return_token_ids=True)["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    if args.model not in vocab_of:
        from workers.models import load_model

        vocab_of[args.model] = load_model(args.model, dtype="float32", share_weights=True).vocab_size
    prefix, prompt, others = prompts(vocab_of[args.model])
    cases: dict = {}
    proc, front, cfg = serve(args, dtype, deterministic, 512)
    try:
        cases["alone"] = ask(front, prompt)
        with ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(ask, front, p) for p in [prompt, *others]]
            cases["batched_with_31"] = futures[0].result()
            for f in futures:
                f.result()
        ask(front, prefix + [5, 6, 7])
        cases["after_prefix_cached"] = ask(front, prompt)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        cfg.unlink(missing_ok=True)
    proc, front, cfg = serve(args, dtype, deterministic, 128)
    try:
        cases["max_batch_tokens_128"] = ask(front, prompt)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        cfg.unlink(missing_ok=True)
    return cases, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--deterministic", default="off,on")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--through", choices=("serve", "engine"), default="serve")
    args = ap.parse_args()
    emit(**describe("determinism", sys.argv))
    run = through_serve if args.through == "serve" else through_engine
    vocab_of: dict = {}
    for dtype in args.dtypes.split(","):
        for det in args.deterministic.split(","):
            cases, precision = run(args, dtype, det == "on", vocab_of)
            tokens, lps = cases.pop("alone")
            emit(model=args.model, dtype=dtype, quantization=args.quantization, deterministic=det == "on",
                 through=args.through, **({"precision": precision} if precision else {}),
                 **{name: {"tokens_equal": t == tokens, "logprobs_bitwise": lp == lps,
                           "max_abs_logprob_diff": max(abs(a - b) for a, b in zip(lp, lps))}
                    for name, (t, lp) in cases.items()})


if __name__ == "__main__":
    main()
