"""Memory of copies of one model, shared weights against full copies, printing JSON lines.

For 1, 2 and 4 copies of SmolLM2-135M at dtype auto (`run_mm.py --mode serve`, one process per
copy), with `share_weights` on (the default) and off: the deployment's summed PSS (the serving
process and every worker, after each copy has answered a greedy request), the cost of each extra
copy, the weight bytes, and the plan's estimate beside the measurement. The greedy answers of
every copy must equal the unshared run's.

Each line also gives an extra shared copy's cost over an allowance of its KV cache, its process
overhead and 15% of the weight bytes (`extra_copy_vs_allowance`). The process overhead is measured in the same run, as the cost of an extra copy of a model with
next to no weights (tiny:llama); the KV cache is the copy's full budget as the plan counts it.

    python bench/memory.py [--copies 1 2 4] [--model smollm2-135m] [--dtype auto] [--quantization auto int4]

--quantization: the model's `quantization` key; with several, each runs in turn (shared and
unshared), and every line names its own.
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
import time  # noqa: E402

import psutil  # noqa: E402

from bench.machine import describe  # noqa: E402
from bench.router import emit, free_port  # noqa: E402
from fusion.plan import OVERHEAD_BYTES  # noqa: E402
from routing.entrypoints import CLI, command  # noqa: E402

PROMPT = "The three primary colours are"


def pss_tree(pid: int) -> int:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(p.memory_full_info().pss for p in procs)


def run(model: str, dtype: str, copies: int, share: bool, batch: int, ctx: int, quantization: str = "auto") -> dict:
    from fusion.deploy import build_fusion
    from fusion.params import load_params
    from fusion.plan import make_plan
    from routing.client import Client

    params = {"variants": {"m": {"model": {"source": model, "dtype": dtype, "share_weights": share,
                                           "max_batch_size": batch, "max_model_len": ctx,
                                           "quantization": quantization}}},
              "runconfig": {"threads_per_worker": 1}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=ROOT / "bench", delete=False) as f:
        json.dump(params, f)
    cfg = Path(f.name)
    front = f"tcp://127.0.0.1:{free_port()}"
    plan = make_plan(build_fusion(load_params(cfg), [f"m,{copies}"]), None, "cpu", 1)
    proc = subprocess.Popen([*command(CLI), "--mode", "serve", "--params", str(cfg), "--variants",
                             f"m,{copies}", "--frontend", front, "--backend", f"tcp://127.0.0.1:{free_port()}",
                             "--devices", "cpu"], cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        with Client(front, timeout=600) as c:
            deadline = time.monotonic() + 900
            while sum(w["alive"] and w["loaded"] for w in c.status()["workers"]) < copies:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the deployment did not load")
                time.sleep(0.5)
            answers = [c.complete(mid, PROMPT, max_tokens=24, temperature=0.0)["choices"][0]["text"]
                       for mid in range(copies)]
            weights = [w["weights"] for w in c.status()["workers"] if w["alive"]]
        time.sleep(1.0)
        pss = pss_tree(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        cfg.unlink(missing_ok=True)
    dev = plan.devices["cpu"]
    return {"copies": copies, "share_weights": share, "pss_bytes": pss, "answers": answers, "weights": weights,
            "plan_bytes": dev["estimated_bytes"],
            "kv_bytes": plan.workers[0].est_bytes - plan.workers[0].weight_bytes - OVERHEAD_BYTES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--quantization", nargs="+", default=["auto"])
    args = ap.parse_args()
    print(json.dumps(describe("memory", sys.argv)), flush=True)
    one, most = min(args.copies), max(args.copies)
    # a worker process's own overhead, measured: what an extra copy of a model with next to no
    # weights (tiny:llama, 0.4 MiB) costs
    tiny = [run("tiny:llama", "float32", n, True, args.max_batch_size, args.max_model_len) for n in (one, most)]
    overhead = (tiny[1]["pss_bytes"] - tiny[0]["pss_bytes"]) / (most - one)
    emit(bench="memory_overhead", model="tiny:llama", copies=[one, most],
         pss_mib=[round(t["pss_bytes"] / 2**20, 1) for t in tiny], overhead_per_worker_mib=round(overhead / 2**20, 1),
         plan_overhead_mib=round(OVERHEAD_BYTES / 2**20, 1))
    for quant in args.quantization:
        report(args, quant, overhead, one)


def report(args, quant: str, overhead: float, one: int) -> None:
    rows = {}
    for share in (False, True):
        for n in args.copies:
            rows[share, n] = run(args.model, args.dtype, n, share, args.max_batch_size, args.max_model_len, quant)
    base_answers = rows[False, args.copies[0]]["answers"][0]
    for (share, n), r in rows.items():
        w = r["weights"][0]
        extra = (r["pss_bytes"] - rows[share, one]["pss_bytes"]) / (n - one) if n > one else None
        # the copy's full KV cache budget (as the plan counts it) and the measured process
        # overhead, plus 15% of the weights
        kv = r["kv_bytes"]
        allowance = kv + overhead + 0.15 * w["bytes"]
        emit(bench="memory", model=args.model, dtype=args.dtype, quantization=quant, copies=n, share_weights=share,
             pss_mib=round(r["pss_bytes"] / 2**20, 1),
             extra_copy_mib=None if extra is None else round(extra / 2**20, 1),
             weight_mib=round(w["bytes"] / 2**20, 1), weights_shared=all(x["shared"] for x in r["weights"]),
             plan_estimate_mib=round(r["plan_bytes"] / 2**20, 1),
             kv_budget_mib=round(kv / 2**20, 1), overhead_mib=round(overhead / 2**20, 1),
             allowance_mib=round(allowance / 2**20, 1),
             extra_copy_vs_allowance=None if extra is None or not share else round(extra / allowance, 3),
             answers_equal_unshared=all(a == base_answers for a in r["answers"]))


if __name__ == "__main__":
    main()
