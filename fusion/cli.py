"""Multi-model fusion host: check a deployment, serve it, or run its models over their data.
(`run_mm.py` at the top of the repository is this module's command line.)

    python run_mm.py --mode validate_only --params configs/demo.yaml --variants smollm2,2 gemma3,1
    python run_mm.py --mode compile_only  --params configs/demo.yaml --variants smollm2,1 gemma3,1
    python run_mm.py --mode predict       --params configs/demo.yaml --variants smollm2,2 gemma3,1
    python run_mm.py --mode eval          --params configs/demo.yaml --variants smollm2,1 gemma3,1
    python run_mm.py --mode serve         --params configs/demo.yaml --variants smollm2,2 gemma3,1

Flags override the params file's `runconfig` keys of the same name.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

import zmq

from fusion import launcher
from fusion.data.files import DataError, writable_dir
from fusion.params import ParamsError, check_runconfig, load_params
from routing.http.server import GatewayError
from routing.open_files import raise_open_files
from routing.tenants import tenant_keys
from wire.security import SecurityError, check_bind, endpoint_problem

MODES = ["validate_only", "compile_only", "predict", "infer", "eval", "serve"]
# the modes that start worker processes here (unless they use a router elsewhere, or Ray)
WORKER_MODES = {"predict", "infer", "eval", "serve"}
# the modes whose outputs a rerun goes on from (what finished stays written)
RESUMABLE = {"predict", "infer", "eval"}


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
    ap.add_argument("--curve_keys", help="CurveZMQ keys directory (python -m wire.security DIR)")
    ap.add_argument("--insecure", action="store_true", default=None,
                    help="allow binding the router off loopback without CurveZMQ")
    ap.add_argument("--max_restarts", type=int, help="restarts of a crashed worker before giving up")
    ap.add_argument("--http", help="HOST:PORT: serve also starts the OpenAI-compatible HTTP gateway there")
    ap.add_argument("--api-key", "--api_key", action="append", dest="api_key",
                    help="an API key the HTTP gateway accepts (repeatable)")
    ap.add_argument("--api_keys_file", help="a file of API keys the HTTP gateway accepts, one per line")
    ap.add_argument("--ray", help="place the workers as actors on the Ray cluster at ADDRESS (auto, host:port, "
                                  "ray://...); needs the ray extra")
    ap.add_argument("--restart_wait", type=float,
                    help="seconds queued requests wait for a model with no live worker before failing (no_worker)")
    return ap


def configure(args) -> tuple[dict, object]:
    """The params and the fused models, every setting checked; local worker modes start the fork
    server here, whose imports then overlap what is read and planned before the first worker."""
    from fusion.deploy import build_fusion, variant_specs

    params = load_params(args.params)
    run = params["runconfig"]
    flags = [key for key in ("model_dir", "variants", "num_workers", "devices", "router", "frontend", "backend",
                             "inference_steps", "threads_per_worker", "curve_keys", "insecure", "max_restarts",
                             "restart_wait", "ray") if getattr(args, key, None) is not None]
    for key in flags:
        run[key] = getattr(args, key)
    check_runconfig(run, flags, lambda name: f"--{name}")
    mode = getattr(args, "mode", None)
    if mode == "serve" and run["router"]:  # it would start a router of its own and ignore this one
        raise ParamsError(f"serve starts a router of its own (at `frontend` and `backend`), so `router` "
                          f"({run['router']}) must be null; against a running router, start workers with "
                          "`python -m workers.worker --backend ADDR` and an HTTP gateway with "
                          "`python -m routing.http --router ADDR --http HOST:PORT`")
    if not run["router"]:  # before anything starts: a router bound off loopback needs keys
        for addr in (run["frontend"], run["backend"]):
            check_bind(addr, run["curve_keys"], bool(run["insecure"]))
    elif problem := endpoint_problem(run["router"], bind=False):
        raise ParamsError(f"router address {run['router']!r} {problem}; give the running router's, "
                          "e.g. tcp://127.0.0.1:5555")
    run["http"] = getattr(args, "http", None) or run["http"]
    if run["http"]:  # the same for the HTTP gateway: off loopback it needs API keys
        from routing.http.server import api_keys, check_free, check_listen, parse_listen

        keys = api_keys([*(run["api_keys"] or []), *(getattr(args, "api_key", None) or [])],
                        getattr(args, "api_keys_file", None))
        run["api_keys"] = list(keys)
        host, port = parse_listen(run["http"])
        check_listen(host, keys + tuple(tenant_keys(run["tenants"])), bool(run["insecure"]))
        check_free(host, port)
    local = not run["router"] and not run["ray"]
    fusion = build_fusion(params, run["variants"])
    if mode in WORKER_MODES and local:
        # its imports (seconds) overlap what comes before the first worker; it holds the tokenizers
        # of what may load (serve: every variant, at run time too) for each copy it starts
        specs = variant_specs(params).values() if mode == "serve" else [m.spec for m in fusion.models]
        launcher.start_server([s.source for s in specs])
    elif mode == "compile_only":
        # its loads and measurements run in processes forked from the server, whose imports overlap
        # the data's check and the plan made here
        launcher.start_server()
    return params, fusion


def input_jobs(mode: str, params: dict, fusion):
    """predict's and eval's jobs (their outputs' directory made), compile_only's first batches: the
    data read and checked before anything waits on the fork server or imports torch (a bad row is
    named in a moment, not after those imports)."""
    run = params["runconfig"]
    if mode == "compile_only":
        from fusion.compile import first_batches

        return first_batches(fusion)
    if mode in ("predict", "infer"):
        from fusion.predict import build_jobs

        jobs = build_jobs(fusion, run["model_dir"], run["inference_steps"], retry_delays=run["retry_delays"])
    elif mode == "eval":
        from fusion.evaluate import build_eval_jobs

        jobs = build_eval_jobs(fusion, run["model_dir"], run["inference_steps"], retry_delays=run["retry_delays"])
    else:
        return None
    writable_dir(run["model_dir"])
    return jobs


def place(mode: str, params: dict, fusion) -> tuple[object, object]:
    """The plan, and (validate_only and local serve) the catalog of what can load at run time."""
    from fusion.deploy import variant_specs

    run = params["runconfig"]
    local = not run["router"] and not run["ray"]
    if local:  # what a worker here would load: named here, not by a worker's failed load seconds later
        from workers.weights.sources import check_context, check_source

        specs = variant_specs(params).values() if mode in ("serve", "validate_only") else [m.spec for m in fusion.models]
        for source, max_model_len in dict.fromkeys((s.source, s.max_model_len) for s in specs):  # serve: any variant
            check_source(source)
            check_context(source, max_model_len)
    plan_args = (fusion, run["num_workers"], run["devices"], run["threads_per_worker"], run["kv_cache_memory"])
    if mode in ("predict", "infer", "eval") and run["router"]:
        plan = None  # the router's workers are already placed
    elif mode in ("predict", "infer", "eval") and local:
        # planned where torch is imported already: this process only starts workers and sends requests
        plan = launcher.call_in_server("fusion.plan:plan_to_read_without_torch", *plan_args)
    else:
        # torch, the model sources: serve sizes copies at run time
        from fusion.plan import local_plan, make_plan

        # workers that start here need the devices here (on Ray or behind another router, the cluster's)
        plan = (local_plan if local else make_plan)(*plan_args)
    if plan is not None and local and mode in (*WORKER_MODES, "validate_only"):
        from fusion.gpu_sharing import decide

        decide(run["gpu_sharing"], plan)  # an `mps` that cannot be is refused here, before anything starts
    catalog = None
    if mode in ("validate_only", "serve") and not run["router"]:
        from fusion.catalog import make_catalog

        catalog = make_catalog(fusion, plan, variant_specs(params), run)
    return plan, catalog


def serve(params: dict, fusion, plan, catalog) -> int:
    run = params["runconfig"]
    raise_open_files()  # the router's clients, a connection a file
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(plan.describe())
    with deployment(fusion, plan, run, catalog) as dep:
        print(f"serving: clients connect to {dep.frontend} (workers: {dep.router.backend_addr})", flush=True)
        if dep.config.curve_keys:
            print(f"serving: CurveZMQ keys in {dep.config.curve_keys}: clients connect with "
                  f"--curve-keys {dep.config.curve_keys} (keypair 'client')", flush=True)
        gateway = None
        if run["http"]:
            from routing.http.process import GatewayProcess

            gateway = GatewayProcess(dep.frontend, run["http"], tuple(run["api_keys"] or ()), dep.config.curve_keys,
                                     bool(run["insecure"]), tenant_keys=tenant_keys(run["tenants"])).start()
            print(f"serving: OpenAI-compatible HTTP at {gateway.url}/v1", flush=True)
        try:
            while not stop.wait(0.5):
                if gateway is not None:
                    gateway.check()  # a Ctrl-C reaches it too: this loop has ended before it could restart
        finally:
            if gateway is not None:
                gateway.stop()
    print("stopped", flush=True)  # every worker was told to shut down and has exited
    return 0


def deployment(fusion, plan, run: dict, catalog=None):
    """The router and its workers: local processes (a LocalDeployment), or Ray actors with --ray.
    `catalog` (serve): the models it may load and unload at run time."""
    from fusion.local import LocalDeployment

    if run.get("ray"):
        from fusion.ray_cluster import RayDeployment

        return RayDeployment.from_runconfig(fusion, plan, run, catalog)
    return LocalDeployment.from_runconfig(fusion, plan, run, catalog)


def _against_router(params: dict, fusion, plan, work):
    """Return work(frontend, client_kw), run against the configured router or a local one with its workers."""
    run = params["runconfig"]
    if run["router"]:
        return work(run["router"], {"curve_keys": run["curve_keys"]} if run["curve_keys"] else {})
    with deployment(fusion, plan, run) as dep:
        dep.wait_loaded()
        return work(dep.frontend, dep.client_kw())


def predict(params: dict, fusion, plan, jobs: list) -> int:
    from fusion.predict import HDF5Job, run_predict

    _, summary = _against_router(params, fusion, plan, lambda fe, kw: run_predict(fe, jobs, client_kw=kw))
    for line in summary:
        print(line, flush=True)
    failed = sum(j.failed for j in jobs)
    refused = sum(j.refused for j in jobs if isinstance(j, HDF5Job))
    for j in jobs:
        print(f"outputs: {j.output}", flush=True)
    if refused:
        print(f"error: {refused} HDF5 rows were refused for their data (see above); their batches are written once "
              "those rows are fixed and the same command is run again", file=sys.stderr)
    if failed:
        print(f"error: {failed} batches or lines failed for a transient reason (see above); rerun the same command "
              "to finish them", file=sys.stderr)
    return 1 if failed or refused else 0


def evaluate(params: dict, fusion, plan, jobs: list) -> int:
    from fusion.evaluate import run_eval

    for line in _against_router(params, fusion, plan, lambda fe, kw: run_eval(fe, jobs, client_kw=kw)):
        print(line, flush=True)
    failed = sum(j.failed for j in jobs)
    if failed:
        print(f"error: {failed} samples failed for a transient reason (see above); rerun the same command to "
              "score them", file=sys.stderr)
        return 1
    return 0


def compile_models(fusion, plan, batches: dict[str, list]) -> int:
    from fusion.compile import compile_only
    from workers.compile_summary import summary as compile_summary

    print(plan.describe(), flush=True)
    reports, devices = compile_only(fusion, plan, batches)
    for r in reports:
        before = f"{r.load_s_before_cache:.1f}s before the cache, " if r.load_s_before_cache is not None else ""
        print(f"{r.variant} ({r.source}, {r.dtype} on {r.device}): start {before}{r.load_s:.1f}s"
              f"{' from ' + r.cache if r.cache else ''}; batch of {r.batch_size} x {r.max_tokens} tokens in "
              f"{r.batch_s}s; measured {r.measured_bytes / 2**20:.0f} MiB (estimated {r.estimated_bytes / 2**20:.0f}"
              f" MiB); {'fits' if r.fits else 'DOES NOT FIT: ' + str(r.error)}; {compile_summary(r.compile)}", flush=True)
        print(json.dumps(r.as_dict()), flush=True)
    for d in devices:
        print(json.dumps(d), flush=True)
    return 0 if all(d["fits"] for d in devices) else 1


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:  # Ctrl-C: the deployment stopped its workers on the way here
        print("interrupted" + ("; what finished is kept, and the same command goes on from there"
                               if args.mode in RESUMABLE else ""), file=sys.stderr, flush=True)
        return 130
    finally:
        launcher.stop_server()  # every worker has exited: its fork server would otherwise linger


def kernel_lines(plan) -> list[str]:
    """What validate_only says of the kernels a worker measures at load on a CPU: the quantized
    linears' by the step's rows (workers.engine.cpu.row_kernels) and the prompt chunks' attention
    (workers.engine.cpu.prefill_route). What an earlier load on this machine picked for the same
    model, precision, threads and batch is shown; a quantized worker not measured yet says when it
    will be."""
    from workers import kernel_notes
    from workers.devices import device_kind

    lines = []
    for w in plan.workers:
        if w.precision is None or not device_kind(w.device).host:
            continue
        known = kernel_notes.planned(w.spec, w.precision)
        if known:
            lines.append(f"  worker {w.worker_id}: " + "; ".join(f"{k}: {v}" for k, v in known.items()))
        elif w.precision.quantized:
            lines.append(f"  worker {w.worker_id}: measured at its first load on this CPU (its log and status show "
                         "the choice)")
    head = ("kernels measured at load (quantized linears by the step's rows: blocks, a GEMM on widened weights, "
            "AMX tiles on packed ones, or a float32 GEMM on values widened once; prefill attention by the chunk's size):")
    return [head, *lines] if lines else []


def run(args) -> int:
    try:
        params, fusion = configure(args)
        jobs = input_jobs(args.mode, params, fusion)
        plan, catalog = place(args.mode, params, fusion)
    except (ParamsError, ValueError) as exc:  # DataError, bad data, among them
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.mode == "validate_only":
        print(plan.describe())
        print("\n".join(kernel_lines(plan)))
        if not params["runconfig"]["ray"]:
            from fusion.gpu_sharing import decide

            print(decide(params["runconfig"]["gpu_sharing"], plan).describe())
        if catalog is not None:
            print("\n".join(catalog.placer.describe(catalog.specs)))
        return 0
    try:
        if args.mode == "serve":
            return serve(params, fusion, plan, catalog)
        if args.mode in ("predict", "infer"):
            return predict(params, fusion, plan, jobs)
        if args.mode == "eval":
            return evaluate(params, fusion, plan, jobs)
        return compile_models(fusion, plan, jobs)
    except (DataError, SecurityError, GatewayError) as exc:  # bad input: nothing ran
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, zmq.ZMQError) as exc:  # workers that never came up, an address taken
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # an output that cannot be written (a full disk, its directory gone)
        where = exc.filename or (f"writing under {params['runconfig']['model_dir']}" if args.mode in RESUMABLE else "")
        where = f" ({where})" if where else ""
        kept = "; what finished is kept, and the same command goes on from there" if args.mode in RESUMABLE else ""
        print(f"error: {exc.strerror or exc}{where}{kept}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
