"""The deployment plan: which worker serves which model on which device, and whether it fits.

Worker k serves model ID k mod M. Workers go round-robin over the devices; on CPU the workers of
a device split its cores as torch threads. Workers sharing a device split its batch capacity in
proportion to their models' deltat_scaling_factor. Each worker gets a KV cache budget: its
model's `kv_cache_memory`, else the runconfig's; `auto` shares KV_AUTO_SHARE of the device's
available memory, less the weights and process overheads planned there, among its workers, and
never more than max_batch_size sequences of max_model_len tokens can use. Memory per device is the
weights plus the KV budgets plus a process overhead per worker, checked before any load. Copies of
one (source, dtype) on a CPU device that share their weights (`share_weights`, the default:
workers.weights.shared) count the weights once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from fusion.model_info import MultiModelFusion
from workers.config_keys import KV_AUTO_SHARE, model_value, parse_size
from workers.precision import FP16, ONEDNN, Precision, precision
from workers.weights.sources import lean_source, resolve_dtype

# parameters and KV bytes per token (at 2 bytes) of the embedded models, to plan without loading
KNOWN = {"smollm2-135m": (134.5e6, 30 * 2 * 3 * 64 * 2), "gemma3-270m": (268e6, 18 * 2 * 1 * 256 * 2)}
# the context assumed for the KV estimate of a model whose own is unknown before loading
DEFAULT_CTX = 2048
# a worker process before its model (interpreter, torch, transformers, zmq), as PSS when several
# run together: measured by bench/memory.py
OVERHEAD_BYTES = 280 * 2**20
# GPU memory of a CUDA worker beyond its weights and KV pool (the CUDA context, cuBLAS workspaces,
# the step's activations and logits in the caching allocator), and of a weight owner beyond the
# weights (its context): measured by bench/gpu.py (H100, torch 2.11, SmolLM2 at 512 batch tokens)
CUDA_WORKER_OVERHEAD_BYTES = 960 * 2**20
CUDA_OWNER_OVERHEAD_BYTES = 560 * 2**20
# the KV budget of an `auto` worker where the device's memory is unknown
KV_UNKNOWN_DEVICE_BYTES = 2**30
# less than this for an `auto` worker's KV cache: the device is too full for it
MIN_KV_BYTES = 16 * 2**20


@dataclass(slots=True)
class WorkerPlan:
    worker_id: int
    model_id: int
    device: str
    threads: int | None
    max_batch_size: int
    max_batch_tokens: int
    est_bytes: int  # this worker alone: weights + its packed linears + KV cache + overhead
    weight_bytes: int = 0
    shares_weights: bool = False  # its weights are one mapping with the other copies on its device
    packed_bytes: int = 0  # its own prepacked copy of the linear weights (prepack_weights, CPU)
    kv_cache_bytes: int = 0  # the budget of its KV block pool
    kv_tokens: int | None = None  # the tokens that budget holds (None: the model's shape is known at load)
    block_size: int = 16
    # the cores its threads are bound to (a CPU worker, when the device's workers' threads fit its
    # cores without overlap), as vLLM binds its OpenMP threads: none of them migrates onto another's core
    cpus: list[int] | None = None
    precision: Precision | None = None  # the dtypes its weights, math and KV cache use (workers.precision)


@dataclass(slots=True)
class DeploymentPlan:
    models: list[dict]
    workers: list[WorkerPlan]
    devices: dict[str, dict]  # device -> {"estimated_bytes", "available_bytes"}

    def describe(self) -> str:
        lines = ["models:"]
        lines += [f"  model {m['model_id']}: {m['name']} ({m['source']})" for m in self.models]
        lines.append("workers:")
        lines += [f"  worker {w.worker_id} -> model {w.model_id} on {w.device}"
                  f" (threads {w.threads or 'default'}, max_batch_size {w.max_batch_size},"
                  f" max_batch_tokens {w.max_batch_tokens}, ~{w.est_bytes / 2**20:.0f} MiB"
                  f"{', weights shared' if w.shares_weights else ''}"
                  f"{f', {w.packed_bytes / 2**20:.0f} MiB of prepacked linears of its own' if w.packed_bytes else ''}"
                  f"{f', bound to cores {w.cpus}' if w.cpus else ''})\n"
                  f"    KV cache {w.kv_cache_bytes / 2**20:.0f} MiB in blocks of {w.block_size} tokens, holding "
                  f"{'~' + str(w.kv_tokens) if w.kv_tokens is not None else 'what its shape allows (known at load)'}"
                  " tokens" for w in self.workers]
        lines.append("memory per device:")
        for d, info in self.devices.items():
            avail = info["available_bytes"]
            lines.append(f"  {d}: estimated {info['estimated_bytes'] / 2**20:.0f} MiB"
                         + (f" of {avail / 2**20:.0f} MiB available" if avail else ""))
            for g in info.get("shared_weights", []):
                lines.append(f"    weights of {g['source']} ({g['dtype']}), {g['bytes'] / 2**20:.0f} MiB: counted once, "
                             f"shared by {g['copies']} copies (without sharing: {g['copies'] * g['bytes'] / 2**20:.0f} MiB)"
                             + ("" if d == "cpu" else f"; held by one owner process, ~{CUDA_OWNER_OVERHEAD_BYTES / 2**20:.0f}"
                                " MiB more for its CUDA context"))
        return "\n".join(lines)


def resolve_devices(devices) -> list[str]:
    if devices in (None, "auto"):
        import torch

        n = torch.cuda.device_count()
        return [f"cuda:{i}" for i in range(n)] or ["cpu"]
    if isinstance(devices, str):
        devices = [d.strip() for d in devices.split(",") if d.strip()]
    if not isinstance(devices, list) or not devices:
        raise ValueError(f"devices must be 'auto', 'cpu', 'cuda:N' or a list of them, got {devices!r}")
    for d in devices:
        if not (d == "cpu" or (d.startswith("cuda:") and d[5:].isdigit()) or d == "cuda"):
            raise ValueError(f"devices: {d!r} is not 'cpu' or 'cuda:N'")
    return devices


def available_bytes(device: str) -> int | None:
    if device == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"devices: {device} does not exist: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    # asked in a child process: a CUDA context here would hold ~500 MiB of the GPU for as long as the
    # serving process lives (the router and gateway never use the GPU)
    code = f"import torch; print(torch.cuda.mem_get_info({index})[0])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"could not read the free memory of {device}: {out.stderr.strip()[-500:]}")
    return int(out.stdout.split()[-1])


def worker_overhead(device: str) -> int:
    """Memory of a worker beyond its weights, packed linears and KV pool, on the device's memory."""
    return OVERHEAD_BYTES if device == "cpu" else CUDA_WORKER_OVERHEAD_BYTES


def planned_precision(source: str, dtype: str, device: str, prepack: bool) -> Precision:
    """How a worker will hold and compute this model (workers.precision), decided as its load
    will decide it; a source whose family is unknown before loading counts as the lean forward's
    (its packed linears are counted: the plan errs high)."""
    weights = resolve_dtype(dtype, device, prepack, source)
    lean = prepack and device == "cpu" and lean_source(source) is not False
    return precision(weights, device, lean)


def _bytes(dtype) -> int:
    return dtype.itemsize


def kv_bytes_per_token(source: str, wbytes: int) -> int | None:
    """K and V of one position over all layers at `wbytes` an element, or None when unknown before loading."""
    if source in KNOWN:
        return int(KNOWN[source][1] * wbytes / 2)
    if source.startswith("tiny:"):
        from workers.weights.tiny import TINY_CONFIGS

        cfg = TINY_CONFIGS.get(source.split(":")[1])
        return None if cfg is None else _kv_per_token(cfg, wbytes)
    path = Path(source)
    if path.is_dir() and (path / "config.json").exists():
        cfg = json.loads((path / "config.json").read_text())
        return _kv_per_token(cfg.get("text_config") or cfg, wbytes)
    return None


def _kv_per_token(cfg: dict, wbytes: int) -> int:
    layers = cfg.get("num_hidden_layers") or cfg.get("n_layer") or 12
    hidden = cfg.get("hidden_size") or cfg.get("n_embd") or 768
    heads = cfg.get("num_attention_heads") or cfg.get("n_head") or 12
    kvh = cfg.get("num_key_value_heads") or heads
    return layers * 2 * kvh * (cfg.get("head_dim") or hidden // heads) * wbytes


def weight_bytes(source: str, wbytes: int) -> int:
    """The weights' bytes at `wbytes` a parameter, without loading the model (0 when unknown)."""
    if source in KNOWN:
        return int(KNOWN[source][0] * wbytes)
    if source.startswith("tiny:"):
        return 2 * 2**20
    path = Path(source)
    if path.is_dir():
        return int(sum(f.stat().st_size for f in [*path.glob("*.safetensors"), *path.glob("*.bin")]))
    if path.suffix == ".gguf" and path.exists():
        return int(path.stat().st_size * 4 * wbytes / 2)  # 4-bit blocks unpacked to 16-bit
    return 0


def packed_bytes(weights: int, prec: Precision) -> int:
    """A lean worker's own packed linears (every linear, the LM head included: about all the
    weights), from the weights' bytes: oneDNN's in the compute dtype, FBGEMM's in float16."""
    if prec.linears == ONEDNN:
        return weights * _bytes(prec.compute) // _bytes(prec.weights)
    if prec.linears == FP16:
        return weights * 2 // _bytes(prec.weights)
    return 0


def _kv_budgets(fusion: MultiModelFusion, workers: list[WorkerPlan], avail: int | None, fixed: int) -> None:
    """Give each `auto` worker of one device its share of the memory left for KV caches, never more
    than its limits can use; then the tokens each budget holds."""
    auto = [w for w in workers if w.kv_cache_bytes == 0]
    left = None if avail is None else int(avail * KV_AUTO_SHARE) - fixed - sum(w.kv_cache_bytes for w in workers)
    for w in workers:
        info = fusion.models[w.model_id]
        per_token = kv_bytes_per_token(info.source, _bytes(w.precision.compute))
        ctx = model_value(info.params, "max_model_len") or DEFAULT_CTX
        if w in auto:
            useful = None if per_token is None else per_token * w.max_batch_size * ctx
            share = KV_UNKNOWN_DEVICE_BYTES if left is None else max(0, left // len(auto))
            w.kv_cache_bytes = share if useful is None else min(share, useful)
            if w.kv_cache_bytes < min(MIN_KV_BYTES, useful or MIN_KV_BYTES):
                raise ValueError(f"device {w.device}: no memory left for worker {w.worker_id}'s KV cache after the "
                                 "weights and process overheads planned there; use fewer workers or more devices, "
                                 "or give kv_cache_memory")
        w.kv_tokens = None if per_token is None else w.kv_cache_bytes // per_token


def make_plan(fusion: MultiModelFusion, num_workers: int | None = None, devices="auto",
              threads_per_worker: int | None = None, kv_cache_memory: str | int = "auto") -> DeploymentPlan:
    m = len(fusion.models)
    n = m if num_workers is None else num_workers
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
    if n < m:
        raise ValueError(f"num_workers ({n}) is fewer than the number of models ({m}): every model ID needs at "
                         f"least one worker; use num_workers >= {m} or fewer variants")
    devs = resolve_devices(devices)
    assign = [(k, k % m, devs[k % len(devs)]) for k in range(n)]
    by_dev: dict[str, list[int]] = {}
    for k, _, d in assign:
        by_dev.setdefault(d, []).append(k)
    cores = os.cpu_count() or 1
    workers = []
    for k, mid, dev in assign:
        info = fusion.models[mid]
        p = info.params
        peers = by_dev[dev]
        if dev == "cpu":
            threads = threads_per_worker or max(1, cores // len(peers) + (1 if peers.index(k) < cores % len(peers)
                                                                       else 0))
        else:
            threads = threads_per_worker
        mean_f = sum(fusion.models[j % m].deltat_scaling_factor for j in peers) / len(peers)
        share = info.deltat_scaling_factor / mean_f
        batch = max(1, round(model_value(p, "max_batch_size") * share))
        tokens = max(batch, round(model_value(p, "max_batch_tokens") * share))
        prec = planned_precision(info.source, model_value(p, "dtype"), dev, bool(model_value(p, "prepack_weights")))
        shares = bool(model_value(p, "share_weights"))  # CPU: one mapped file; CUDA: one owner process
        w = WorkerPlan(k, mid, dev, threads, batch, tokens, 0, weight_bytes(info.source, _bytes(prec.weights)), shares,
                       block_size=model_value(p, "kv_block_size"), precision=prec)
        w.packed_bytes = packed_bytes(w.weight_bytes, prec)
        budget = model_value(p, "kv_cache_memory") or kv_cache_memory
        w.kv_cache_bytes = 0 if budget == "auto" else parse_size(budget)
        if w.kv_cache_bytes is None:
            raise ValueError(f"variant {info.name!r}: kv_cache_memory {budget!r} is not a size (e.g. 2GiB, 512MiB) "
                             "or auto")
        workers.append(w)
    dev_info = {}
    for d, ks in by_dev.items():
        groups: dict[tuple, dict] = {}  # (source, dtype) -> the weights its sharing copies hold once
        fixed = 0  # weights and process overheads
        for k in ks:
            w = workers[k]
            fixed += worker_overhead(d) + w.packed_bytes + (0 if w.shares_weights else w.weight_bytes)
            if w.shares_weights:
                info = fusion.models[w.model_id]
                key = (info.source, str(w.precision.weights).removeprefix("torch."))
                g = groups.setdefault(key, {"source": key[0], "dtype": key[1], "bytes": w.weight_bytes, "copies": 0})
                g["copies"] += 1
        # on CUDA the shared weights live in an owner process with a context of its own
        owner = 0 if d == "cpu" else CUDA_OWNER_OVERHEAD_BYTES
        fixed += sum(g["bytes"] + owner for g in groups.values())
        avail = available_bytes(d)
        _kv_budgets(fusion, [workers[k] for k in ks], avail, fixed)
        for k in ks:
            w = workers[k]
            w.est_bytes = w.weight_bytes + w.packed_bytes + w.kv_cache_bytes + worker_overhead(d)
        need = fixed + sum(workers[k].kv_cache_bytes for k in ks)
        if avail is not None and need > avail:
            raise ValueError(f"device {d}: the {len(ks)} workers planned there need ~{need / 2**30:.1f} GiB "
                             f"(weights + KV cache + process overhead) but {avail / 2**30:.1f} GiB is available; "
                             "use fewer workers, a smaller kv_cache_memory, or more devices")
        dev_info[d] = {"estimated_bytes": need, "available_bytes": avail,
                       "shared_weights": [g for g in groups.values() if g["copies"] > 1]}
    _bind_cores([w for w in workers if w.device == "cpu"])
    models = [{"model_id": i, "name": mi.name, "source": mi.source} for i, mi in enumerate(fusion.models)]
    return DeploymentPlan(models, workers, dev_info)


def _bind_cores(workers: list[WorkerPlan]) -> None:
    """Give each CPU worker cores of its own, in order, when their threads fit this process's cores
    without overlap; otherwise leave them unbound (the OS places their threads)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not workers or any(not w.threads for w in workers) or sum(w.threads for w in workers) > len(cores):
        return
    at = 0
    for w in workers:
        w.cpus = cores[at: at + w.threads]
        at += w.threads
