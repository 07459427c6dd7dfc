"""Multi-model fusion host: validate a deployment, or serve it.

    python run_mm.py --mode validate_only --params configs/demo.yaml --variants smollm2,2 gemma3,1
    python run_mm.py --mode serve --params configs/demo.yaml --variants smollm2,2 gemma3,1

Flags override the params file's `runconfig` keys of the same name.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from fusion.deploy import build_fusion, model_entries, worker_overrides
from fusion.params import ParamsError, load_params
from fusion.plan import make_plan

MODES = ["validate_only", "compile_only", "predict", "infer", "eval", "serve"]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", "-m", choices=MODES, default="validate_only")
    ap.add_argument("--params", "-p", required=True)
    ap.add_argument("--model_dir", "-o")
    ap.add_argument("--variants", nargs="+", help="NAME,COUNT ...")
    ap.add_argument("--num_workers", type=int)
    ap.add_argument("--devices")
    ap.add_argument("--router")
    ap.add_argument("--frontend")
    ap.add_argument("--backend")
    ap.add_argument("--inference_steps", type=int)
    ap.add_argument("--threads_per_worker", type=int)
    return ap


def configure(args) -> tuple[dict, object, object]:
    params = load_params(args.params)
    run = params["runconfig"]
    for key in ("model_dir", "variants", "num_workers", "devices", "router", "frontend", "backend",
                "inference_steps", "threads_per_worker"):
        val = getattr(args, key, None)
        if val is not None:
            run[key] = val
    fusion = build_fusion(params, run["variants"])
    plan = make_plan(fusion, run["num_workers"], run["devices"], run["threads_per_worker"])
    return params, fusion, plan


def serve(params: dict, fusion, plan) -> int:
    from routing.router import Router, RouterConfig

    run = params["runconfig"]
    router = Router(model_entries(fusion), RouterConfig(frontend=run["frontend"], backend=run["backend"]),
                    worker_overrides=worker_overrides(plan))
    print(plan.describe())
    procs = [subprocess.Popen([sys.executable, "-m", "workers.worker", "--backend", router.backend_addr,
                               "--parent-pid", str(os.getpid())]) for _ in plan.workers]

    def stop(signum, frame):
        router.stop()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print(f"serving: clients connect to {router.frontend_addr} (workers: {router.backend_addr})", flush=True)
    try:
        router.run()  # returns after SIGINT/SIGTERM, having told every worker to shut down
    finally:
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    print("stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        params, fusion, plan = configure(args)
    except (ParamsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.mode == "validate_only":
        print(plan.describe())
        return 0
    if args.mode == "serve":
        return serve(params, fusion, plan)
    print(f"error: --mode {args.mode} is not available yet (see the open issues)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
