"""Multi-model fusion host: validate a deployment, or serve it.

    python run_mm.py --mode validate_only --params configs/demo.yaml --variants smollm2,2 gemma3,1
    python run_mm.py --mode serve --params configs/demo.yaml --variants smollm2,2 gemma3,1

Flags override the params file's `runconfig` keys of the same name.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from fusion.data.hdf5 import DataError
from fusion.deploy import build_fusion
from fusion.local import LocalDeployment
from fusion.params import ParamsError, load_params
from fusion.plan import make_plan
from fusion.predict import hdf5_jobs, run_predict

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
    run = params["runconfig"]
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(plan.describe())
    with LocalDeployment(fusion, plan, run["frontend"], run["backend"]) as dep:
        print(f"serving: clients connect to {dep.frontend} (workers: {dep.router.backend_addr})", flush=True)
        while not stop.wait(0.5):
            pass
    print("stopped", flush=True)  # every worker was told to shut down and has exited
    return 0


def predict(params: dict, fusion, plan) -> int:
    run = params["runconfig"]
    jobs = hdf5_jobs(fusion, run["model_dir"], run["inference_steps"])  # checks the data before any load
    if run["router"]:
        run_predict(run["router"], jobs)
        return 0
    with LocalDeployment(fusion, plan, run["frontend"], run["backend"]) as dep:
        dep.wait_loaded()
        run_predict(dep.frontend, jobs)
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
    try:
        if args.mode == "serve":
            return serve(params, fusion, plan)
        if args.mode in ("predict", "infer"):
            return predict(params, fusion, plan)
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"error: --mode {args.mode} is not available yet (see the open issues)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
