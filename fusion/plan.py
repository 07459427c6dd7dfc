"""The deployment plan: which worker serves which model on which device, and whether it fits.

Worker k serves model ID k mod M. Workers go round-robin over the devices; on CPU the workers of
a device split its cores as torch threads. Workers sharing a device split its batch capacity in
proportion to their models' deltat_scaling_factor. Memory per device is estimated from the
weights plus the KV cache budget (max_batch_size x max_model_len) plus a process overhead per
worker, and checked before any load. Copies of one (source, dtype) on a CPU device that share
their weights (`share_weights`, the default: workers.weights.shared) count the weights once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from fusion.model_info import MultiModelFusion
from workers.config_keys import model_value

BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "auto": 2}
# parameters and KV bytes per token (at 2 bytes) of the embedded models, to plan without loading
KNOWN = {"smollm2-135m": (134.5e6, 30 * 2 * 3 * 64 * 2), "gemma3-270m": (268e6, 18 * 2 * 1 * 256 * 2)}
# the context assumed for the KV estimate of a model whose own is unknown before loading
DEFAULT_CTX = 2048
# a worker process before its model (interpreter, torch, transformers, zmq), as PSS when several
# run together: measured by bench/memory.py
OVERHEAD_BYTES = 280 * 2**20


@dataclass(slots=True)
class WorkerPlan:
    worker_id: int
    model_id: int
    device: str
    threads: int | None
    max_batch_size: int
    max_batch_tokens: int
    est_bytes: int  # this worker alone: weights + KV cache + overhead
    weight_bytes: int = 0
    shares_weights: bool = False  # its weights are one mapping with the other copies on its device


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
                  f"{', weights shared' if w.shares_weights else ''})" for w in self.workers]
        lines.append("memory per device:")
        for d, info in self.devices.items():
            avail = info["available_bytes"]
            lines.append(f"  {d}: estimated {info['estimated_bytes'] / 2**20:.0f} MiB"
                         + (f" of {avail / 2**20:.0f} MiB available" if avail else ""))
            for g in info.get("shared_weights", []):
                lines.append(f"    weights of {g['source']} ({g['dtype']}), {g['bytes'] / 2**20:.0f} MiB: counted once, "
                             f"shared by {g['copies']} copies (without sharing: {g['copies'] * g['bytes'] / 2**20:.0f} MiB)")
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
    return torch.cuda.mem_get_info(torch.device(device))[0]


def estimate_parts(source: str, dtype: str, max_batch_size: int, max_model_len: int) -> tuple[int, int]:
    """(weight bytes, full KV cache bytes), without loading the model."""
    wbytes = BYTES.get(dtype, 2)
    if source in KNOWN:
        n_params, kv_per_token = KNOWN[source]
        return int(n_params * wbytes), int(kv_per_token * wbytes / 2 * max_batch_size * max_model_len)
    if source.startswith("tiny:"):
        return 2 * 2**20, 14 * 2**20
    path = Path(source)
    if path.is_dir() and (path / "config.json").exists():
        cfg = json.loads((path / "config.json").read_text())
        files = list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
        weights = sum(f.stat().st_size for f in files)
        layers = cfg.get("num_hidden_layers") or cfg.get("n_layer") or 12
        hidden = cfg.get("hidden_size") or cfg.get("n_embd") or 768
        heads = cfg.get("num_attention_heads") or cfg.get("n_head") or 12
        kvh = cfg.get("num_key_value_heads") or heads
        kv = layers * 2 * kvh * (hidden // heads) * wbytes
        return int(weights), int(kv * max_batch_size * max_model_len)
    if path.suffix == ".gguf" and path.exists():
        return int(path.stat().st_size * 4 * wbytes / 2), 0  # 4-bit blocks unpacked to 16-bit
    return 0, 0


def estimate_bytes(source: str, dtype: str, max_batch_size: int, max_model_len: int) -> int:
    """Weights plus a full KV cache, without loading the model."""
    return sum(estimate_parts(source, dtype, max_batch_size, max_model_len))


def make_plan(fusion: MultiModelFusion, num_workers: int | None = None, devices="auto",
              threads_per_worker: int | None = None) -> DeploymentPlan:
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
        weights, kv = estimate_parts(info.source, model_value(p, "dtype"), batch,
                                     model_value(p, "max_model_len") or DEFAULT_CTX)
        shares = bool(model_value(p, "share_weights"))  # CPU: one mapped file; CUDA: one owner process
        workers.append(WorkerPlan(k, mid, dev, threads, batch, tokens, weights + kv + OVERHEAD_BYTES, weights,
                                  shares))
    dev_info = {}
    for d, ks in by_dev.items():
        groups: dict[tuple, dict] = {}  # (source, dtype) -> the weights its sharing copies hold once
        need = 0
        for k in ks:
            w = workers[k]
            need += w.est_bytes - (w.weight_bytes if w.shares_weights else 0)
            if w.shares_weights:
                info = fusion.models[w.model_id]
                key = (info.source, model_value(info.params, "dtype"))
                g = groups.setdefault(key, {"source": key[0], "dtype": key[1], "bytes": w.weight_bytes, "copies": 0})
                g["copies"] += 1
        need += sum(g["bytes"] for g in groups.values())
        avail = available_bytes(d)
        if avail is not None and need > avail:
            raise ValueError(f"device {d}: the {len(ks)} workers planned there need ~{need / 2**30:.1f} GiB "
                             f"(weights + KV cache + process overhead) but {avail / 2**30:.1f} GiB is available; "
                             "use fewer workers, smaller max_batch_size/max_model_len, or more devices")
        dev_info[d] = {"estimated_bytes": need, "available_bytes": avail,
                       "shared_weights": [g for g in groups.values() if g["copies"] > 1]}
    models = [{"model_id": i, "name": mi.name, "source": mi.source} for i, mi in enumerate(fusion.models)]
    return DeploymentPlan(models, workers, dev_info)
