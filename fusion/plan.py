"""The deployment plan: which worker serves which model on which device, and whether it fits.

Worker k serves model ID k mod M. Workers go round-robin over the devices; on CPU the workers of
a device split its cores as torch threads. Workers sharing a device split its batch capacity in
proportion to their models' deltat_scaling_factor. Each worker gets a KV cache budget: its
model's `kv_cache_memory`, else the runconfig's; `auto` shares KV_AUTO_SHARE of the device's
available memory, less the weights and process overheads planned there, among its workers, and
never more than max_batch_size sequences of max_model_len tokens (DEFAULT_CTX where it is null)
can use. Memory per device is the weights plus the KV budgets plus a process overhead per worker,
checked before any load. Copies of one (source, dtype) on a CPU device that share their weights
(`share_weights`, the default: workers.weights.shared) count the weights once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fusion.model_info import MultiModelFusion
from workers.config_keys import KV_AUTO_SHARE, parse_size
from workers.devices import (
    CPU_WORKER_OVERHEAD_BYTES,
    absent_devices,
    available_bytes,
    device_kind,
    resolve_devices,
)
from workers.spec import ModelSpec, WorkerSpec

if TYPE_CHECKING:  # torch: imported where a plan is made, not where one is read (fusion.launcher.call_in_server)
    from workers.precision import Precision

# parameters and KV bytes per token (at 2 bytes) of the embedded models, to plan without loading
# (parameters, KV values a token, embedding parameters) of the embedded models
KNOWN = {"smollm2-135m": (134.5e6, 30 * 2 * 3 * 64 * 2, 49152 * 576),
         "gemma3-270m": (268e6, 18 * 2 * 1 * 256 * 2, 262144 * 640)}
# the context assumed for the KV estimate of a model whose own is unknown before loading
DEFAULT_CTX = 2048
# a CPU worker process before its model (a CUDA worker's and a weight owner's: workers.devices)
OVERHEAD_BYTES = CPU_WORKER_OVERHEAD_BYTES
# the KV budget of an `auto` worker where the device's memory is unknown
KV_UNKNOWN_DEVICE_BYTES = 2**30
# less than this for an `auto` worker's KV cache: the device is too full for it
MIN_KV_BYTES = 16 * 2**20


@dataclass(slots=True)
class WorkerPlan:
    """One planned worker: what it runs and where (`spec`, sent to it at ASSIGN), and what it holds."""

    worker_id: int
    spec: WorkerSpec
    weight_bytes: int = 0
    shares_weights: bool = False  # its weights are one mapping with the other copies on its device
    packed_bytes: int = 0  # its own prepacked copy of the linear weights (prepack_weights, CPU)
    # weight-only quantized linears mapped from one file that its sharing copies on the device hold
    # once (workers.weights.quantized_cache), counted per (source, dtype) group like the weights
    shared_packed_bytes: int = 0
    # the same linears laid out for the many-rows ways of the row kernels (batch_layouts): packed in
    # bfloat16 pairs (AMX tiles, or vdpbf16ps), and widened to float32 on a bfloat16 CPU without AMX.
    # A mapped file each, counted whole (the most it can hold), or not at all where an earlier load on
    # this machine with the same settings chose that way for none of the linears (batch_file_needed)
    shared_batch_bytes: int = 0
    kv_tokens: int | None = None  # the tokens its KV budget holds (None: the model's shape is known at load)
    precision: Precision | None = None  # the dtypes its weights, math and KV cache use (workers.precision)

    @property
    def model_id(self) -> int:
        return self.spec.model_id

    @property
    def device(self) -> str:
        return self.spec.device

    @property
    def threads(self) -> int | None:
        return self.spec.threads

    @property
    def cpus(self) -> list[int] | None:
        return None if self.spec.cpus is None else list(self.spec.cpus)

    @property
    def max_batch_size(self) -> int:
        return self.spec.batch_size

    @property
    def max_batch_tokens(self) -> int:
        return self.spec.batch_tokens

    @property
    def kv_cache_bytes(self) -> int:
        return self.spec.kv_cache_bytes or 0

    @property
    def block_size(self) -> int:
        return self.spec.model.kv_block_size

    @property
    def fixed_bytes(self) -> int:
        """Its process and packed linears, and its weights unless they are shared (counted per group)."""
        return worker_overhead(self.device) + self.packed_bytes + (0 if self.shares_weights else self.weight_bytes)

    @property
    def est_bytes(self) -> int:
        """This worker alone: weights + its packed linears + KV cache + overhead."""
        return (self.weight_bytes + self.packed_bytes + self.shared_packed_bytes + self.shared_batch_bytes
                + self.kv_cache_bytes + worker_overhead(self.device))


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
            owner = device_kind(d).owner_overhead
            for g in info.get("shared_weights", []):
                lines.append(f"    weights of {g['source']} ({g['dtype']}), {g['bytes'] / 2**20:.0f} MiB: counted once, "
                             f"shared by {g['copies']} copies (without sharing: {g['copies'] * g['alone'] / 2**20:.0f} MiB)"
                             + (f"; held by one owner process, ~{owner / 2**20:.0f} MiB more for its context"
                                if device_kind(d).owner_shares_weights else "")
                             + "".join(f"; its {kind} linears, {b / 2**20:.0f} MiB, counted once (in place of"
                                       " its 16-bit linears, which "
                                       + ("the owner lets go)" if device_kind(d).owner_shares_weights
                                          else "the copies do not keep)")
                                       for kind, b in g.get("quantized_bytes", {}).items())
                             + (f"; its linears {g['batch_layout']}, {g['batch_bytes'] / 2**20:.0f} MiB,"
                                " counted once (read where the measured choice takes them)" if g.get("batch_bytes") else ""))
        return "\n".join(lines)


def worker_overhead(device: str) -> int:
    """Memory of a worker beyond its weights, packed linears and KV pool, on the device's memory."""
    return device_kind(device).worker_overhead


def planned_precision(source: str, dtype: str, device: str, prepack: bool, quantization: str = "none") -> Precision:
    """How a worker will hold and compute this model (workers.precision), decided by its platform as
    its load will decide it (workers.platform.for_source)."""
    from workers.platform import for_source

    return for_source(source, dtype, device, prepack, quantization).precision


def _bytes(dtype) -> int:
    return dtype.itemsize


def kv_bytes_per_token(source: str, wbytes: int) -> int | None:
    """K and V of one position over all layers at `wbytes` an element, or None when unknown before loading."""
    if source in KNOWN:
        return int(KNOWN[source][1] * wbytes / 2)
    if source.startswith("tiny:"):
        from workers.weights.tiny_configs import TINY_CONFIGS

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


def kept_dense_bytes(source: str, wbytes: int, weights: int) -> int:
    """Of a model's 16-bit weights, those its quantized copies keep: the embedding (and the norms,
    next to nothing). On a CPU they let their view of the shared 16-bit linears go once the
    quantized linears serve (workers/engine/cpu/runner.py), and those pages stay only in the page
    cache, which the OS reclaims; on a GPU the weight owner does not keep them, and a worker holding
    its own weights lets them go on either (workers.weights.blocks_only). All of `weights` where the
    model's shape is unknown."""
    if source in KNOWN:
        return min(weights, int(KNOWN[source][2] * wbytes))
    return weights


def packed_bytes(weights: int, prec: Precision) -> int:
    """A lean worker's own packed linears (every linear, the LM head included: about all the
    weights), from the weights' bytes: oneDNN's in the compute dtype, FBGEMM's in float16,
    weight-only quantized blocks. A GPU's fused q/k/v and gate/up linears are none: they are views
    of the weights, laid out side by side (workers.weights.fused_layout)."""
    from workers.precision import FP16, FUSED, ONEDNN
    from workers.quant.formats import BLOCK, quant_format

    if prec.quantized:  # blocks of BLOCK values, at the bytes the format's row counts a block
        return weights // _bytes(prec.weights) * quant_format(prec.quantization).plan_block_bytes // BLOCK
    if prec.linears == FUSED:  # a GPU's fused q/k/v and gate/up: views of the weights (fused_layout)
        return 0
    if prec.linears == ONEDNN:
        return weights * _bytes(prec.compute) // _bytes(prec.weights)
    if prec.linears == FP16:
        return weights * 2 // _bytes(prec.weights)
    return 0


def batch_layouts(device: str, prec: Precision) -> list[tuple[str, str, int]]:
    """The files of values a CPU worker's quantized linears may read at many rows: for each, the row
    kernels' way that reads it, its words and bytes a value. Where bfloat16 math has dot products for
    it (AMX tiles, or AVX512-BF16's vdpbf16ps), bfloat16 packed in pairs (workers.engine.cpu.linears.
    tiles_fit); without AMX tiles, also float32 (linears.float32_fits); none where the math is not
    bfloat16."""
    import torch

    from workers.capability import cpu_capability
    from workers.engine.cpu.row_kernels import FLOAT32, PACKED

    if not (device_kind(device).host and prec.quantized and prec.compute == torch.bfloat16):
        return []
    if cpu_capability().at_least("amx"):
        return [(PACKED, "packed for AMX tiles (bfloat16)", 2)]
    return [(PACKED, "packed in bfloat16 pairs", 2), (FLOAT32, "widened to float32", 4)]


def batch_file_needed(spec: WorkerSpec, prec: Precision, way: str) -> bool:
    """Whether a worker may read the linears laid out for `way`: false only where an earlier load
    on this machine with the same model, precision, threads and batch chose it for none of them
    (workers.kernel_notes: a CPU whose 16-bit ways win, such as AMD's Zen 4 against float32, then
    writes no such file); true where no load has measured it yet."""
    from workers import kernel_notes

    known = kernel_notes.planned(spec, prec)
    return known is None or kernel_notes.takes(known, way)


def _shared_groups(workers: list[WorkerPlan], device: str) -> dict[tuple, dict]:
    """(source, dtype) -> the weights its sharing copies on `device` hold once: on a GPU, one owner
    process per quantization too (fusion.owners: one holding blocks lets the 16-bit linears go)."""
    groups: dict[tuple, dict] = {}
    owners = device_kind(device).owner_shares_weights
    for w in workers:
        if w.device == device and w.shares_weights:
            key = (w.spec.model.source, str(w.precision.weights).removeprefix("torch."))
            if owners:
                key += (w.precision.quantized_key,)  # "none" where it runs no blocks
            # without sharing, each copy holds its own quantized linears and the weights its blocks
            # leave (its engine lets the 16-bit weights of its blocks go)
            alone = w.weight_bytes + w.shared_packed_bytes
            g = groups.setdefault(key, {"source": key[0], "dtype": key[1], "bytes": 0, "copies": 0,
                                        "quantized_bytes": {}, "batch_bytes": 0, "alone": alone,
                                        "batch_layout": " or ".join(words for _, words, _ in
                                                                    batch_layouts(device, w.precision))})
            g["bytes"] = max(g["bytes"], w.weight_bytes)  # a copy without blocks reads all of them
            g["copies"] += 1
            if w.shared_packed_bytes:  # one file per quantization kind beside the weights
                g["quantized_bytes"][w.precision.quantization] = w.shared_packed_bytes
                g["batch_bytes"] = w.shared_batch_bytes
    return groups


def device_fixed_bytes(workers: list[WorkerPlan], device: str) -> int:
    """The weights and process overheads of the workers planned on `device` (shared weights once;
    on CUDA each group's owner process adds its context)."""
    owner = device_kind(device).owner_overhead
    return (sum(w.fixed_bytes for w in workers if w.device == device)
            + sum(g["bytes"] + sum(g["quantized_bytes"].values()) + g["batch_bytes"] + owner
                  for g in _shared_groups(workers, device).values()))


def _sized(worker_id: int, model: ModelSpec, model_id: int, device: str, threads: int | None,
           batch_share: float) -> WorkerPlan:
    """A worker before its KV budget and cores: its batch limits, precision and weight bytes."""
    batch = max(1, round(model.max_batch_size * batch_share))
    tokens = max(batch, round(model.max_batch_tokens * batch_share))
    prec = planned_precision(model.source, model.dtype, device, model.prepack_weights, model.quantization)
    spec = WorkerSpec(model, model_id, device, threads, max_batch_size=batch, max_batch_tokens=tokens)
    w = WorkerPlan(worker_id, spec, weight_bytes(model.source, _bytes(prec.weights)), model.share_weights,
                   precision=prec)
    packed = packed_bytes(w.weight_bytes, prec)
    laid = sum(weight_bytes(model.source, per_value) for way, _, per_value in batch_layouts(device, prec)
               if batch_file_needed(spec, prec, way))
    if prec.quantized and w.shares_weights:  # one mapped file on a CPU, one owner's blocks on a GPU
        w.shared_packed_bytes, w.shared_batch_bytes = packed, laid
        w.weight_bytes = kept_dense_bytes(model.source, _bytes(prec.weights), w.weight_bytes)
    else:
        w.packed_bytes = packed + laid
        if prec.quantized:  # its engine lets the 16-bit weights of its blocks go
            w.weight_bytes = kept_dense_bytes(model.source, _bytes(prec.weights), w.weight_bytes)
    return w


def _explicit_kv(model: ModelSpec, kv_cache_memory: str | int) -> int | None:
    """The KV budget the model (else the runconfig) sets in bytes; None for `auto`."""
    budget = model.kv_cache_memory or kv_cache_memory
    if budget == "auto":
        return None
    size = parse_size(budget)
    if size is None:
        raise ValueError(f"variant {model.name!r}: kv_cache_memory {budget!r} is not a size (e.g. 2GiB, 512MiB) "
                         "or auto")
    return size


def place_worker(existing: list[WorkerPlan], model: ModelSpec, model_id: int, device: str, *,
                 threads: int | None = None, batch_share: float = 1.0, kv_cache_memory: str | int = "auto",
                 kv_share: int | None = None, avail: int | None = None, bind: bool = True) -> WorkerPlan:
    """Plan one more worker beside `existing`, which it leaves as they are: its batch limits (its
    model's, times `batch_share`), precision, weights, KV budget and cores.

    An `auto` KV budget is `kv_share` bytes where the caller shared the device out (make_plan),
    else what the device has left after the existing workers; never more than max_batch_size
    sequences of max_model_len tokens use. `bind`: give it the next free cores of the process, if
    its threads fit there and every existing CPU worker is bound."""
    w = _sized(len(existing), model, model_id, device, threads, batch_share)
    per_token = kv_bytes_per_token(model.source, _bytes(w.precision.compute))
    budget = _explicit_kv(model, kv_cache_memory)
    if budget is None:
        if kv_share is None:
            peers = [*existing, w]
            kv_share = KV_UNKNOWN_DEVICE_BYTES if avail is None else max(0, int(avail * KV_AUTO_SHARE) - (
                device_fixed_bytes(peers, device) + sum(p.kv_cache_bytes for p in existing if p.device == device)))
        useful = None if per_token is None else per_token * w.max_batch_size * (model.max_model_len or DEFAULT_CTX)
        budget = kv_share if useful is None else min(kv_share, useful)
        if budget < min(MIN_KV_BYTES, useful or MIN_KV_BYTES):
            raise ValueError(f"device {device}: no memory left for worker {w.worker_id}'s KV cache after the "
                             "weights and process overheads planned there; use fewer workers or more devices, "
                             "or give kv_cache_memory")
    elif per_token is not None and budget < per_token * w.block_size:  # the engine would refuse it at load
        raise ValueError(f"variant {model.name!r}: kv_cache_memory of {budget} bytes holds no KV block "
                         f"({w.block_size} tokens of {per_token} bytes each, {per_token * w.block_size} bytes): "
                         "raise kv_cache_memory, or set it to auto")
    w.kv_tokens = None if per_token is None else budget // per_token
    w.spec = w.spec.placed(kv_cache_bytes=budget, cpus=_free_cores(existing, threads)
                           if bind and device_kind(device).host else None)
    return w


def _free_cores(existing: list[WorkerPlan], threads: int | None) -> tuple[int, ...] | None:
    """The next `threads` cores of this process after those the existing CPU workers are bound to,
    or None where they do not fit or an existing worker floats (it would share them)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cpu = [w for w in existing if device_kind(w.device).host]
    if not threads or any(w.cpus is None for w in cpu):
        return None
    at = sum(len(w.cpus) for w in cpu)
    return tuple(cores[at: at + threads]) if at + threads <= len(cores) else None


def local_plan(fusion: MultiModelFusion, num_workers: int | None, devices, threads_per_worker,
               kv_cache_memory) -> DeploymentPlan:
    """make_plan for workers that start on this machine: a CUDA device it does not have is refused
    here, before anything starts (make_plan alone plans for any devices)."""
    problem = absent_devices(resolve_devices(devices))  # serve's run-time loads go to any of them
    if problem:
        raise ValueError(problem)
    return make_plan(fusion, num_workers, devices, threads_per_worker, kv_cache_memory)


def plan_to_read_without_torch(fusion: MultiModelFusion, num_workers: int | None, devices, threads_per_worker,
                               kv_cache_memory) -> DeploymentPlan:
    """local_plan, for a caller that plans in another process (fusion.launcher.call_in_server) and
    reads the plan back without importing torch: the workers' precision (torch dtypes), which sized
    them, is dropped."""
    plan = local_plan(fusion, num_workers, devices, threads_per_worker, kv_cache_memory)
    for w in plan.workers:
        w.precision = None
    return plan


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
    avail = {d: available_bytes(d) for d in by_dev}
    for d, ks in by_dev.items():  # their processes alone: a count no device holds is refused before sizing each
        floor = len(ks) * worker_overhead(d)
        if avail[d] is not None and floor > avail[d]:
            raise ValueError(f"device {d}: the {len(ks)} workers planned there need at least {floor / 2**30:.1f} GiB "
                             f"for their processes alone, but {avail[d] / 2**30:.1f} GiB is available; use fewer "
                             "workers or more devices")
    cores = os.cpu_count() or 1
    rank = {k: i for ks in by_dev.values() for i, k in enumerate(ks)}  # a worker's place among its device's
    mean_f = {d: sum(fusion.models[j % m].deltat_scaling_factor for j in ks) / len(ks) for d, ks in by_dev.items()}
    placing = []  # (model, model ID, device, threads, batch share) per worker
    for k, mid, dev in assign:
        info = fusion.models[mid]
        peers = len(by_dev[dev])
        if device_kind(dev).host:  # the workers of the host split its cores
            threads = threads_per_worker or max(1, cores // peers + (1 if rank[k] < cores % peers else 0))
        else:
            threads = threads_per_worker
        placing.append((info.spec, mid, dev, threads, info.deltat_scaling_factor / mean_f[dev]))
    # every `auto` worker of a device gets an equal share of what its weights and overheads leave
    shares: dict[str, int] = {}
    for d, ks in by_dev.items():
        sized = [_sized(k, *placing[k]) for k in ks]
        explicit = [_explicit_kv(placing[k][0], kv_cache_memory) for k in ks]
        auto = sum(e is None for e in explicit)
        if avail[d] is None:
            shares[d] = KV_UNKNOWN_DEVICE_BYTES
        elif auto:
            left = int(avail[d] * KV_AUTO_SHARE) - device_fixed_bytes(sized, d) - sum(e or 0 for e in explicit)
            shares[d] = max(0, left // auto)
    cpu_threads = [p[3] for p in placing if device_kind(p[2]).host]
    bind = all(cpu_threads) and sum(cpu_threads) <= len(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                                                         else [])
    workers: list[WorkerPlan] = []
    for model, mid, dev, threads, share in placing:
        workers.append(place_worker(workers, model, mid, dev, threads=threads, batch_share=share,
                                    kv_cache_memory=kv_cache_memory, kv_share=shares.get(dev), avail=avail[dev],
                                    bind=bind))
    dev_info = {}
    for d, ks in by_dev.items():
        need = device_fixed_bytes(workers, d) + sum(workers[k].kv_cache_bytes for k in ks)
        if avail[d] is not None and need > avail[d]:
            raise ValueError(f"device {d}: the {len(ks)} workers planned there need ~{need / 2**30:.1f} GiB "
                             f"(weights + KV cache + process overhead) but {avail[d] / 2**30:.1f} GiB is available; "
                             "use fewer workers, a smaller kv_cache_memory, or more devices")
        dev_info[d] = {"estimated_bytes": need, "available_bytes": avail[d],
                       "shared_weights": [g for g in _shared_groups(workers, d).values() if g["copies"] > 1]}
    models = [{"model_id": i, "name": mi.name, "source": mi.source} for i, mi in enumerate(fusion.models)]
    return DeploymentPlan(models, workers, dev_info)
