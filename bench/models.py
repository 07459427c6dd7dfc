"""Models at run time: load-to-first-token, and a budget that holds two of four models while clients
alternate between all four. Prints JSON lines.

A `run_mm.py --mode serve` subprocess starts with one variant loaded and a `memory_budget` that
holds any two of the four variants' copies (their sizes as validate_only prints them). Then:

1. For each variant, cold and warm load-to-first-token: a streamed greedy request for the variant
   while it is not loaded (autoload) until its first token; then it is unloaded and the same
   again (the shared weights file is warm, and the page cache holds it). `weights_cached` says
   whether an earlier run left the model's weights in the cache (a shared weights file, or a GGUF
   conversion): without, the cold load reads the GGUF file.
2. The alternating scenario: `--clients` threads send greedy requests to the four variants in
   turn for `--seconds`. Per request the latency; per variant the loads; the workers' summed PSS
   (the worker processes only: not the router, the fork server or this driver), sampled at 10 Hz,
   against the budget. Every answer must be the tokens the engine gives in this process for the
   prompt alone (computed first, one variant at a time), counted by variant where it is not.
   Without `--deterministic`, a bfloat16 answer can change with the rows batched beside it.
   `floor_loads_per_request` is the fewest loads a request any policy could make for these
   clients, copy sizes and budget (loads_floor).
3. Fairness (a serve process of its own, SmolLM2 alone, with tenants): `gold` (weight 3) and
   `silver` (weight 1) each keep more requests in flight than the worker's batch holds for
   `--fair-seconds`; `capped` (weight 1, a quota of `--quota` tokens a minute) sends one request
   after another, waiting out each refusal's retry_after (at most 2 s). The tokens each tenant was
   served in the window, gold's to silver's, capped's against its quota, every refusal's time to
   answer, and whether any request failed otherwise (nothing may be lost).
4. Head-of-line (a serve process of its own, SmolLM2 and Gemma 3 each on both cores, a budget that
   holds both): one client sends SmolLM2 greedy requests back to back for `--hol-seconds` alone,
   then for `--hol-rounds` rounds Gemma 3 is unloaded and loaded again by a request. SmolLM2's
   p50 alone against its p50 over the requests that overlapped a load of Gemma 3 (from the request
   that starts it to its first token).

    python bench/models.py [--seconds 120] [--clients 4] [--scenarios load,alternating,fairness,hol]
                           [--min-resident-s S] [--max-loads-per-minute N] [--deterministic]
                           [--hol-seconds S] [--hol-rounds N]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])
ROOT = Path(__file__).resolve().parents[1]

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import psutil  # noqa: E402

from bench.machine import describe  # noqa: E402
from bench.router import emit, free_port, pct  # noqa: E402
from routing.entrypoints import CLI, command  # noqa: E402

VARIANTS = {
    "smollm2": {"source": "smollm2-135m", "dtype": "auto"},
    "gemma3": {"source": "gemma3-270m", "dtype": "auto"},
    "smollm2_bf16": {"source": "smollm2-135m", "dtype": "bfloat16"},
    "tiny": {"source": "tiny:llama", "dtype": "float32"},
}
PROMPTS = ["The three primary colours are", "Once upon a time", "def fibonacci(n):"]
GREEDY = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}


def budget_for_two(params: dict) -> tuple[int, dict]:
    from fusion.catalog import PlanPlacer
    from workers.spec import ModelSpec

    placer = PlanPlacer(["cpu"], "auto", {"cpu": 2**40})
    sizes = {n: placer.size(ModelSpec.from_params(n, v["model"]), "cpu").alone for n, v in params["variants"].items()}
    s = sorted(sizes.values())
    return s[-1] + s[-2] + s[0] // 2, sizes


def loads_floor(sizes: dict[str, int], budget: int, clients: int, rounds: int = 200) -> float:
    """The fewest loads a request any policy could make in the alternating scenario, even one that
    knew every request ahead. Every client's own requests (the variants in turn) have to be served
    by the one sequence of resident sets, so the loads are at least the fewest that serve one
    client's sequence: exact by dynamic programming over the sets of copies that fit the budget
    (loading only what a request needs loses nothing). Dividing by all the clients' requests, as
    many as the busiest client's times `clients`, gives the floor."""
    from itertools import combinations

    names = list(sizes)
    fits = [frozenset(c) for k in range(1, len(names) + 1) for c in combinations(names, k)
            if sum(sizes[n] for n in c) <= budget]
    sequence = [names[i % len(names)] for i in range(len(names) * rounds)]
    cost = {s: len(s) for s in fits if sequence[0] in s}
    for name in sequence[1:]:
        cost = {s: min(c + len(s - p) for p, c in cost.items()) for s in fits if name in s}
    return min(cost.values()) / (len(sequence) * clients)


def engine_answers(params: dict) -> dict[tuple[str, str], list[int]]:
    """Each (variant, prompt)'s greedy tokens from the engine in this process, the prompt alone in
    its batch, with the variant's settings: what every served answer must equal."""
    import gc

    from workers.engine import Engine, EngineConfig
    from workers.engine.params import SamplingParams
    from workers.models import load_model
    from workers.spec import ModelSpec, WorkerSpec

    sampling = SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0.0, ignore_eos=True)
    out = {}
    for name, v in params["variants"].items():
        spec = WorkerSpec(ModelSpec.from_params(name, v["model"]), 0, threads=2)
        m = spec.model
        engine = Engine(load_model(m.source, dtype=m.dtype, max_model_len=m.max_model_len, share_weights=False,
                                   prepack=m.prepack_weights), EngineConfig.from_spec(spec))
        for prompt in PROMPTS:
            out[name, prompt] = engine.generate([prompt], sampling)[0].outputs[0].token_ids
        del engine
        gc.collect()
    return out


def workers_pss(serve_pid: int) -> int:
    """The worker processes of the serve process: the children of its fork server."""
    total = 0
    try:
        servers = [c for c in psutil.Process(serve_pid).children() if "forkserver" in " ".join(c.cmdline())]
        for w in (w for s in servers for w in s.children()):
            total += w.memory_full_info().pss
    except psutil.Error:
        pass  # a worker exited between the listing and the read
    return total


def first_token(c, name: str, prompt: str) -> float:
    t0 = time.perf_counter()
    for _ in c.stream(name, prompt, max_tokens=4, temperature=0.0):
        return time.perf_counter() - t0
    raise RuntimeError("no token")


def weights_cached(source: str) -> bool:
    """Whether an earlier run left this source's weights in the cache: the file copies map
    (workers.weights.shared), or a GGUF conversion (compile_only)."""
    from workers.files import cache_root
    from workers.weights.sources import gguf_cache_dir, source_gguf, source_key

    gguf = None if source.startswith("tiny:") else source_gguf(source)
    return any((cache_root() / "shared").glob(f"{source_key(source)}-*")) or bool(gguf and gguf_cache_dir(gguf))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--scenarios", default="load,alternating,fairness,hol")
    ap.add_argument("--fair-seconds", type=float, default=60.0)
    ap.add_argument("--quota", type=int, default=600, help="capped's tokens a minute (fairness)")
    ap.add_argument("--min-resident-s", type=float, default=0.0, help="runconfig.min_resident_s (load, alternating)")
    ap.add_argument("--max-loads-per-minute", type=int, default=None, help="runconfig.max_loads_per_minute")
    ap.add_argument("--deterministic", action="store_true",
                    help="model.deterministic for every variant (load, alternating): answers that do not depend "
                         "on the batch")
    ap.add_argument("--hol-seconds", type=float, default=20.0, help="SmolLM2 alone before the loads (head-of-line)")
    ap.add_argument("--hol-rounds", type=int, default=12, help="loads of Gemma 3 beside SmolLM2 (head-of-line)")
    args = ap.parse_args()
    print(json.dumps(describe("models", sys.argv)), flush=True)
    scenarios = set(args.scenarios.split(","))
    if "fairness" in scenarios:
        fairness(args)
    if "hol" in scenarios:
        head_of_line(args)
    if not scenarios & {"load", "alternating"}:
        return
    params = {"variants": {n: {"model": {**m, "max_batch_size": 8, "max_model_len": 1024,
                                         "deterministic": args.deterministic}} for n, m in VARIANTS.items()},
              "runconfig": {"threads_per_worker": 1, "devices": "cpu", "unload_timeout": 60,
                            "min_resident_s": args.min_resident_s, "max_loads_per_minute": args.max_loads_per_minute}}
    budget, sizes = budget_for_two(params)
    params["runconfig"]["memory_budget"] = budget
    cached = {n: weights_cached(m["source"]) for n, m in VARIANTS.items()}  # before serve fills the cache
    reference = engine_answers(params) if "alternating" in scenarios else {}
    proc, front, log, cfg = serve(params, "tiny,1")
    from routing.client import Client

    try:
        wait_serving(front, proc, log)
        with Client(front, timeout=900) as c:
            c.unload("tiny")
            for name in VARIANTS if "load" in scenarios else ():
                cold = first_token(c, name, PROMPTS[0])
                c.unload(name)
                warm = first_token(c, name, PROMPTS[0])
                c.unload(name)
                emit(bench="models_load", model=name, source=VARIANTS[name]["source"], dtype=VARIANTS[name]["dtype"],
                     copy_mib=round(sizes[name] / 2**20), weights_cached=cached[name],
                     cold_load_to_first_token_s=round(cold, 2), warm_load_to_first_token_s=round(warm, 2))
        if "alternating" in scenarios:
            scenario(front, proc.pid, budget, sizes, reference, args)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        cfg.unlink(missing_ok=True)


def scenario(front: str, serve_pid: int, budget: int, sizes: dict, reference: dict, args) -> None:
    from routing.client import Client

    latencies: list[float] = []
    answers: dict = {}
    differ = dict.fromkeys(VARIANTS, 0)  # answers unlike the engine in-process, by variant
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], workers_pss(serve_pid))
            stop.wait(0.1)

    def client(k: int) -> None:
        end = time.monotonic() + args.seconds
        with Client(front, timeout=900) as c:
            r = 0
            while time.monotonic() < end:
                name = list(VARIANTS)[(k + r) % len(VARIANTS)]
                prompt = PROMPTS[(k + r) % len(PROMPTS)]
                t0 = time.perf_counter()
                tokens = c.complete(name, prompt, **GREEDY)["choices"][0]["token_ids"]
                latencies.append(time.perf_counter() - t0)
                answers.setdefault((name, prompt), set()).add(tuple(tokens))
                if tokens != reference[name, prompt]:
                    differ[name] += 1
                r += 1

    with Client(front, timeout=60) as c:
        before = c.status()["models"]
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with ThreadPoolExecutor(args.clients) as pool:
        for f in [pool.submit(client, k) for k in range(args.clients)]:
            f.result()
    stop.set()
    sampler.join(5)
    with Client(front, timeout=60) as c:
        life = c.status()["models"]
    loads = life["loads"] - before["loads"]
    emit(bench="models_alternating", variants=list(VARIANTS), clients=args.clients, seconds=args.seconds,
         min_resident_s=args.min_resident_s, max_loads_per_minute=args.max_loads_per_minute, held=life["held"],
         requests=len(latencies), p50_s=round(pct(latencies, 0.5), 3), p99_s=round(pct(latencies, 0.99), 3),
         loads=loads, loads_per_request=round(loads / max(1, len(latencies)), 3),
         floor_loads_per_request=round(loads_floor(sizes, budget, args.clients), 3),
         evictions=life["evictions"], load_seconds_mean=life["load_seconds"]["mean"],
         budget_mib=round(budget / 2**20), copy_mib={n: round(s / 2**20) for n, s in sizes.items()},
         peak_workers_pss_mib=round(peak[0] / 2**20), peak_over_budget=round(peak[0] / budget, 3),
         deterministic=args.deterministic, answers_equal_engine=not any(differ.values()), answers_unlike_engine=differ,
         distinct_answers_max=max(map(len, answers.values()), default=0), load_failures=life["load_failures"])


def serve(params: dict, variants: str):
    """A `run_mm.py --mode serve` subprocess of `params` (a YAML file beside this script while it
    runs), its frontend, and its stderr lines; the caller stops it and removes the file."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=ROOT / "bench", delete=False) as f:
        json.dump(params, f)
    front = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([*command(CLI), "--mode", "serve", "--params", f.name, "--variants", variants,
                             "--frontend", front, "--backend", f"tcp://127.0.0.1:{free_port()}"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    return proc, front, log, Path(f.name)


def wait_serving(front: str, proc, log: list[str], timeout: float = 300) -> None:
    from routing.client import Client

    with Client(front, timeout=60) as c:
        deadline = time.monotonic() + timeout
        while not any(w["loaded"] for w in c.status()["workers"]):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("serve did not start:\n" + "".join(log[-30:]))
            time.sleep(0.5)


def fairness(args) -> None:
    from routing.client import Client, RouterError
    from wire import protocol as P

    batch = 8
    params = {"variants": {"smollm2": {"model": {**VARIANTS["smollm2"], "max_batch_size": batch, "max_model_len": 1024}}},
              "runconfig": {"threads_per_worker": 2, "devices": "cpu",
                            "tenants": {"gold": {"weight": 3}, "silver": {"weight": 1},
                                        "capped": {"tokens_per_minute": args.quota}}}}
    proc, front, log, cfg = serve(params, "smollm2,1")
    request = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    served: dict[str, int] = {"gold": 0, "silver": 0, "capped": 0}
    refusals: list[float] = []
    waits: list[float] = []
    lost: list[str] = []
    lock = threading.Lock()
    try:
        wait_serving(front, proc, log)
        end = time.monotonic() + args.fair_seconds

        def client(tenant: str, k: int) -> None:
            with Client(front, timeout=600) as c:
                while time.monotonic() < end:
                    t0 = time.perf_counter()
                    try:
                        r = c.complete("smollm2", PROMPTS[k % len(PROMPTS)], tenant=tenant, **request)
                    except RouterError as exc:
                        if exc.code != P.RATE_LIMITED:
                            with lock:
                                lost.append(f"{tenant}: {exc.code}: {exc.message}")
                            return
                        with lock:
                            refusals.append(time.perf_counter() - t0)
                            waits.append(exc.retry_after or 0.0)
                        time.sleep(min(exc.retry_after or 1.0, 2.0, max(0.0, end - time.monotonic())))
                        continue
                    if time.monotonic() <= end:  # served within the window, while every tenant was backlogged
                        with lock:
                            served[tenant] += r["usage"]["completion_tokens"]

        threads = [("gold", k) for k in range(2 * batch)] + [("silver", k) for k in range(2 * batch)] + [("capped", 0)]
        with ThreadPoolExecutor(len(threads)) as pool:
            for f in [pool.submit(client, t, k) for t, k in threads]:
                f.result()
        with Client(front, timeout=60) as c:
            tenants = c.status()["tenants"]
        emit(bench="models_fairness", model="smollm2", seconds=args.fair_seconds, batch=batch,
             clients={"gold": 2 * batch, "silver": 2 * batch, "capped": 1}, served_tokens=served,
             gold_to_silver=round(served["gold"] / max(1, served["silver"]), 3),
             capped_quota_tokens=round(args.quota * args.fair_seconds / 60), capped_served=served["capped"],
             refusals=len(refusals), refusal_max_ms=round(max(refusals, default=0.0) * 1e3, 2),
             retry_after_s=[round(min(waits, default=0), 2), round(max(waits, default=0), 2)],
             lost=lost, router_rate_limited={t: s["rate_limited"] for t, s in tenants.items()})
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        cfg.unlink(missing_ok=True)


def head_of_line(args) -> None:
    from routing.client import Client

    names = ("smollm2", "gemma3")
    params = {"variants": {n: {"model": {**VARIANTS[n], "max_batch_size": 8, "max_model_len": 1024}} for n in names},
              "runconfig": {"threads_per_worker": 2, "devices": "cpu"}}
    proc, front, log, cfg = serve(params, "smollm2,1")
    done: list[tuple[float, float]] = []  # (start, end) of each SmolLM2 request
    loads: list[tuple[float, float]] = []  # (start, first token) of each load of Gemma 3
    stop = threading.Event()

    def client() -> None:
        with Client(front, timeout=600) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                c.complete("smollm2", PROMPTS[0], **GREEDY)
                done.append((t0, time.perf_counter()))

    try:
        wait_serving(front, proc, log)
        with Client(front, timeout=600) as c:
            first_token(c, "gemma3", PROMPTS[1])  # its caches warm, as a reload finds them
            c.unload("gemma3")
            runner = threading.Thread(target=client)
            runner.start()
            time.sleep(args.hol_seconds)
            alone = len(done)
            for _ in range(args.hol_rounds):
                t0 = time.perf_counter()
                loads.append((t0, t0 + first_token(c, "gemma3", PROMPTS[1])))
                time.sleep(0.5)
                c.unload("gemma3")
                time.sleep(1.0)
            stop.set()
            runner.join()
        base = [e - s for s, e in done[1:alone]]  # the first warms SmolLM2's own caches
        during = [e - s for s, e in done[alone:] if any(s < le and e > ls for ls, le in loads)]
        emit(bench="models_head_of_line", model="smollm2", loading="gemma3", threads_per_worker=2,
             requests_alone=len(base), requests_during_loads=len(during),
             p50_alone_s=round(pct(base, 0.5), 3), p50_during_loads_s=round(pct(during, 0.5), 3),
             ratio=round(pct(during, 0.5) / pct(base, 0.5), 3),
             load_to_first_token_s=[round(le - ls, 2) for ls, le in loads])
    finally:
        stop.set()
        proc.terminate()
        proc.wait(timeout=120)
        cfg.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
