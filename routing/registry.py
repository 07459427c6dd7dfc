"""The router's workers: which model each serves, under which ID and settings, and which of them a
request can go to (routing.dispatch keeps the requests). Without sockets, like the dispatch.

A worker's READY gets a worker ID and a model ID: its planned slot's model when it names a slot
(a restarted local worker comes back on its planned model and device), else round-robin in
registration order, filling a model left without a worker first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from routing.tenants import FairQueue
from wire import protocol as P
from workers.spec import ModelSpec, WorkerSpec


@dataclass(slots=True)
class ModelEntry:
    model_id: int
    name: str
    spec: ModelSpec  # its settings; an unplanned worker of it gets them with no placement
    queue: FairQueue = field(default_factory=FairQueue)  # its waiting requests, fair across tenants
    orphan_since: float | None = None  # when it lost its last live worker (None: it has one, or never had)
    abandoned: bool = False  # the supervisor gave up on its last worker: queued requests fail at once
    state: str = P.STATE_LOADED  # or STATE_LOADING (started at run time, not serving yet), STATE_UNLOADING
    pinned: bool = False  # never evicted (routing.residency)
    last_use: float = 0.0  # when a request last named it (monotonic)
    since: float = 0.0  # when it entered its state (monotonic)
    ready_at: float = 0.0  # when a worker of it last finished loading (a request queued for the load waited until then)


@dataclass(slots=True)
class WorkerState:
    ident: bytes
    worker_id: int
    model_id: int
    capabilities: dict
    slot: int | None = None  # the deployment plan's worker this process is (local supervisor)
    alive: bool = True
    loaded: bool = False
    last_seen: float = 0.0
    inflight: set = field(default_factory=set)
    served: int = 0
    tokens: int = 0
    errors: int = 0
    load_error: str | None = None
    lost: str | None = None  # why it was dropped
    engine: dict = field(default_factory=dict)  # the worker's own counters, from its heartbeats
    weights: dict = field(default_factory=dict)  # {"bytes", "shared", "path"} from its LOADED
    compile: dict = field(default_factory=dict)  # {"compiled", "reason", "warm", "seconds", ...} from its LOADED
    kernels: dict = field(default_factory=dict)  # the kernels it picked by the step's rows, from its LOADED


class WorkerRegistry:
    def __init__(self, models: dict[int, ModelEntry], worker_specs: list[WorkerSpec], keep_dead: int):
        self.models = models
        # the deployment plan's workers (model, model ID, device, threads, batch limits), by slot
        self.worker_specs = worker_specs
        self.workers: dict[bytes, WorkerState] = {}  # live workers only
        self.dead: deque[WorkerState] = deque(maxlen=keep_dead)
        self.retired: set[int] = set()  # slots of unloaded copies: never assigned again
        self._registrations = 0
        self._used_ids: set[int] = set()
        self._next_id = 0

    def register(self, ident: bytes, capabilities: dict, now: float) -> WorkerState:
        """A READY: the new worker, with its ID and model."""
        slot = capabilities.get("slot")
        slot = slot if isinstance(slot, int) and not isinstance(slot, bool) else None
        if slot is not None and not 0 <= slot < len(self.worker_specs):
            slot = None  # not a slot of this deployment's plan
        w = WorkerState(ident, self._new_worker_id(slot), 0, capabilities, slot, last_seen=now)
        w.model_id = self._assign_model(slot)
        self._registrations += 1
        self.workers[ident] = w
        m = self.models[w.model_id]
        m.abandoned, m.orphan_since = False, None
        return w

    def remove(self, w: WorkerState, why: str, now: float) -> None:
        """Lost: kept among the dead for status; its model is orphaned if no other worker serves it."""
        w.alive, w.loaded, w.lost = False, False, why
        self.workers.pop(w.ident, None)
        self.dead.append(w)
        m = self.models.get(w.model_id)  # None: an unloaded model's
        if m is not None and not self.usable(w.model_id) and m.orphan_since is None:
            m.orphan_since = now

    def add_slot(self, spec: WorkerSpec) -> int:
        """A worker started at run time (a loaded copy): its slot, whose spec it gets at READY."""
        self.worker_specs.append(spec)
        return len(self.worker_specs) - 1

    def slots_of(self, model_id: int) -> list[int]:
        return [k for k, s in enumerate(self.worker_specs) if s.model_id == model_id and k not in self.retired]

    def _assign_model(self, slot: int | None) -> int:
        if slot is not None:
            planned = self.worker_specs[slot].model_id
            if planned in self.models and slot not in self.retired:
                return planned
        # a worker without a slot serves a model of the start, or one loaded since, never one leaving
        live = {mid: 0 for mid, m in self.models.items() if m.state != P.STATE_UNLOADING} or dict.fromkeys(self.models, 0)
        for w in self.workers.values():
            if w.model_id in live:
                live[w.model_id] += 1
        ids = sorted(live)
        rr = ids[self._registrations % len(ids)]
        orphaned = [mid for mid in ids if live[mid] == 0]
        return rr if live[rr] == 0 or not orphaned else orphaned[0]

    def _new_worker_id(self, slot: int | None) -> int:
        """A planned worker's first process gets its slot number; restarts and unplanned workers get
        IDs past the plan's."""
        if slot is not None and slot not in self._used_ids:
            wid = slot
        else:
            wid = max(self._next_id, len(self.worker_specs))
            while wid in self._used_ids:
                wid += 1
            self._next_id = wid + 1
        self._used_ids.add(wid)
        return wid

    def spec_for(self, w: WorkerState) -> WorkerSpec:
        """What the worker serves: its slot's planned spec; a worker without a slot gets a planned
        spec of its model (unbound: those cores are the slot's), else the model's settings alone."""
        if w.slot is not None:
            return self.worker_specs[w.slot]
        planned = [s for s in self.worker_specs if s.model_id == w.model_id]
        if planned:
            return planned[w.worker_id % len(planned)].placed(cpus=None)
        return WorkerSpec(self.models[w.model_id].spec, w.model_id)

    def of_model(self, model_id: int) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.model_id == model_id]

    def usable(self, model_id: int) -> bool:
        """A live worker serves it, loaded or loading (not failed to load)."""
        return any(w.model_id == model_id and w.load_error is None for w in self.workers.values())

    def has_loaded(self, model_id: int) -> bool:
        return any(w.loaded and w.model_id == model_id for w in self.workers.values())

    def pick(self, model_id: int, max_inflight: int, batch: bool = False) -> WorkerState | None:
        """The loaded worker of the model with the least in flight (then the fewest served), if one has
        room: fewer than `max_inflight`, and with `batch` fewer than its max_batch_size too."""
        ws = [w for w in self.workers.values()
              if w.loaded and w.model_id == model_id and len(w.inflight) < max_inflight
              and not (batch and len(w.inflight) >= self.spec_for(w).batch_size)]
        return min(ws, key=lambda w: (len(w.inflight), w.served)) if ws else None

    def load(self, model_id: int) -> tuple[float, int]:
        """Pending work per live worker, then requests served: idle copies take turns."""
        ws = [w for w in self.workers.values() if w.loaded and w.model_id == model_id]
        queued = len(self.models[model_id].queue)
        served = sum(w.served + len(w.inflight) for w in self.workers.values() if w.model_id == model_id)
        if not ws:
            return 1e9 + queued, served
        return (sum(len(w.inflight) for w in ws) + queued) / len(ws), served

    def model_info(self, m: ModelEntry, resident_bytes: int, wall: float) -> dict:
        """One model ID as the models reply lists it; `wall` turns monotonic times into Unix times."""
        return {"id": m.model_id, "name": m.name, "workers": sorted(w.worker_id for w in self.of_model(m.model_id)),
                "state": m.state, "pinned": m.pinned, "resident_bytes": resident_bytes,
                "last_use": round(m.last_use + wall, 3) if m.last_use else None}

    def status(self) -> list[dict]:
        """Every live worker and the last lost ones, by ID."""
        ws = sorted([*self.workers.values(), *self.dead], key=lambda w: w.worker_id)
        return [{"id": w.worker_id, "model_id": w.model_id, "alive": w.alive, "loaded": w.loaded,
                 "slot": w.slot, "served": w.served, "tokens": w.tokens, "errors": w.errors,
                 "inflight": len(w.inflight), "pid": w.capabilities.get("pid"),
                 "host": w.capabilities.get("host"), "placement": w.capabilities.get("placement"),
                 "device": self.spec_for(w).device if w.alive else None,
                 "load_error": w.load_error, "lost": w.lost, "engine": w.engine,
                 "weights": w.weights, "compile": w.compile, "kernels": w.kernels} for w in ws]
