"""Router benchmarks, printing JSON lines.

(a) echo: requests/s and the latency the router adds (p50/p99), with a worker that echoes
    instead of running a model, at 1, 8 and 64 concurrent clients. Added latency = round trip
    through client -> router -> worker -> router -> client, minus the same round trip to an
    echo server connected directly (no router in between).
(b) e2e: tokens/s on the bench/engine.py workload through `run_mm.py --mode serve` with one
    worker, against the engine in-process, in the same run; then one stream alone (64-token
    prompt, 128 new tokens) through serve against in-process: ms/token and their ratio. Both
    sides run eagerly (compile: false).

    python bench/router.py [--seconds 5] [--skip-e2e] [--n 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

# run as a script, bench/ is first on sys.path, where bench/http.py would shadow the standard
# library's http package (which torch, httpx and uvicorn import): the repository root goes there
sys.path[0] = str(Path(__file__).resolve().parents[1])
ROOT = Path(__file__).resolve().parents[1]

import zmq  # noqa: E402

from bench.machine import describe  # noqa: E402
from routing.entrypoints import CLI, ROUTER, WORKER, command  # noqa: E402
from wire import protocol as P  # noqa: E402


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def direct_echo_server(addr: str) -> None:
    """The same echo work with no router in between: the baseline round trip (own process)."""
    from workers.worker import echo_response

    s = zmq.Context().socket(zmq.ROUTER)
    s.bind(addr)
    while True:
        ident, frame = s.recv_multipart()
        msg = P.unpack(frame, P.CLIENT_TYPES)
        s.send_multipart([ident, P.pack(echo_response(msg))])


def load(addr: str, clients: int, seconds: float, body: dict | None = None,
         rate: float | None = None) -> tuple[int, list[float], float]:
    """`clients` connections, each with one request in flight (closed loop), driven by one thread.
    body: {"model", "prompt", **params} (default: the echo worker's request); an error answer raises.
    rate: offered requests/s in all; each client then waits a random (exponential) gap between the
    answer to one request and the next instead of sending at once (latency at a set load)."""
    body = body or {"model": "echo", "prompt": [1, 2, 3]}
    params = {k: v for k, v in body.items() if k not in ("model", "prompt")}
    ctx = zmq.Context.instance()
    socks = []
    for _ in range(clients):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(addr)
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    sent = {}
    counter = 0
    lat: list[float] = []

    def fire(s):
        nonlocal counter
        counter += 1
        sent[s] = time.perf_counter()
        s.send(P.pack({"type": P.COMPLETE, "id": str(counter), "model": body["model"], "prompt": body["prompt"],
                       "params": params}))

    rng = random.Random(0)
    due: dict = {}  # socket -> when its next request goes (paced)

    def next_at(now: float) -> float:
        return now + rng.expovariate(rate / clients)

    def answer(s) -> float:
        msg = P.unpack(s.recv(), {P.RESULT, P.ERROR})
        if msg["type"] != P.RESULT:
            raise RuntimeError(f"request failed: {msg}")
        now = time.perf_counter()
        lat.append(now - sent.pop(s))
        return now

    start = time.perf_counter()
    stop_at = start + seconds
    if not rate:  # closed loop: each client's next request goes as its answer comes
        for s in socks:
            fire(s)
        while sent:
            for s, _ in poller.poll(5000):
                if answer(s) < stop_at:
                    fire(s)
    else:
        for s in socks:
            due[s] = next_at(start)
        while sent or due:
            now = time.perf_counter()
            for s in [s for s, t in due.items() if t <= now]:
                del due[s]
                fire(s)
            wait = max(0.0, min(due.values()) - now) if due else 5.0
            for s, _ in poller.poll(wait * 1000):
                now = answer(s)
                if now < stop_at:
                    due[s] = next_at(now)
    wall = time.perf_counter() - start
    for s in socks:
        s.close()
    return len(lat), lat, wall


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_echo(seconds: float) -> None:
    import multiprocessing as mp

    front, back, direct = (f"tcp://127.0.0.1:{free_port()}" for _ in range(3))
    router = subprocess.Popen([*command(ROUTER), "--frontend", front, "--backend", back,
                               "--models", "echo"], cwd=ROOT, stdout=subprocess.DEVNULL)
    worker = subprocess.Popen([*command(WORKER), "--echo", "--backend", back,
                               "--parent-pid", str(os.getpid())], cwd=ROOT)
    server = mp.get_context("spawn").Process(target=direct_echo_server, args=(direct,), daemon=True)
    server.start()
    try:
        from routing.client import Client

        with Client(front, timeout=30) as c:
            while not any(w["loaded"] for w in c.status()["workers"]):
                time.sleep(0.05)
        for n in (1, 8, 64):
            load(front, n, 0.5)  # warm-up
            count, lat, wall = load(front, n, seconds)
            _, base, _ = load(direct, n, min(seconds, 2.0))
            emit(bench="router_echo", clients=n, requests=count, requests_per_s=round(count / wall, 1),
                 latency_p50_ms=round(pct(lat, 0.5) * 1e3, 3), latency_p99_ms=round(pct(lat, 0.99) * 1e3, 3),
                 direct_p50_ms=round(pct(base, 0.5) * 1e3, 3),
                 added_latency_p50_ms=round((pct(lat, 0.5) - pct(base, 0.5)) * 1e3, 3),
                 added_latency_p99_ms=round((pct(lat, 0.99) - pct(base, 0.99)) * 1e3, 3))
    finally:
        router.terminate()
        router.wait(timeout=10)
        worker.wait(timeout=10)
        server.terminate()


def bench_e2e(n: int, model: str, dtype: str, repeats: int = 2) -> None:
    import asyncio

    from bench.engine import single_prompt, workload
    from routing.client import AsyncClient
    from workers.engine import Engine, EngineConfig
    from workers.engine.params import SamplingParams
    from workers.models import load_model

    lm = load_model(model, dtype=dtype)
    prompts, max_tokens = workload(n, lm.vocab_size)
    # eager on both sides (compile: auto would load compiled artifacts a bench left in the cache)
    eng = Engine(lm, EngineConfig(max_batch_size=64, max_batch_tokens=512, num_threads=2, compile="false"))
    eng.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))
    t = time.perf_counter()
    eng.generate(prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens])
    inproc = time.perf_counter() - t
    # one stream alone: a 64-token prompt, 128 new tokens, best of `repeats`
    single, new = single_prompt(lm.vocab_size), 128
    one = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    inproc_single = []
    for _ in range(repeats):
        t = time.perf_counter()
        eng.generate([single], one)
        inproc_single.append(time.perf_counter() - t)
    del eng, lm
    useful = sum(max_tokens)
    cfg = ROOT / "bench" / "_e2e.yaml"
    cfg.write_text(json.dumps({"variants": {"m": {"model": {"source": model, "dtype": dtype, "max_batch_size": 64,
                                                             "max_batch_tokens": 512, "compile": "false"}}},
                               "runconfig": {"threads_per_worker": 2}}))
    port = 30000 + os.getpid() % 20000
    front = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen([*command(CLI), "--mode", "serve", "--params", str(cfg), "--variants",
                             "m,1", "--frontend", front, "--backend", f"tcp://127.0.0.1:{port + 1}",
                             "--devices", "cpu"], cwd=ROOT, stdout=subprocess.DEVNULL)

    async def go():
        async with AsyncClient(front, timeout=600) as c:
            while True:
                st = await c.status()
                if st["workers"] and st["workers"][0]["loaded"]:
                    break
                await asyncio.sleep(0.5)
            await c.complete("m", prompts[0][:16], max_tokens=2, temperature=0.0)
            t = time.perf_counter()
            res = await asyncio.gather(*[c.complete("m", p, max_tokens=m, temperature=0.0, ignore_eos=True)
                                         for p, m in zip(prompts, max_tokens)])
            wall = time.perf_counter() - t
            served_single = []
            for _ in range(repeats):
                t = time.perf_counter()
                r = await c.complete("m", single, max_tokens=new, temperature=0.0, ignore_eos=True)
                served_single.append(time.perf_counter() - t)
                assert r["usage"]["completion_tokens"] == new
            return wall, sum(r["usage"]["completion_tokens"] for r in res), served_single

    try:
        wall, got, served_single = asyncio.run(go())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        cfg.unlink(missing_ok=True)
    assert got == useful, f"served {got} tokens, wanted {useful}"
    emit(bench="router_e2e", model=model, dtype=dtype, requests=n, tokens=useful,
         served_tokens_per_s=round(useful / wall, 2), inprocess_tokens_per_s=round(useful / inproc, 2),
         ratio=round(inproc / wall, 3))
    a, b = min(inproc_single) / new * 1e3, min(served_single) / new * 1e3
    emit(bench="serve_single_stream", model=model, dtype=dtype, prompt_tokens=len(single), new_tokens=new,
         inprocess_ms_per_token=round(a, 2), served_ms_per_token=round(b, 2), served_vs_inprocess=round(b / a, 3),
         repeats=repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    print(json.dumps(describe("router", sys.argv)), flush=True)
    bench_echo(args.seconds)
    if not args.skip_e2e:
        bench_e2e(args.n, args.model, args.dtype)


if __name__ == "__main__":
    main()
