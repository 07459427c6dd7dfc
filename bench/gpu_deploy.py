"""bench/gpu.py's deployment part: models sharing one GPU behind the router and the HTTP gateway,
each figure from one run of one deployment (`run_mm.py --mode serve --http`, bf16):
variant `m`, `--copies` copies of the model sharing one weight owner, and variant `s`, one copy of
a second model (`--second-model`: Llama 3.2 1B's shape by default). Measured, in this order:

- the plan (`validate_only`);
- the model's engine in-process on the workload (tokens/s), before the deployment starts;
- one copy over HTTP (`m:0`), then every copy (`m`: the router spreads the streams);
- the second model alone (`s`), then both models at once (`m:0` and `s`), each against itself alone;
- each copy's greedy answer to one prompt (all equal?);
- the GPU memory of every process (nvidia-smi) against the plan: what a copy holds beyond its KV
  pool, against its CUDA context (this process's, measured after its engine is gone) and 0.15x
  its model's weights;
- whether any process printed an abort at exit (`deployment_exit`).

`--gpu-sharing` sets the deployment's `gpu_sharing` (`auto`: NVIDIA MPS where its control program
is installed; `timeslice` to measure against it); the plan's `validate_only` line names the choice.

The workload is bench/engine.py's (64 greedy streams, no early stop), every token counted from
the streams' usage.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.engine import emit, workload
from bench.router import free_port
from routing.entrypoints import CLI, command

ROOT = Path(__file__).resolve().parents[1]
# what a process that aborts at exit prints (torch's CUDA IPC teardown, a C++ exception in a destructor)
ABORT_MARKS = ("terminate called", "could not unlink the shared memory file",
               "Producer process has been terminated before all shared CUDA tensors released")
ALLOWANCE = 0.15  # of a model's weights, what a copy may hold beyond its KV pool and its context
PROMPT = "The three primary colours are"


def gpu_memory_by_pid() -> dict[int, int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    rows = [line.split(",") for line in out.strip().splitlines() if line.strip()]
    return {int(pid): int(mib) * 2**20 for pid, mib in rows}


async def _streams(client, url: str, model: str, prompts, max_tokens) -> tuple[float, int]:
    """(seconds, completion tokens) of the streams of `prompts` to `model`, all at once."""
    async def one(p, m):
        body = {"model": model, "prompt": p, "max_tokens": m, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        n = 0
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        n = chunk["usage"]["completion_tokens"]
        return n

    t = time.perf_counter()
    counts = await asyncio.gather(*[one(p, m) for p, m in zip(prompts, max_tokens)])
    return time.perf_counter() - t, sum(counts)


def stream_together(url: str, groups: dict[str, tuple]) -> dict[str, tuple[float, int]]:
    """Each group's (seconds, tokens): `groups` maps a model to its (prompts, max_tokens), all of
    them streamed at once, each group timed from the common start to its own last token."""
    import httpx

    async def go():
        limits = httpx.Limits(max_connections=sum(len(p) for p, _ in groups.values()) + 4)
        async with httpx.AsyncClient(timeout=900, limits=limits) as client:
            runs = await asyncio.gather(*[_streams(client, url, m, p, n) for m, (p, n) in groups.items()])
        return dict(zip(groups, runs))

    return asyncio.run(go())


def best_rate(url: str, model: str, prompts, max_tokens, repeats: int) -> tuple[float, int]:
    """(tokens/s, tokens of the fastest run) of the workload streamed to `model`, best of `repeats`."""
    runs = [stream_together(url, {model: (prompts, max_tokens)})[model] for _ in range(repeats)]
    wall, got = min(runs)
    return got / wall, got


def role(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    return next((name for key, name in (("--http", "serve"), ("owner", "weight owner"), ("routing.http", "http gateway"))
                 if key in text), "worker")


def _wait_healthy(url: str, proc: subprocess.Popen, limit: float = 600) -> float:
    import httpx

    t0 = time.perf_counter()
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.perf_counter() - t0 > limit:
            raise RuntimeError("run_mm.py serve did not become healthy")
        time.sleep(0.5)


def _memory(plan, status: list[dict], tree: dict, own_context: int | None) -> dict:
    """Every process's GPU memory by role, the plan's total, and each copy's memory beyond its KV
    pool against its context and ALLOWANCE of its model's weights."""
    mem = gpu_memory_by_pid()
    ours = {pid: b for pid, b in mem.items() if pid in tree}
    by_worker = {w["pid"]: w for w in status if w.get("pid") in ours}
    names = {pid: f"{pid} {'worker ' + str(by_worker[pid]['id']) if pid in by_worker else role(tree[pid].cmdline())}"
             for pid in ours}
    planned = {w.worker_id: w for w in plan.workers}
    copies = []
    for pid, w in by_worker.items():
        p = planned.get(w["id"])
        if p is None:
            continue
        beyond = ours[pid] - p.kv_cache_bytes
        copy = {"worker": w["id"], "model_id": w["model_id"], "mib": ours[pid] // 2**20,
                "kv_mib": p.kv_cache_bytes // 2**20, "beyond_kv_mib": beyond // 2**20,
                "weights_mib": p.weight_bytes // 2**20}
        if own_context is not None and p.weight_bytes:
            copy["beyond_kv_and_context_vs_allowance"] = round((beyond - own_context) / (ALLOWANCE * p.weight_bytes), 2)
        copies.append(copy)
    return {"gpu_memory_mib": {names[p]: b // 2**20 for p, b in ours.items()},
            "gpu_memory_total_mib": sum(ours.values()) // 2**20,
            "plan_total_mib": sum(d["estimated_bytes"] for d in plan.devices.values()) // 2**20,
            "context_mib": None if own_context is None else own_context // 2**20, "copies": copies}


def deployment(args, inprocess: Callable[[list, list], float], own_gpu_memory: Callable[[], int | None]) -> None:
    """The part (see the module's text). `inprocess(prompts, max_tokens)`: the workload's seconds on
    the model's engine in this process, which lets go of it after; `own_gpu_memory()`: this
    process's GPU memory then (its CUDA context), None off a GPU."""
    import httpx
    import psutil

    from fusion.deploy import build_fusion
    from fusion.params import load_params
    from fusion.plan import make_plan
    from routing.client import Client

    model = {"dtype": "bfloat16", "max_batch_size": 64}
    params = {"variants": {"m": {"model": {"source": args.model, **model}},
                           "s": {"model": {"source": args.second, **model}}},
              "runconfig": {"devices": args.device, "gpu_sharing": args.gpu_sharing}}
    fd, name = tempfile.mkstemp(prefix="mmfusion-gpu-", suffix=".yaml")
    cfg = Path(name)
    with os.fdopen(fd, "w") as f:
        json.dump(params, f)
    variants = [f"m,{args.copies}", "s,1"]
    log = tempfile.TemporaryFile()  # the deployment's stderr, unnamed: nothing is left in /tmp
    proc = None
    try:
        plan = make_plan(build_fusion(load_params(cfg), variants), None, args.device, None)
        shown = subprocess.run([*command(CLI), "--mode", "validate_only", "--params", str(cfg), "--variants",
                                *variants], cwd=ROOT, capture_output=True, text=True)
        emit(part="validate_only", rc=shown.returncode, output=shown.stdout.strip().splitlines()[-16:])
        prompts, max_tokens = workload(64, args.vocab)
        useful = sum(max_tokens)
        alone_inprocess = useful / inprocess(prompts, max_tokens)
        context = own_gpu_memory()
        front, http = f"tcp://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        proc = subprocess.Popen([*command(CLI), "--mode", "serve", "--params", str(cfg), "--variants", *variants,
                                 "--frontend", front, "--backend", f"tcp://127.0.0.1:{free_port()}", "--http", http],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
        url = f"http://{http}"
        ready_s = _wait_healthy(url, proc)
        answers = []
        for i in range(args.copies):
            r = httpx.post(f"{url}/v1/completions", timeout=300,
                           json={"model": f"m:{i}", "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
            r.raise_for_status()
            answers.append(r.json()["choices"][0]["text"])
        one, got_one = best_rate(url, "m:0", prompts, max_tokens, args.repeats)
        every, got_every = best_rate(url, "m", prompts, max_tokens, args.repeats)
        second, got_second = best_rate(url, "s", prompts, max_tokens, args.repeats)
        both = stream_together(url, {"m:0": (prompts, max_tokens), "s": (prompts, max_tokens)})
        with_second = both["m:0"][1] / both["m:0"][0]
        with_first = both["s"][1] / both["s"][0]
        emit(part="deployment", copies=args.copies, second_model=args.second_shape, gpu_sharing=args.gpu_sharing,
             ready_s=round(ready_s, 1),
             greedy_answers_equal=all(a == answers[0] for a in answers), answer=answers[0],
             inprocess_tokens_per_s=round(alone_inprocess, 1), one_copy_http_tokens_per_s=round(one, 1),
             copies_http_tokens_per_s=round(every, 1),
             one_copy_http_vs_inprocess=round(one / alone_inprocess, 3), copies_vs_one_copy=round(every / one, 3),
             second_alone_http_tokens_per_s=round(second, 1),
             both_at_once_tokens_per_s={"m:0": round(with_second, 1), "s": round(with_first, 1)},
             first_beside_second_vs_alone=round(with_second / one, 3),
             second_beside_first_vs_alone=round(with_first / second, 3),
             tokens={"m:0": got_one, "m": got_every, "s": got_second, "both": both["m:0"][1] + both["s"][1]},
             expected_tokens_a_run=useful, repeats=args.repeats)
        if args.device.startswith("cuda"):
            with Client(front, timeout=60) as c:
                status = c.status()["workers"]
            root = psutil.Process(proc.pid)
            tree = {p.pid: p for p in [root, *root.children(recursive=True)]}
            emit(part="deployment_memory", **_memory(plan, status, tree, context))
    finally:
        cfg.unlink(missing_ok=True)
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
        log.seek(0)
        text = log.read().decode(errors="replace")
        log.close()
        sys.stderr.write(text)
        if proc is not None:
            aborts = [line for line in text.splitlines() if any(mark in line for mark in ABORT_MARKS)]
            emit(part="deployment_exit", rc=proc.returncode, aborted=bool(aborts), abort_lines=aborts[:6])
