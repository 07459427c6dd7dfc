"""What a serving deployment can load at run time: every variant of its params, the memory budget
of each device, and how big a copy of each is before it loads (routing.lifecycle's Catalog and
Placer, built from the plan's own sizing, fusion.plan.place_worker).

A copy's size is fixed before it loads: its weights (shared copies' weights once per device), its
own packed linears, its KV pool and its process overhead. With a budget, an `auto` KV pool is a
fixed share of the budget (KV_BUDGET_SHARE, never more than max_batch_size sequences of
max_model_len tokens use), so it never depends on what happens to be loaded; without one, it is
sized as the plan sizes a worker alone on the device, from the memory available at start.
"""

from __future__ import annotations

import os

from fusion.model_info import MultiModelFusion
from fusion.plan import DeploymentPlan, WorkerPlan, available_bytes, place_worker, worker_overhead
from routing.lifecycle import Catalog
from routing.residency import CopySize, Residency, Resident, mib
from workers.config_keys import parse_size
from workers.devices import device_kind
from workers.spec import ModelSpec, WorkerSpec

# with a memory_budget, an `auto` KV pool of a copy is at most this share of its device's budget
KV_BUDGET_SHARE = 0.125


def budgets(memory_budget, devices: list[str]) -> dict[str, int | None]:
    """Bytes per device: `auto` is the device's available memory now (read once, at start)."""
    if memory_budget is None:
        return dict.fromkeys(devices)
    if memory_budget == "auto":
        return {d: available_bytes(d) for d in devices}
    size = parse_size(memory_budget)
    if size is None:
        raise ValueError(f"memory_budget must be a size (8GiB, 512MiB, bytes), auto or null, got {memory_budget!r}")
    return dict.fromkeys(devices, size)


def copy_size(workers: list[WorkerPlan]) -> CopySize:
    """A model ID's size from its planned workers (on the first one's device)."""
    w0 = workers[0]
    own = sum(w.fixed_bytes + w.kv_cache_bytes for w in workers)
    if not w0.shares_weights:
        return CopySize(w0.device, own)
    key = f"{w0.spec.model.source}|{str(w0.precision.weights).removeprefix('torch.')}"
    if w0.shared_packed_bytes:  # its quantized linears' file too (a variant without them counts the weights again: errs high)
        key += f"|{w0.precision.quantized_key}"
    return CopySize(w0.device, own, key, w0.weight_bytes + w0.shared_packed_bytes + w0.shared_batch_bytes)


class PlanPlacer:
    """routing.lifecycle.Placer for a local deployment: the plan's sizing, one copy at a time."""

    def __init__(self, devices: list[str], kv_cache_memory, budget: dict[str, int | None], ray: bool = False):
        self.devices = devices
        self.ray = ray  # Ray places the worker: no cores of this machine, and an actor's GPU is its device 0
        self.kv_cache_memory = kv_cache_memory
        self.budget = budget
        self.avail = {d: available_bytes(d) for d in devices if budget.get(d) is None}

    def _plan(self, model: ModelSpec, model_id: int, device: str, threads: int | None = None) -> WorkerPlan:
        budget = self.budget.get(device)
        share = None if budget is None else int(budget * KV_BUDGET_SHARE)
        w = place_worker([], model, model_id, device, threads=threads, kv_cache_memory=self.kv_cache_memory,
                         kv_share=share, avail=self.avail.get(device), bind=False)
        if device_kind(device).owner_shares_weights:  # a copy loaded at run time there holds its own
            w.shares_weights = False  # weights (no owner process is given it), and its own blocks
            w.packed_bytes += w.shared_packed_bytes + w.shared_batch_bytes
            w.shared_packed_bytes = w.shared_batch_bytes = 0
        return w

    def size(self, model: ModelSpec, device: str) -> CopySize:
        return copy_size([self._plan(model, 0, device)])

    def worker_spec(self, model: ModelSpec, model_id: int, device: str, cpus: tuple[int, ...] | None,
                    copies_on_device: int) -> WorkerSpec:
        """Its worker: on the evicted copies' cores where they were bound, else a fair share of the
        device's cores (unbound: the running workers keep theirs)."""
        kind = device_kind(device)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = (len(cpus) if cpus else max(1, cores // copies_on_device)) if kind.host else None
        spec = self._plan(model, model_id, device, threads).spec
        if self.ray:
            return spec.placed(cpus=None, device=kind.actor_device(device))
        return spec.placed(cpus=cpus if kind.host else None)

    def describe(self, specs: dict[str, ModelSpec]) -> list[str]:
        budget = ", ".join(f"{d} {mib(b)}" if b is not None else f"{d} none" for d, b in self.budget.items())
        lines = [f"a copy of each variant, loaded at run time (memory_budget: {budget}):"]
        for name, spec in specs.items():
            for d in self.devices:
                w = self._plan(spec, 0, d)
                shared = " (shared by the copies on the device)" if w.shares_weights else ""
                lines.append(f"  {name} on {d}: ~{mib(w.est_bytes)}: weights {mib(w.weight_bytes)}{shared}, "
                             f"packed linears {mib(w.packed_bytes + w.shared_packed_bytes + w.shared_batch_bytes)}, KV cache {mib(w.kv_cache_bytes)}, process "
                             f"{mib(worker_overhead(d))}")
        return lines


def make_catalog(fusion: MultiModelFusion, plan: DeploymentPlan, variants: dict[str, ModelSpec], run: dict) -> Catalog:
    """The catalog of a deployment; raises ValueError when the started copies exceed the budget.
    On Ray (`run["ray"]`) there is no budget: Ray places each copy where its memory fits, or not."""
    devices = list(dict.fromkeys([*plan.devices, *(w.device for w in plan.workers)]))
    ray = bool(run.get("ray"))
    budget = budgets(None if ray else run.get("memory_budget"), devices)
    placer = PlanPlacer(devices, run.get("kv_cache_memory", "auto"), budget, ray)
    by_model: dict[int, list[WorkerPlan]] = {}
    for w in plan.workers:
        by_model.setdefault(w.model_id, []).append(w)
    sizes = {mid: copy_size(ws) for mid, ws in by_model.items()}
    # a device with no budget evicts nothing, and takes no more copies than it had memory for at start
    ceilings = {} if ray else {d: b for d, b in placer.avail.items() if b is not None}
    catalog = Catalog(dict(variants), placer, budget, sizes, ceilings)
    started = Residency(budget)
    for mid, s in sizes.items():
        started.add(Resident(mid, s))
    for d, b in budget.items():
        if b is not None and started.used(d) > b:
            raise ValueError(f"memory_budget: the copies started on {d} need ~{mib(started.used(d))}, more than its "
                             f"budget of {mib(b)}; start fewer (--variants), or raise memory_budget")
    return catalog
