"""Params YAML (variants + runconfig) and `--variants NAME,COUNT` parsing. Errors name file and key."""

from __future__ import annotations

from pathlib import Path

import yaml

RUNCONFIG_DEFAULTS = {
    "model_dir": "model_dir",
    "variants": None,
    "num_workers": None,
    "devices": "auto",
    "router": None,
    "frontend": "tcp://127.0.0.1:5555",
    "backend": "tcp://127.0.0.1:5556",
    "inference_steps": None,
    "threads_per_worker": None,
    "curve_keys": None,  # CurveZMQ keys directory (python -m routing.security DIR); needed off loopback
    "insecure": False,  # bind off loopback without CurveZMQ
    "max_restarts": 5,  # a crashed worker is started again at most this many times
    "restart_wait": 30.0,  # seconds queued requests wait for a model with no live worker, then fail (no_worker)
    # predict and eval: seconds to wait before each resend of a request that failed for a transient
    # reason (busy, worker_lost, no_worker, router_lost, a timeout); its length is the number of resends
    "retry_delays": [0.5, 2.0, 8.0],
    "http": None,  # HOST:PORT: serve also starts the OpenAI-compatible HTTP gateway there
    "ray": None,  # a Ray cluster (auto, host:port, ray://...): workers are Ray actors there (fusion.ray_cluster)
    "placement": "spread",  # Ray placement group strategy for the workers: spread | pack
    "ray_router_host": None,  # the address Ray actors reach the router at; default: this node's IP in Ray
    "api_keys": None,  # accepted API keys of the HTTP gateway (needed off loopback, unless insecure)
}
MODEL_KEYS = {"source", "dtype", "start_token", "end_token", "max_tokens", "loop_dim", "temperature", "top_p",
              "top_k", "max_model_len", "max_batch_size", "max_batch_tokens", "deltat_scaling_factor",
              "share_weights", "compile", "compile_buckets", "resources"}


MAX_RETRIES = 10


class ParamsError(ValueError):
    pass


def _check_compile(model: dict, where: str) -> None:
    from workers.compiled import Buckets, compile_mode

    key = "compile"
    try:
        if key in model:
            compile_mode(model[key])
        key = "compile_buckets"
        if model.get(key) is not None:
            Buckets(tuple(model[key]) if isinstance(model[key], list) else model[key])
    except ValueError as exc:
        raise ParamsError(f"{where}.model.{key}: {exc}") from None


def load_params(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"params file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: top level must be a mapping with 'variants' and 'runconfig'")
    variants = data.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise ParamsError(f"{path}: 'variants' must be a non-empty mapping of variant name -> settings")
    for name, v in variants.items():
        where = f"{path}: variants.{name}"
        if not isinstance(v, dict) or not isinstance(v.get("model"), dict):
            raise ParamsError(f"{where}.model must be a mapping")
        model = v["model"]
        if not isinstance(model.get("source"), str):
            raise ParamsError(f"{where}.model.source must name a model source (e.g. smollm2-135m)")
        unknown = sorted(set(model) - MODEL_KEYS)
        if unknown:
            raise ParamsError(f"{where}.model.{unknown[0]}: unknown key; known keys: {sorted(MODEL_KEYS)}")
        _check_compile(model, where)
        res = model.get("resources")
        if res is not None and not (isinstance(res, dict) and all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for k, v in res.items())):
            raise ParamsError(f"{where}.model.resources must map custom Ray resource names to positive amounts, "
                              f"got {res!r}")
    run = dict(RUNCONFIG_DEFAULTS)
    given = data.get("runconfig") or {}
    if not isinstance(given, dict):
        raise ParamsError(f"{path}: 'runconfig' must be a mapping")
    unknown = sorted(set(given) - set(RUNCONFIG_DEFAULTS))
    if unknown:
        raise ParamsError(f"{path}: runconfig.{unknown[0]}: unknown key; known keys: {sorted(RUNCONFIG_DEFAULTS)}")
    run.update(given)
    if run["placement"] not in ("spread", "pack"):
        raise ParamsError(f"{path}: runconfig.placement must be spread or pack, got {run['placement']!r}")
    delays = run["retry_delays"]
    if not (isinstance(delays, list) and len(delays) <= MAX_RETRIES and all(
            isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d <= 3600 for d in delays)):
        raise ParamsError(f"{path}: runconfig.retry_delays must be a list of at most {MAX_RETRIES} waits in seconds "
                          f"(each 0-3600), e.g. [0.5, 2, 8]; [] turns resending off; got {delays!r}")
    run["retry_delays"] = tuple(float(d) for d in delays)
    data["runconfig"] = run
    data["_path"] = str(path)
    return data


def parse_variants(specs, params: dict) -> list[tuple[str, int]]:
    """['a,2', 'b'] or [['a', 2]] -> [('a', 2), ('b', 1)], checked against the params' variants."""
    where = params.get("_path", "params")
    if specs is None:
        raise ParamsError(f"{where}: no variants: give --variants NAME,COUNT ... or runconfig.variants")
    if isinstance(specs, (list, tuple)) and len(specs) == 2 and isinstance(specs[1], int):
        specs = [f"{specs[0]},{specs[1]}"]  # YAML shorthand `variants: [name, 2]`
    out = []
    for spec in specs:
        text = ",".join(map(str, spec)) if isinstance(spec, (list, tuple)) else str(spec)
        name, _, count = text.partition(",")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise ParamsError(f"variant {text!r}: count must be an integer (NAME,COUNT)") from None
        if n < 1:
            raise ParamsError(f"variant {text!r}: count must be >= 1")
        if name not in params["variants"]:
            raise ParamsError(f"variant {name!r} is not in {where}; known: {sorted(params['variants'])}")
        out.append((name, n))
    return out
