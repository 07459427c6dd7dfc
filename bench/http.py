"""HTTP gateway benchmarks, printing JSON lines; every figure is measured against the ZeroMQ client
on the same deployment in the same run.

(a) short: a tiny model, `max_tokens: 1`, 64 concurrent closed-loop clients. Requests/s and
    latency p50/p99 through the HTTP gateway (64 keep-alive connections, a lean HTTP/1.1 client)
    and through the ZeroMQ client (64 DEALER connections); added latency = HTTP minus ZeroMQ.
    Closed loops at saturation differ in
    latency by their throughput (64 clients / req/s), so a third line paces the same 64 clients at
    one offered load (--rate, default 1,000 req/s) through both: the latency the gateway adds there.
    Each line also gives the CPU time per request of every process (router, worker, gateway, load
    generator) on both paths: in a closed loop at saturation, what the HTTP path adds per request
    on the shared cores is what its latency pays.
(b) engine: the bench/engine.py workload (SmolLM2-135M, 64 requests) as 64 concurrent
    streaming HTTP requests, against the same 64 requests through the ZeroMQ AsyncClient.
(c) stream: 64 greedy streams of 256 tokens on tiny:llama (fast enough that the path, not the
    model, is measured): streamed tokens/s of the engine in-process, through serve's router over
    ZeroMQ (AsyncClient.stream) and over HTTP SSE, in one run; every stream's tokens checked
    against the in-process ones, in order; the worker with the in-process engine's threads, and with
    one core fewer (left to the serving path).
The parts alternate the two paths `--repeats` times and keep each one's best run (run-to-run noise
on a 2-core VM is 15-50%). --dtype auto is bfloat16 where the CPU has native bf16 (AVX512-BF16 or
AMX), else float32 (bf16 GEMMs without it run ~5x slower than fp32).

    python bench/http.py [--parts short,engine,stream] [--seconds 5] [--repeats 2] [--streams 64]
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as a script, bench/ is first on sys.path, where bench/http.py would shadow the standard
# library's http package (which torch, httpx and uvicorn import): the repository root goes there
sys.path[0] = str(Path(__file__).resolve().parents[1])
ROOT = Path(__file__).resolve().parents[1]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from bench.machine import describe  # noqa: E402
from bench.router import emit, free_port, pct  # noqa: E402
from bench.router import load as zmq_load  # noqa: E402
from fusion.launcher import forked_workers  # noqa: E402
from routing.entrypoints import CLI, command  # noqa: E402


def serve(params: dict, variants: str, threads: int) -> tuple[subprocess.Popen, str, str, Path]:
    cfg = ROOT / "bench" / f"_http_{variants.split(',')[0]}.yaml"
    params["runconfig"] = {"threads_per_worker": threads}
    cfg.write_text(json.dumps(params))
    front, http = f"tcp://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    import httpx

    proc = subprocess.Popen([*command(CLI), "--mode", "serve", "--params", str(cfg), "--variants",
                             variants, "--frontend", front, "--backend", f"tcp://127.0.0.1:{free_port()}",
                             "--devices", "cpu", "--http", http], cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://{http}/health", timeout=2).status_code == 200:
                    return proc, front, f"http://{http}", cfg
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("run_mm.py serve exited")
            time.sleep(0.5)
        raise TimeoutError("the deployment did not become healthy")
    except BaseException:
        stop(proc, cfg)
        raise


def stop(proc: subprocess.Popen, cfg: Path) -> None:
    proc.terminate()
    proc.wait(timeout=60)
    cfg.unlink(missing_ok=True)


# --- (a) short requests ------------------------------------------------------------------------

async def _http_conn(host: str, port: int, request: bytes, stop_at: float, lat: list[float],
                     gap: float | None, rng: random.Random) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < stop_at:
            if gap:
                await asyncio.sleep(rng.expovariate(1 / gap))
            t = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = head[9:12]
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            body = await reader.readexactly(length)
            if status != b"200":
                raise RuntimeError(f"HTTP {status.decode()}: {body[:300]!r}")
            lat.append(time.perf_counter() - t)
    finally:
        writer.close()


def http_load(url: str, clients: int, seconds: float, body: dict,
              rate: float | None = None) -> tuple[int, list[float], float]:
    """Closed loop over `clients` keep-alive connections: pre-encoded requests, minimal parsing, so
    that the load generator is not what is measured. rate: as in bench.router.load (paced)."""
    hostport = url.removeprefix("http://")
    host, port = hostport.split(":")
    payload = json.dumps(body).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    lat: list[float] = []

    async def go():
        start = time.perf_counter()
        rng = random.Random(0)
        gap = clients / rate if rate else None
        await asyncio.gather(*[_http_conn(host, int(port), request, start + seconds, lat, gap, rng)
                               for _ in range(clients)])
        return time.perf_counter() - start

    import uvloop

    wall = uvloop.run(go())
    return len(lat), lat, wall


class CpuMeter:
    """CPU seconds (user + system) of each process of the deployment and of this load generator:
    per request, the cost each part adds. In a closed loop at saturation on 2 shared cores the
    latency is clients / throughput, so what the HTTP path costs in CPU per request is what its
    latency pays there."""

    def __init__(self, serve_pid: int):
        import psutil

        root = psutil.Process(serve_pid)
        self.procs = {"router": root, "load_generator": psutil.Process()}
        for child in root.children():
            if "routing.http" in " ".join(child.cmdline()):
                self.procs["gateway"] = child
        for worker in forked_workers(serve_pid):
            self.procs["worker"] = worker

    def sample(self) -> dict[str, float]:
        return {k: sum(p.cpu_times()[:2]) for k, p in self.procs.items()}

    def measure(self, fn, *args) -> tuple[tuple[int, list[float], float], dict[str, int]]:
        before = self.sample()
        n, lat, wall = fn(*args)
        after = self.sample()
        return (n, lat, wall), {k: round((after[k] - before[k]) / max(n, 1) * 1e6) for k in before}


def bench_short(seconds: float, clients: int, rate: float, repeats: int) -> None:
    params = {"variants": {"tiny": {"model": {"source": "tiny:llama", "dtype": "float32", "max_batch_size": 64,
                                              "max_batch_tokens": 512}}}}
    proc, front, url, cfg = serve(params, "tiny,1", 1)
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0.0}
    rows = []
    try:
        meter = CpuMeter(proc.pid)
        zmq_load(front, clients, 1.0, body)  # warm-up
        http_load(url, clients, 1.0, body)
        for n, offered in [(n, None) for n in sorted({1, clients})] + [(clients, rate)]:
            # one client: the gateway's own cost; many: its cost under load. Closed loops at
            # saturation differ by throughput (clients / rate is the latency), so the latency the
            # gateway adds is also read at one offered load, below either's saturation.
            runs = {"zmq": [], "http": []}
            for _ in range(repeats):  # alternating, each path's best run (lowest p50) is kept
                runs["zmq"].append(meter.measure(zmq_load, front, n, seconds, body, offered))
                runs["http"].append(meter.measure(http_load, url, n, seconds, body, offered))
            rows.append((n, offered, runs))
    finally:
        stop(proc, cfg)
    for n, offered, runs in rows:
        p50s = {k: [round(pct(lat, 0.5) * 1e3, 3) for (_, lat, _), _ in v] for k, v in runs.items()}
        (zn, zl, zw), zcpu = min(runs["zmq"], key=lambda r: pct(r[0][1], 0.5))
        (hn, hl, hw), hcpu = min(runs["http"], key=lambda r: pct(r[0][1], 0.5))
        zcpu.pop("gateway", None)
        emit(bench="http_short", clients=n, offered_requests_per_s=offered or "closed loop",
             http_requests=hn, http_requests_per_s=round(hn / hw, 1),
             http_p50_ms=round(pct(hl, 0.5) * 1e3, 3), http_p99_ms=round(pct(hl, 0.99) * 1e3, 3),
             zmq_requests_per_s=round(zn / zw, 1), zmq_p50_ms=round(pct(zl, 0.5) * 1e3, 3),
             zmq_p99_ms=round(pct(zl, 0.99) * 1e3, 3),
             added_latency_p50_ms=round((pct(hl, 0.5) - pct(zl, 0.5)) * 1e3, 3),
             added_latency_p99_ms=round((pct(hl, 0.99) - pct(zl, 0.99)) * 1e3, 3),
             http_cpu_us_per_request=hcpu, zmq_cpu_us_per_request=zcpu,
             added_cpu_us_per_request=sum(hcpu.values()) - sum(zcpu.values()),
             http_p50_runs_ms=p50s["http"], zmq_p50_runs_ms=p50s["zmq"], repeats=repeats)


# --- (b) the engine workload ---------------------------------------------------------------------

async def _zmq_engine(front: str, prompts, max_tokens) -> tuple[float, int]:
    from routing.client import AsyncClient

    async with AsyncClient(front, timeout=900) as c:
        t = time.perf_counter()
        res = await asyncio.gather(*[c.complete("m", p, max_tokens=m, temperature=0.0, ignore_eos=True)
                                     for p, m in zip(prompts, max_tokens)])
        return time.perf_counter() - t, sum(r["usage"]["completion_tokens"] for r in res)


async def _http_engine(url: str, prompts, max_tokens) -> tuple[float, int]:
    import httpx

    async def one(h, p, m):
        body = {"model": "m", "prompt": p, "max_tokens": m, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        tokens = 0
        async with h.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        return tokens

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as h:
        t = time.perf_counter()
        got = await asyncio.gather(*[one(h, p, m) for p, m in zip(prompts, max_tokens)])
        return time.perf_counter() - t, sum(got)


def bench_engine(n: int, model: str, dtype: str, repeats: int) -> None:
    from bench.engine import workload
    from workers.models import load_model

    lm = load_model(model, dtype=dtype)
    vocab, dtype = lm.vocab_size, str(lm.dtype).removeprefix("torch.")  # auto, resolved for this CPU
    prompts, max_tokens = workload(n, vocab)
    useful = sum(max_tokens)
    params = {"variants": {"m": {"model": {"source": model, "dtype": dtype, "max_batch_size": 64,
                                           "max_batch_tokens": 512}}}}
    proc, front, url, cfg = serve(params, "m,1", 2)
    best = {"zmq": float("inf"), "http": float("inf")}
    try:
        asyncio.run(_zmq_engine(front, [prompts[0][:16]], [2]))  # warm-up
        for _ in range(repeats):
            for name, run in (("zmq", lambda: _zmq_engine(front, prompts, max_tokens)),
                              ("http", lambda: _http_engine(url, prompts, max_tokens))):
                wall, got = asyncio.run(run())
                if got != useful:
                    raise RuntimeError(f"{name}: served {got} tokens, wanted {useful}")
                best[name] = min(best[name], wall)
    finally:
        stop(proc, cfg)
    emit(bench="http_engine", model=model, dtype=dtype, requests=n, tokens=useful, streams=n,
         http_tokens_per_s=round(useful / best["http"], 2), zmq_tokens_per_s=round(useful / best["zmq"], 2),
         ratio=round(best["zmq"] / best["http"], 3), repeats=repeats)


# --- (c) streamed tokens through the path ---------------------------------------------------------

async def _zmq_streams(front: str, prompts, new: int) -> tuple[float, list[list[int]]]:
    from routing.client import AsyncClient

    async def one(c, p):
        got: list[int] = []
        async for out in c.stream("m", p, max_tokens=new, temperature=0.0, ignore_eos=True, return_token_ids=True):
            got.extend(out["token_ids"])
        return got

    async with AsyncClient(front, timeout=900) as c:
        t = time.perf_counter()
        got = await asyncio.gather(*[one(c, p) for p in prompts])
        return time.perf_counter() - t, got


async def _sse_streams(url: str, prompts, new: int) -> tuple[float, list[str], int]:
    import httpx

    events = 0

    async def one(h, p):
        nonlocal events
        body = {"model": "m", "prompt": p, "max_tokens": new, "temperature": 0.0, "ignore_eos": True, "stream": True}
        got: list[str] = []
        async with h.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    events += 1
                    for choice in json.loads(line[6:]).get("choices", []):
                        got.append(choice.get("text") or "")
        return "".join(got)

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as h:
        t = time.perf_counter()
        got = await asyncio.gather(*[one(h, p) for p in prompts])
        return time.perf_counter() - t, got, events


def bench_stream(streams: int, new: int, repeats: int) -> None:
    """`streams` greedy streams of `new` tokens each on tiny:llama (float32: fast enough that the
    path, not the model, is what is measured): the engine in-process, then through serve's router
    over ZeroMQ (AsyncClient.stream) and over HTTP SSE, every stream's tokens checked against the
    in-process ones, in order. Best of `repeats`, the in-process engine run again beside each
    repeat of each deployment (this machine's pace drifts by 1.5x over minutes, and a rate measured
    once before the deployments made their ratios the drift's). The deployment runs twice: its
    worker with as many torch threads as the engine in-process, then (where there are 2 or more)
    with one core left to the serving path (router, output process, gateway, client), as vLLM's CPU
    backend reserves one for its API server; one line each."""
    import random

    import torch

    from workers.engine import Engine, EngineConfig
    from workers.engine.params import SamplingParams
    from workers.models import load_model

    rng = random.Random(7)
    prompts = [[rng.randrange(1, 250) for _ in range(rng.randint(4, 24))] for _ in range(streams)]
    cfg = dict(max_batch_size=streams, max_batch_tokens=512)
    eng = Engine(load_model("tiny:llama", dtype="float32"), EngineConfig(**cfg))
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    eng.generate(prompts[:2], params)  # warm

    def in_process() -> float:
        t = time.perf_counter()
        eng.generate(prompts, params)
        return time.perf_counter() - t

    outs = eng.generate(prompts, params)
    want, text = [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]
    total = streams * new
    threads = torch.get_num_threads()
    for worker_threads in sorted({threads, max(1, threads - 1)}, reverse=True):
        proc, front, url, path = serve({"variants": {"m": {"model": {"source": "tiny:llama", "dtype": "float32",
                                                                    **cfg}}}}, "m,1", worker_threads)
        best = {"inproc": float("inf"), "zmq": float("inf"), "http": float("inf")}
        sse_events, lost = 0, 0
        try:
            asyncio.run(_zmq_streams(front, prompts[:2], 4))  # warm-up
            for _ in range(repeats):
                best["inproc"] = min(best["inproc"], in_process())
                wall, got = asyncio.run(_zmq_streams(front, prompts, new))
                lost += sum(g != w for g, w in zip(got, want))
                best["zmq"] = min(best["zmq"], wall)
                wall, got, events = asyncio.run(_sse_streams(url, prompts, new))
                lost += sum(g != w for g, w in zip(got, text))
                best["http"], sse_events = min(best["http"], wall), events
        finally:
            stop(proc, path)
        inproc = best["inproc"]
        emit(bench="http_stream", model="tiny:llama", dtype="float32", streams=streams, new_tokens=new,
             inprocess_threads=threads, worker_threads=worker_threads,
             inprocess_tokens_per_s=round(total / inproc, 1), zmq_tokens_per_s=round(total / best["zmq"], 1),
             http_sse_tokens_per_s=round(total / best["http"], 1), zmq_vs_inprocess=round(inproc / best["zmq"], 3),
             http_vs_inprocess=round(inproc / best["http"], 3), sse_events_last_run=sse_events,
             streams_not_equal_in_order=lost, repeats=repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rate", type=float, default=1000.0,
                    help="offered requests/s (all clients) for the added-latency line at a set load")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--parts", default="short,engine,stream", help="short, engine, stream (comma-separated)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    print(json.dumps(describe("http", sys.argv)), flush=True)
    if args.seconds <= 0 or args.clients < 1 or args.repeats < 1:
        ap.error("--seconds must be > 0, --clients and --repeats >= 1")
    parts = args.parts.split(",")
    if "short" in parts:
        bench_short(args.seconds, args.clients, args.rate, args.repeats)
    if "engine" in parts and not args.skip_engine:
        bench_engine(args.n, args.model, args.dtype, args.repeats)
    if "stream" in parts:
        bench_stream(args.streams, args.stream_tokens, args.repeats)


if __name__ == "__main__":
    main()
