"""Params YAML (variants + runconfig) and `--variants NAME,COUNT` parsing. Errors name file and key."""

from __future__ import annotations

import copy
from dataclasses import fields
from pathlib import Path

import yaml

from routing.dispatch import RouterConfig
from routing.tenants import parse_tenants
from wire import protocol as P
from workers.config_keys import Key, parse_size
from workers.spec import ModelSpec
from workers.validate import is_int, is_number

MAX_RETRIES = 10


def _default(cls, name: str):
    return next(f.default for f in fields(cls) if f.name == name)


RUNCONFIG_KEYS: tuple[Key, ...] = (
    Key("model_dir", "model_dir", "a directory path", "where predict and eval write their outputs"),
    Key("variants", None, "a list of `[NAME, COUNT]` (or `NAME,COUNT` strings), or null",
        "the variants to deploy when `--variants` is not given"),
    Key("num_workers", None, "a positive integer >= the number of model IDs, or null",
        "worker processes; null: one per model ID; more are assigned to model IDs round-robin"),
    Key("devices", "auto", "`auto`, `cpu`, `cuda:N`, or a list of them",
        "where workers run, round-robin; `auto`: every CUDA device, else the CPU. A CUDA device this machine "
        "does not have is refused before anything starts (on Ray, the cluster's devices count)"),
    Key("threads_per_worker", None, "a positive integer, or null",
        "torch threads of each CPU worker; null: the device's cores split among its workers (each bound to cores "
        "of its own when their threads fit the cores). A model fast enough that carrying its tokens to the "
        "clients is a large share of the CPU (thousands of streamed tokens/s on a few cores) serves faster with "
        "one core left to that path (router, output processes, gateway), as vLLM's CPU backend reserves one: "
        "2 cores, a tiny model, 64 streams: 0.47x the engine's rate in-process with 2 threads, 0.73x with 1 "
        "(docs/benchmarks.md)", lambda x: x is None or is_int(x, 1)),
    Key("kv_cache_memory", "auto", "a size (`2GiB`, `512MiB`, a number of bytes), or `auto`",
        "the KV cache pool of each worker whose model sets none; `auto`: half the device's available memory, "
        "less the weights and process overheads planned there, shared among its workers, and never more than "
        "`max_batch_size` sequences of `max_model_len` tokens use (of 2,048 tokens where `max_model_len` is null: "
        "the plan reads no model; a longer request that the pool cannot hold is refused by name)",
        lambda x: x == "auto" or parse_size(x) is not None),
    Key("router", None, "a `tcp://HOST:PORT` address, or null",
        "predict, infer and eval: send the requests to a router that is already running instead of "
        "starting one (serve, which starts its own, refuses it)"),
    Key("frontend", _default(RouterConfig, "frontend"), "a `tcp://HOST:PORT` address (port `*` or 0: any free one)",
        "where a router started here listens for clients"),
    Key("backend", _default(RouterConfig, "backend"), "a `tcp://HOST:PORT` address (port `*` or 0: any free one)",
        "where a router started here listens for workers"),
    Key("inference_steps", None, "a positive integer, or null", "predict: only the first K batches per model",
        lambda x: x is None or is_int(x, 1)),
    Key("curve_keys", None, "a keys directory (`python -m wire.security DIR`), or null",
        "CurveZMQ keys: both router sockets then accept only the authorized keys; needed off loopback"),
    Key("insecure", False, "`true`, `false`", "allow binding the router or the HTTP gateway off loopback "
        "without keys", lambda x: isinstance(x, bool)),
    Key("max_restarts", 5, "an integer >= 0",
        "how many times a crashed worker is started again", lambda x: is_int(x, 0)),
    Key("restart_wait", _default(RouterConfig, "restart_wait"), "a number of seconds >= 0",
        "how long queued requests wait for a model with no live worker before failing with `no_worker`",
        lambda x: is_number(x) and x >= 0),
    Key("memory_budget", None, "a size (`8GiB`, `512MiB`, a number of bytes), `auto`, or null",
        "serve: the memory each device's copies may hold together (weights once per device, packed linears, KV "
        "pools, process overheads); a load that does not fit evicts the least recently used unpinned copies "
        "first. `auto`: the device's available memory when the deployment starts; null: no budget (nothing "
        "is evicted), though a load whose copies would pass the memory the device had available at start is "
        "refused (`no_memory`, naming the figures) rather than started", lambda x: x is None or x == "auto" or parse_size(x) is not None),
    Key("autoload", _default(RouterConfig, "autoload"), "`true`, `false`",
        "serve: a request for a variant with no copy loaded loads one (it waits for it)",
        lambda x: isinstance(x, bool)),
    Key("load_timeout", _default(RouterConfig, "load_timeout"), "a number of seconds > 0",
        "serve: a copy loaded at run time that does not serve within this fails its load, and the requests "
        "waiting for it", lambda x: is_number(x) and x > 0),
    Key("unload_timeout", _default(RouterConfig, "unload_timeout"), "a number of seconds >= 0",
        "serve: an unloaded (or evicted) copy finishes its requests for up to this long; then they fail with "
        "`unloaded`", lambda x: is_number(x) and x >= 0),
    Key("idle_unload_s", _default(RouterConfig, "idle_unload_s"), "a number of seconds > 0, or null",
        "serve: unload an unpinned model that no request has named for this long; null: never",
        lambda x: x is None or (is_number(x) and x > 0)),
    Key("min_resident_s", _default(RouterConfig, "min_resident_s"), "a number of seconds >= 0",
        "serve: a copy serving for less than this is not evicted to make room for a load a request starts (it waits "
        "instead): hysteresis against loads that undo each other", lambda x: is_number(x) and x >= 0),
    Key("max_loads_per_minute", _default(RouterConfig, "max_loads_per_minute"), "a positive integer, or null",
        "serve: past this many loads that requests started in the last minute, a load that would evict a copy waits "
        "(its requests queue) rather than evict; null: no cap. An operator's load is never held back",
        lambda x: x is None or is_int(x, 1)),
    Key("retry_delays", [0.5, 2.0, 8.0], f"a list of at most {MAX_RETRIES} waits in seconds (each 0-3600)",
        "predict and eval: the waits before each resend of a request that failed for a transient reason "
        "(`busy`, `worker_lost`, `no_worker`, `router_lost`, a timeout); `[]` turns resending off"),
    Key("http", None, "`HOST:PORT`, or null", "serve: also start the OpenAI-compatible HTTP gateway there"),
    Key("api_keys", None, "a list of strings, or null",
        "API keys the HTTP gateway accepts (needed off loopback unless `insecure`)"),
    Key("tenants", None, "a mapping of tenant name -> {weight, tokens_per_minute, max_inflight, api_keys}, or null",
        "serve: who shares the models and how (routing/tenants.py): each model's queue serves tenants by `weight` "
        "(tokens, default 1); `tokens_per_minute` and `max_inflight` are optional quotas, over which a request is "
        "refused at once (HTTP 429 with Retry-After); `api_keys` are the gateway keys of the tenant (accepted "
        "besides `api_keys`). A request with no tenant is the `default` tenant's"),
    Key("gpu_sharing", "auto", "`auto`, `mps`, `timeslice`",
        "how workers on one CUDA GPU share it (fusion/gpu_sharing.py): `mps` starts the deployment's own NVIDIA "
        "Multi-Process Service daemon, so their kernels run at once; `timeslice`: the GPU takes them in turns; "
        "`auto`: `mps` where `nvidia-cuda-mps-control` is on PATH and a GPU has two or more workers",
        lambda x: x in ("auto", "mps", "timeslice")),
    Key("ray", None, "`auto`, `HOST:PORT`, `ray://...`, or null", "place the workers as actors on that Ray cluster"),
    Key("placement", "spread", "`spread`, `pack`",
        "Ray: a variant's copies on different nodes where possible (`spread`), or on as few as possible (`pack`)"),
    Key("ray_router_host", None, "a host or IP, or null",
        "Ray: the address actors reach the router at; null: this node's IP as Ray knows it"),
)
INPUT_KEYS: tuple[Key, ...] = (
    Key("data_processor", None, "`GptHDF5MapDataProcessor`, `JsonlCompletions`",
        "the format of the variant's input for predict and eval"),
    Key("data_dir", None, "a directory path", "the input: its single `.h5` file, or every `*.jsonl` in it"),
    Key("batch_size", 8, "a positive integer",
        "HDF5: rows per output batch (`predictions_X.npz`); JSONL and eval: requests in flight per variant; "
        "compile_only: the size of its test batch"),
)
RUNCONFIG_DEFAULTS = {k.name: k.default for k in RUNCONFIG_KEYS}
INPUT = {k.name: k for k in INPUT_KEYS}


def input_value(inference_input: dict | None, name: str):
    """A variant's `inference_input` value for `name`: its own, else the table's default."""
    inp = inference_input or {}
    return inp[name] if name in inp else INPUT[name].default


class ParamsError(ValueError):
    pass


def load_params(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"params file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from None
    except RecursionError:  # flow collections nested past the parser's depth
        raise ParamsError(f"{path}: not valid YAML: nested too deeply") from None
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
        try:  # the one check of a model's settings: the spec's
            ModelSpec.from_params(name, model)
        except ValueError as exc:
            raise ParamsError(f"{where}.{exc}") from None
    run = copy.deepcopy(RUNCONFIG_DEFAULTS)
    given = data.get("runconfig") or {}
    if not isinstance(given, dict):
        raise ParamsError(f"{path}: 'runconfig' must be a mapping")
    unknown = sorted(set(given) - set(RUNCONFIG_DEFAULTS))
    if unknown:
        raise ParamsError(f"{path}: runconfig.{unknown[0]}: unknown key; known keys: {sorted(RUNCONFIG_DEFAULTS)}")
    run.update(given)
    check_runconfig(run, given, lambda name: f"{path}: runconfig.{name}")
    if run["placement"] not in ("spread", "pack"):
        raise ParamsError(f"{path}: runconfig.placement must be spread or pack, got {run['placement']!r}")
    delays = run["retry_delays"]
    if not (isinstance(delays, list) and len(delays) <= MAX_RETRIES and all(
            is_number(d) and 0 <= d <= 3600 for d in delays)):
        raise ParamsError(f"{path}: runconfig.retry_delays must be a list of at most {MAX_RETRIES} waits in seconds "
                          f"(each 0-3600), e.g. [0.5, 2, 8]; [] turns resending off; got {delays!r}")
    run["retry_delays"] = tuple(float(d) for d in delays)
    try:
        if run["tenants"] is not None:
            run["tenants"] = parse_tenants(run["tenants"])
    except ValueError as exc:
        raise ParamsError(f"{path}: runconfig.{exc}") from None
    data["runconfig"] = run
    data["_path"] = str(path)
    return data


def check_runconfig(run: dict, names, where) -> None:
    """The runconfig values of `names` (the params file's, or the flags that override them) against
    their keys' checks; `where(name)` says where a value came from."""
    for key in RUNCONFIG_KEYS:
        if key.check is not None and key.name in names and not key.check(run[key.name]):
            raise ParamsError(f"{where(key.name)} must be {key.valid}, got {run[key.name]!r}")


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
        if not 1 <= n <= P.MAX_COPIES:
            raise ParamsError(f"variant {text!r}: count must be from 1 to {P.MAX_COPIES} (a worker process each)")
        if name not in params["variants"]:
            raise ParamsError(f"variant {name!r} is not in {where}; known: {sorted(params['variants'])}")
        out.append((name, n))
    return out
