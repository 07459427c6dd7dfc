"""Soak: 64 clients for minutes while workers are SIGKILLed at random. Prints one JSON line.

`run_mm.py --mode serve` (router + supervised workers, configs/soak.yaml: tiny Llama, two model
IDs with two workers each) runs in its own process. 64 asyncio clients, each with its own
connection, send greedy or seeded requests (half of them streamed) in a closed loop and check
every answer against the engine run in-process. A killer SIGKILLs a random live worker every few
seconds (only while another one is up); the supervisor restarts it.

Counted: sent; completed (correct answer); wrong (an answer that differs: must be 0); failed (an
error answer, by code); lost (no answer within the timeout: must be 0). Also latency p50/p99 of
completed requests and the serve process's memory (router + supervisor) at start and end.

    python bench/soak.py [--duration 120] [--clients 64] [--kill-every 3 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

# run as a script, bench/ is first on sys.path, where bench/http.py would shadow the standard
# library's http package (which torch, httpx and uvicorn import): the repository root goes there
sys.path[0] = str(Path(__file__).resolve().parents[1])
ROOT = Path(__file__).resolve().parents[1]

import psutil  # noqa: E402

from bench.machine import describe  # noqa: E402
from routing.client import AsyncClient, Client, RouterError  # noqa: E402
from routing.entrypoints import CLI, command  # noqa: E402

PARAMS = ROOT / "configs" / "soak.yaml"


def cases() -> list[tuple[list[int], dict, list[int]]]:
    """(prompt, params, expected tokens): greedy and seeded sampling, computed in-process."""
    from workers.engine import Engine, EngineConfig
    from workers.models import load_model
    from workers.request_params import sampling_params

    eng = Engine(load_model("tiny:llama", dtype="float32"), EngineConfig(max_batch_size=32))
    rng = random.Random(0)
    out = []
    for i in range(32):
        prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(3, 40))]
        params = {"max_tokens": rng.randrange(4, 32), "ignore_eos": True, "temperature": 0.0 if i % 2 else 0.8}
        if i % 2 == 0:
            params["seed"] = i
        out.append((prompt, params, eng.generate([prompt], sampling_params(params)[0])[0].outputs[0].token_ids))
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def client_loop(address: str, work, stop_at: float, stats: Counter, lat: list[float], timeout: float,
                      rng: random.Random) -> None:
    async with AsyncClient(address, timeout=timeout) as c:
        while time.monotonic() < stop_at:
            prompt, params, want = rng.choice(work)
            stream = rng.random() < 0.5
            stats["sent"] += 1
            t0 = time.monotonic()
            try:
                if stream:
                    got = []
                    async for out in c.stream("llama", prompt, **params):
                        got += out["token_ids"]
                else:
                    r = await c.complete("llama", prompt, **params, return_token_ids=True)
                    got = r["choices"][0]["token_ids"]
            except RouterError as exc:
                stats[f"failed_{exc.code}"] += 1
                stats["failed"] += 1
                continue
            except TimeoutError:
                stats["lost"] += 1
                continue
            if got == want:
                stats["completed"] += 1
                lat.append(time.monotonic() - t0)
            else:
                stats["wrong"] += 1


async def killer(address: str, stop_at: float, every: tuple[float, float], stats: Counter,
                 rng: random.Random) -> None:
    async with AsyncClient(address, timeout=10) as c:
        while True:
            await asyncio.sleep(rng.uniform(*every))
            if time.monotonic() >= stop_at:
                return
            live = [w for w in (await c.status())["workers"] if w["alive"] and w["loaded"]]
            if len(live) < 2:
                continue  # let the supervisor bring one back first
            victim = rng.choice(live)
            try:
                os.kill(victim["pid"], signal.SIGKILL)
                stats["kills"] += 1
            except ProcessLookupError:
                pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--kill-every", type=float, nargs=2, default=(3.0, 8.0))
    ap.add_argument("--timeout", type=float, default=60.0, help="a request unanswered this long is lost")
    args = ap.parse_args()
    print(json.dumps(describe("soak", sys.argv)), flush=True)
    if args.duration <= 0 or args.clients < 1 or not 0 < args.kill_every[0] <= args.kill_every[1]:
        ap.error("need --duration > 0, --clients >= 1 and 0 < --kill-every MIN <= MAX")
    work = cases()
    front, back = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    serve = subprocess.Popen([*command(CLI), "--mode", "serve", "--params", str(PARAMS),
                              "--frontend", front, "--backend", back, "--max_restarts", "100000"],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with Client(front, timeout=10) as c:
            deadline = time.monotonic() + 180
            while True:
                try:
                    ws = c.status()["workers"]
                except TimeoutError:
                    ws = []
                if len(ws) == 4 and all(w["loaded"] for w in ws):
                    break
                if time.monotonic() > deadline or serve.poll() is not None:
                    raise RuntimeError("serve did not come up")
                time.sleep(0.2)
        proc = psutil.Process(serve.pid)
        rss0 = proc.memory_info().rss
        stats: Counter = Counter()
        lat: list[float] = []
        t0 = time.monotonic()
        stop_at = t0 + args.duration

        async def go():
            rng = random.Random(1)
            loops = [client_loop(front, work, stop_at, stats, lat, args.timeout, random.Random(i))
                     for i in range(args.clients)]
            await asyncio.gather(*loops, killer(front, stop_at, tuple(args.kill_every), stats, rng))

        asyncio.run(go())
        wall = time.monotonic() - t0
        rss1 = proc.memory_info().rss
        with Client(front, timeout=10) as c:
            st = c.status()
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            _, err = serve.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
            _, err = serve.communicate()
    restarts = err.count("started again")
    print(json.dumps({
        "bench": "soak", "duration_s": round(wall, 1), "clients": args.clients, "sent": stats["sent"],
        "completed": stats["completed"], "failed": stats["failed"],
        "failed_by_code": {k[len("failed_"):]: v for k, v in stats.items() if k.startswith("failed_")},
        "wrong": stats["wrong"], "lost": stats["lost"], "kills": stats["kills"], "restarts": restarts,
        "resent_by_router": st["resent"], "latency_p50_ms": round(pct(lat, 0.5) * 1000, 1),
        "latency_p99_ms": round(pct(lat, 0.99) * 1000, 1), "router_rss_start_mib": round(rss0 / 2**20, 1),
        "router_rss_end_mib": round(rss1 / 2**20, 1),
    }), flush=True)
    return 0 if stats["lost"] == 0 and stats["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
