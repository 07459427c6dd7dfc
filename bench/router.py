"""Router benchmarks, printing JSON lines.

(a) echo: requests/s and the latency the router adds (p50/p99), with a worker that echoes
    instead of running a model, at 1, 8 and 64 concurrent clients. Added latency = round trip
    through client -> router -> worker -> router -> client, minus the same round trip to an
    echo server connected directly (no router in between).
(b) e2e: tokens/s on the bench/engine.py workload through `run_mm.py --mode serve` with one
    worker, against the engine in-process, in the same run.

    python bench/router.py [--seconds 5] [--skip-e2e] [--n 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from routing import protocol as P  # noqa: E402
from routing.router import ModelEntry, Router, RouterConfig  # noqa: E402


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def client_loop(addr: str, seconds: float, lat: list, stop_at: float) -> None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(addr)
    i = 0
    while time.perf_counter() < stop_at:
        msg = P.pack({"type": P.COMPLETE, "id": str(i), "model": "echo", "prompt": [1, 2, 3], "params": {}})
        t = time.perf_counter()
        s.send(msg)
        s.recv()
        lat.append(time.perf_counter() - t)
        i += 1
    s.close()


def direct_echo_server(addr_holder: list, stop: threading.Event) -> None:
    """The same echo work with no router: the baseline round trip."""
    from workers.worker import echo_response

    s = zmq.Context.instance().socket(zmq.ROUTER)
    s.bind("tcp://127.0.0.1:*")
    addr_holder.append(s.getsockopt_string(zmq.LAST_ENDPOINT))
    while not stop.is_set():
        if s.poll(100):
            ident, frame = s.recv_multipart()
            msg = P.unpack(frame, P.CLIENT_TYPES)
            s.send_multipart([ident, P.pack(echo_response({"id": msg["id"], "prompt": msg["prompt"]}))])
    s.close()


def run_clients(addr: str, n: int, seconds: float) -> tuple[int, list[float], float]:
    lats: list[list[float]] = [[] for _ in range(n)]
    stop_at = time.perf_counter() + seconds
    threads = [threading.Thread(target=client_loop, args=(addr, seconds, lats[i], stop_at)) for i in range(n)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    flat = [x for lst in lats for x in lst]
    return len(flat), flat, wall


def bench_echo(seconds: float) -> None:
    stop = threading.Event()
    holder: list = []
    ready: list = []

    def serve():
        r = Router([ModelEntry(0, "echo", {"name": "echo", "source": "echo"})],
                   RouterConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*"))
        ready.append(r)
        r.run()

    rt = threading.Thread(target=serve, daemon=True)
    rt.start()
    while not ready:
        time.sleep(0.01)
    router = ready[0]
    worker = subprocess.Popen([sys.executable, "-m", "workers.worker", "--echo", "--backend", router.backend_addr,
                               "--parent-pid", str(os.getpid())], cwd=ROOT)
    ds = threading.Thread(target=direct_echo_server, args=(holder, stop), daemon=True)
    ds.start()
    try:
        while not any(w.loaded for w in router.workers.values()):
            time.sleep(0.05)
        while not holder:
            time.sleep(0.01)
        for n in (1, 8, 64):
            run_clients(router.frontend_addr, n, 0.5)  # warm-up
            count, lat, wall = run_clients(router.frontend_addr, n, seconds)
            _, base, _ = run_clients(holder[0], n, min(seconds, 2.0))
            emit(bench="router_echo", clients=n, requests=count, requests_per_s=round(count / wall, 1),
                 latency_p50_ms=round(pct(lat, 0.5) * 1e3, 3), latency_p99_ms=round(pct(lat, 0.99) * 1e3, 3),
                 direct_p50_ms=round(pct(base, 0.5) * 1e3, 3),
                 added_latency_p50_ms=round((pct(lat, 0.5) - pct(base, 0.5)) * 1e3, 3),
                 added_latency_p99_ms=round((pct(lat, 0.99) - pct(base, 0.99)) * 1e3, 3))
    finally:
        stop.set()
        router.stop()
        rt.join(timeout=5)
        worker.wait(timeout=10)


def bench_e2e(n: int, model: str, dtype: str) -> None:
    import asyncio

    from bench.engine import workload
    from routing.client import AsyncClient
    from workers.engine import Engine, EngineConfig
    from workers.models import load_model
    from workers.params import SamplingParams

    lm = load_model(model, dtype=dtype)
    prompts, max_tokens = workload(n, lm.vocab_size)
    eng = Engine(lm, EngineConfig(max_batch_size=64, max_batch_tokens=512, num_threads=2))
    eng.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))
    t = time.perf_counter()
    eng.generate(prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens])
    inproc = time.perf_counter() - t
    del eng, lm
    useful = sum(max_tokens)
    cfg = ROOT / "bench" / "_e2e.yaml"
    cfg.write_text(json.dumps({"variants": {"m": {"model": {"source": model, "dtype": dtype, "max_batch_size": 64,
                                                             "max_batch_tokens": 512}}},
                               "runconfig": {"threads_per_worker": 2}}))
    port = 30000 + os.getpid() % 20000
    front = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "run_mm.py", "--mode", "serve", "--params", str(cfg), "--variants",
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
            return time.perf_counter() - t, sum(r["usage"]["completion_tokens"] for r in res)

    try:
        wall, got = asyncio.run(go())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        cfg.unlink(missing_ok=True)
    assert got == useful, f"served {got} tokens, wanted {useful}"
    emit(bench="router_e2e", model=model, dtype=dtype, requests=n, tokens=useful,
         served_tokens_per_s=round(useful / wall, 2), inprocess_tokens_per_s=round(useful / inproc, 2),
         ratio=round(inproc / wall, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    bench_echo(args.seconds)
    if not args.skip_e2e:
        bench_e2e(args.n, args.model, args.dtype)


if __name__ == "__main__":
    main()
