"""A near-context prompt beside short streams, through `run_mm.py serve`, printing JSON lines.

Two copies of a model (SmolLM2-135M by default) with `max_batch_size: 64` and every other setting
at its default serve 32 short greedy streams (16 per copy) through the ZeroMQ AsyncClient, each a
request of 32 + 512 tokens after another, their phases spread so that their lengths (and the cost
of decoding them) stay the same over time. After a baseline window, one near-context prompt goes
to each copy. The lines give:
  - the short streams' tokens/s alone and while the long prompts are served, and their ratio;
  - the workers lost or restarted (from the router's status) and the long requests' outcome;
  - the deployment's summed PSS (router, workers) before the long prompts and at its peak while
    they run, against what the plan (`validate_only`) counts for the device.

    python bench/long_prompt.py [--model smollm2-135m] [--dtype auto] [--long-tokens 7900] [--baseline-s 20]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not bench/ (see bench/http.py)
ROOT = Path(__file__).resolve().parents[1]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import psutil  # noqa: E402

from bench.machine import describe  # noqa: E402
from bench.router import emit, free_port  # noqa: E402
from routing.entrypoints import CLI, command  # noqa: E402

SHORT_STREAMS = 32
STREAM_TOKENS = 512  # new tokens of a short stream's request


def pss_tree(pid: int) -> int:
    total = 0
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except psutil.Error:  # gone meanwhile
            pass
    return total


class PeakPss(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, pss_tree(self.pid))
            self.stop.wait(0.25)


async def scenario(front: str, vocab: int, args, serve_pid: int) -> dict:
    from routing.client import AsyncClient

    rng = random.Random(0)
    counts = [0] * SHORT_STREAMS
    state = {"stop": False}

    async def short(c, i: int) -> None:
        # Each stream runs request after request of 32 + 512 tokens. The first one starts part-way
        # through such a request (a longer prompt, fewer new tokens), at a phase of its own, so the
        # streams' lengths are spread evenly from the start: the decode cost is the same in the
        # baseline window as while the long prompts run, instead of growing from one to the other.
        offset = (i // 2) * STREAM_TOKENS // (SHORT_STREAMS // 2)
        prompt = [rng.randrange(vocab) for _ in range(32 + offset)]
        max_tokens = STREAM_TOKENS - offset
        while not state["stop"]:  # one stream after another, as long as the scenario runs
            async for out in c.stream(i % 2, prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                counts[i] += len(out["token_ids"]) if isinstance(out.get("token_ids"), list) else 1
                if state["stop"]:
                    return
            prompt, max_tokens = prompt[:32], STREAM_TOKENS

    async with AsyncClient(front, timeout=1800) as c:
        tasks = [asyncio.create_task(short(c, i)) for i in range(SHORT_STREAMS)]
        while sum(x > 0 for x in counts) < SHORT_STREAMS:  # every stream's prompt computed, decoding
            await asyncio.sleep(0.5)
        await asyncio.sleep(2)
        before, t = sum(counts), time.perf_counter()
        await asyncio.sleep(args.baseline_s)
        baseline = (sum(counts) - before) / (time.perf_counter() - t)
        pss_before = pss_tree(serve_pid)
        meter = PeakPss(serve_pid)
        meter.start()
        long_prompt = [[rng.randrange(vocab) for _ in range(args.long_tokens)] for _ in range(2)]
        before, t = sum(counts), time.perf_counter()
        longs = await asyncio.gather(*[c.complete(mid, p, max_tokens=16, temperature=0.0, ignore_eos=True)
                                       for mid, p in enumerate(long_prompt)], return_exceptions=True)
        during_s = time.perf_counter() - t
        during = (sum(counts) - before) / during_s
        meter.stop.set()
        meter.join()
        state["stop"] = True
        status = await c.status()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    workers = status["workers"]
    return {"short_tokens_per_s_alone": round(baseline, 1), "short_tokens_per_s_beside_long": round(during, 1),
            "ratio": round(during / baseline, 3), "long_served_s": round(during_s, 2),
            "long_results": [r["usage"]["completion_tokens"] if isinstance(r, dict) else f"{type(r).__name__}: {r}"
                             for r in longs],
            "workers_alive": sum(w["alive"] for w in workers), "workers_lost": sum(bool(w["lost"]) for w in workers),
            "preemptions": sum((w.get("engine") or {}).get("preemptions", 0) for w in workers),
            "kv_cache_bytes": [(w.get("engine") or {}).get("kv_cache_bytes") for w in workers if w["alive"]],
            "pss_before_bytes": pss_before, "pss_peak_bytes": meter.peak,
            "pss_growth_bytes": meter.peak - pss_before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--long-tokens", type=int, default=7900)
    ap.add_argument("--baseline-s", type=float, default=20.0)
    args = ap.parse_args()
    emit(**describe("long_prompt", sys.argv))
    from fusion.deploy import build_fusion
    from fusion.params import load_params
    from fusion.plan import make_plan
    from workers.models import load_model

    lm = load_model(args.model, dtype=args.dtype)
    dtype = str(lm.dtype).removeprefix("torch.")
    vocab = lm.vocab_size
    del lm
    params = {"variants": {"m": {"model": {"source": args.model, "dtype": dtype, "max_batch_size": 64}}},
              "runconfig": {}}
    cfg = ROOT / "bench" / "_long_prompt.yaml"
    cfg.write_text(json.dumps(params))
    plan = make_plan(build_fusion(load_params(cfg), ["m,2"]), None, "cpu")
    front = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([*command(CLI), "--mode", "serve", "--params", str(cfg), "--variants", "m,2",
                             "--frontend", front, "--backend", f"tcp://127.0.0.1:{free_port()}", "--devices", "cpu"],
                            cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        from routing.client import Client

        with Client(front, timeout=600) as c:
            deadline = time.monotonic() + 900
            while sum(w["alive"] and w["loaded"] for w in c.status()["workers"]) < 2:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the deployment did not load")
                time.sleep(0.5)
        out = asyncio.run(scenario(front, vocab, args, proc.pid))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        cfg.unlink(missing_ok=True)
    planned = plan.devices["cpu"]["estimated_bytes"]
    emit(system="long_prompt_serve", model=args.model, dtype=dtype, copies=2, max_batch_size=64,
         short_streams=SHORT_STREAMS, long_prompt_tokens=args.long_tokens, **out, planned_bytes=planned,
         peak_within_plan=out["pss_peak_bytes"] <= planned)


if __name__ == "__main__":
    main()
