"""Models at run time: load, unload, evict, autoload and idle unload. Without sockets, like the
dispatch it serves (routing/dispatch.py): every input is a method call, every output a message in
the outbox, to a client, a worker or the supervisor.

- A load of `copies` wants that many copies in total; each new one is a new model ID (never
  reused) with one worker in a new slot of the registry, which the supervisor starts
  (`start_worker`) once the copies it evicts have exited. It is answered when every copy serves.
- Where a copy goes, and what it evicts, is routing/residency.py's decision. How big a copy of a
  model is on a device, and its worker's spec, the deployment's `Placer` says (fusion/catalog.py).
- An unloaded copy leaves the model's name at once (new requests go to another copy, or queue for
  a reload), finishes what it was given (its queue too) for up to `unload_timeout`, fails the rest
  with `unloaded`, and then its workers are stopped (`stop_worker`); it is gone when they exited.
- A request naming a variant with no copy loads one (`autoload`): the first request starts the
  load, and it and every later one queue on the new copy until it serves, for up to
  `load_timeout`.
- Against thrash, for loads that requests start (an operator's load is never held back): a copy
  that began serving less than `min_resident_s` ago is not evicted for one, and beyond
  `max_loads_per_minute` loads in the last minute a load that would evict waits (its requests
  queue) until the minute has room, rather than evict a copy that serves. Waiting loads are
  placed first come first placed as time, exits and loads allow.

The dispatch calls a lifecycle through ModelLifecycle's methods only, and always has one: a
deployment without a supervisor to start and stop workers (a router started alone, or with
--router) has StaticLifecycle, whose models are those it started with. The lifecycle reaches the
dispatch's model table, workers and requests through LifecycleHost.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Protocol

from routing.registry import ModelEntry, WorkerRegistry
from routing.residency import CopySize, NoMemory, Placement, Residency, Resident
from wire import protocol as P
from workers.spec import ModelSpec, WorkerSpec
from workers.validate import is_int

LAST_EVICTIONS = 20  # unloads `status` lists, each with its reason


class LifecycleHost(Protocol):
    """What a lifecycle shares with the dispatch that owns it (routing.dispatch.Dispatch)."""

    models: dict[int, ModelEntry]  # by model ID: a load adds its copies, a copy that is gone leaves
    by_name: dict[str, list[int]]  # the copies that serve each name (an unloading copy has left it)
    registry: WorkerRegistry
    outbox: object  # routing.dispatch.Outbox
    pending: dict  # the requests in flight by key (routing.dispatch.Pending)
    wall: float  # monotonic times + wall = Unix times

    def log(self, line: str) -> None: ...

    def fail(self, p, code: str, message: str) -> None:
        """Answer a pending request with an error and forget it."""


class ModelLifecycle(Protocol):
    """What the dispatch asks of a lifecycle: client loads and unloads, a request naming a model with
    no copy, and what it hears of workers and the clock."""

    def load(self, client: bytes, msg: dict, now: float) -> None: ...

    def unload(self, client: bytes, msg: dict, now: float) -> None: ...

    def autoload(self, name, rid, now: float) -> list[int] | None: ...

    def touch(self, model_id: int, now: float) -> None: ...

    def loaded(self, model_id: int, now: float) -> None: ...

    def load_failed(self, model_id: int, why: str, now: float) -> None: ...

    def exited(self, slot: int | None, now: float) -> None: ...

    def tick(self, now: float) -> None: ...

    def models_info(self) -> list[dict]: ...

    def status(self) -> dict: ...


class StaticLifecycle:
    """The lifecycle of a deployment whose models are fixed: with no supervisor to start and stop
    workers, loads and unloads are refused, and the models are those it started with."""

    def __init__(self, host: LifecycleHost):
        self.host = host

    def load(self, client: bytes, msg: dict, now: float) -> None:
        self._refuse("load", msg)

    def unload(self, client: bytes, msg: dict, now: float) -> None:
        self._refuse("unload", msg)

    @staticmethod
    def _refuse(what: str, msg: dict) -> None:
        raise P.ProtocolError(f"this router cannot {what} models: it has no supervisor to start and stop "
                              "workers (a router started alone, or with --router)", P.NOT_SUPPORTED, msg.get("id"))

    def autoload(self, name, rid, now: float) -> list[int] | None:
        return None

    def touch(self, model_id: int, now: float) -> None:
        pass

    def loaded(self, model_id: int, now: float) -> None:
        pass

    def load_failed(self, model_id: int, why: str, now: float) -> None:
        pass  # never loading: its models serve from the start or wait restart_wait for a worker

    def exited(self, slot: int | None, now: float) -> None:
        pass

    def tick(self, now: float) -> None:
        pass

    def models_info(self) -> list[dict]:
        h = self.host
        return [h.registry.model_info(m, 0, h.wall) for m in h.models.values()]

    def status(self) -> dict:
        return {}


class Placer(Protocol):
    """How the deployment places a copy (fusion/catalog.py): its size before it loads, its spec."""

    devices: list[str]

    def size(self, model: ModelSpec, device: str) -> CopySize: ...

    def worker_spec(self, model: ModelSpec, model_id: int, device: str, cpus: tuple[int, ...] | None,
                    copies_on_device: int) -> WorkerSpec: ...


@dataclass(slots=True)
class Catalog:
    """Every model a deployment can serve, the budget per device, and the sizes of the copies it
    started with (by model ID)."""

    specs: dict[str, ModelSpec]
    placer: Placer
    budgets: dict[str, int | None] = field(default_factory=dict)
    sizes: dict[int, CopySize] = field(default_factory=dict)
    # bytes available at start on the devices with no budget: what their copies may hold at most
    ceilings: dict[str, int] = field(default_factory=dict)

    def available(self, by_name: dict[str, list[int]]) -> list[dict]:
        """The models entry of each variant with no copy loaded or loading (no ID)."""
        return [{"id": None, "name": name, "workers": [], "state": P.STATE_AVAILABLE, "pinned": spec.pin,
                 "resident_bytes": 0, "last_use": None} for name, spec in self.specs.items() if not by_name.get(name)]


@dataclass(slots=True)
class Waiter:
    """A client's load or unload, answered when every copy in `model_ids` serves (load) or is gone."""

    client: bytes
    request_id: str
    name: str
    model_ids: set[int]
    unload: bool = False


class Waiters:
    """The loads and unloads clients wait for, each answered once."""

    def __init__(self, outbox):
        self.outbox = outbox
        self.items: list[Waiter] = []

    def answer(self, models: dict[int, ModelEntry], info) -> None:
        """Answer every load whose copies all serve, and every unload whose copies are all gone."""
        for w in list(self.items):
            if w.unload:
                done = not (w.model_ids & set(models))
            else:
                done = all(models[i].state == P.STATE_LOADED for i in w.model_ids if i in models)
            if done:
                self.items.remove(w)
                copies = [info(m) for m in models.values() if m.name == w.name]
                self.outbox.client(w.client, {"type": P.REPLY, "id": w.request_id,
                                              "data": {"model": w.name, "copies": copies}})

    def fail(self, model_id: int, message: str) -> None:
        """The loads waiting for this copy fail: it will not serve."""
        for w in [w for w in self.items if model_id in w.model_ids and not w.unload]:
            self.items.remove(w)
            self.outbox.client(w.client, P.error(w.request_id, P.NO_WORKER, message))


@dataclass(slots=True)
class Stats:
    loads: int = 0  # copies that came to serve
    load_failures: int = 0
    autoloads: int = 0  # loads a request started
    held: int = 0  # request-started loads that waited (min_resident_s, max_loads_per_minute) instead of evicting
    evictions: Counter = field(default_factory=Counter)  # by reason: evicted, idle, unload, load_failed
    load_seconds: list = field(default_factory=list)  # per loaded copy, the last 100
    queue_wait_seconds: list = field(default_factory=list)  # requests that waited for a load, the last 1000
    unloaded_requests: int = 0  # failed with `unloaded` when their copy's unload_timeout passed
    # the last unloads, newest last: {model_id, model, reason, at (Unix time)}
    last_evictions: deque = field(default_factory=lambda: deque(maxlen=LAST_EVICTIONS))

    def as_dict(self) -> dict:
        def summary(xs):
            return {"count": len(xs), "mean": round(sum(xs) / len(xs), 3) if xs else None,
                    "max": round(max(xs), 3) if xs else None}

        return {"loads": self.loads, "load_failures": self.load_failures, "autoloads": self.autoloads, "held": self.held,
                "evictions": dict(self.evictions), "load_seconds": summary(self.load_seconds),
                "queue_wait_seconds": summary(self.queue_wait_seconds), "unloaded_requests": self.unloaded_requests,
                "last_evictions": list(self.last_evictions)}


class Lifecycle:
    """Models at run time within the catalog's budgets (ModelLifecycle's methods)."""

    def __init__(self, catalog: Catalog, config, host: LifecycleHost):
        self.catalog, self.config = catalog, config
        # the dispatch's model table, workers and requests, which loads and unloads change
        self.models, self.by_name, self.registry, self.outbox = host.models, host.by_name, host.registry, host.outbox
        self.pending = host.pending
        self.fail = host.fail
        self.log = host.log
        self.residency = Residency(dict(catalog.budgets), dict(catalog.ceilings))
        for mid, m in self.models.items():
            m.pinned = m.spec.pin
            if mid in catalog.sizes:
                self.residency.add(Resident(mid, catalog.sizes[mid], m.pinned))
        self.next_id = max(self.models, default=-1) + 1
        self.waiters = Waiters(self.outbox)
        self.deferred: list[int] = []  # loading copies waiting for room (model IDs, in order)
        self.guarded: set[int] = set()  # of those, the ones requests started (the thrash guard applies)
        self.guard = LoadGuard(config.min_resident_s, config.max_loads_per_minute)
        self.reload_s: dict[str, float] = {}  # a model's load seconds, measured (its copies' reload cost)
        self.placed_at: dict[int, float] = {}  # loading copies: when they were placed (their load began)
        self.blocked: dict[int, set[int]] = {}  # slot -> the leaving copies it starts after
        self.stopping: dict[int, set[int]] = {}  # model ID -> its slots told to stop, not yet exited
        self.stats = Stats()
        self.wall = host.wall

    # --- requests from clients -------------------------------------------------------------------
    def load(self, client: bytes, msg: dict, now: float) -> None:
        rid, name = msg.get("id"), msg.get("model")
        copies, pin = msg.get("copies", 1), msg.get("pin", False)
        spec = known_spec(self.catalog, name, rid)
        if not is_int(copies, 1):
            raise P.ProtocolError(f"copies must be an integer >= 1 (the copies wanted in all), got {copies!r}",
                                  request_id=rid)
        if copies > P.MAX_COPIES:  # where no memory bound applies (Ray) a placement was built for each
            raise P.ProtocolError(f"copies ({copies}) exceeds the limit of {P.MAX_COPIES} copies of a model (a "
                                  "worker process each)", request_id=rid)
        if not isinstance(pin, bool):
            raise P.ProtocolError(f"pin must be true or false, got {pin!r}", request_id=rid)
        if any(m.name == name and m.state == P.STATE_UNLOADING for m in self.models.values()):
            raise P.ProtocolError(f"model {name!r} is being unloaded; load it again when that is done",
                                  P.CONFLICT, rid)
        ids = list(self.by_name.get(name, []))
        if pin:  # a load never unpins
            for mid in ids:
                self.models[mid].pinned = True
                if mid in self.residency.copies:
                    self.residency.copies[mid].pinned = True
        ids += self._start(spec, copies - len(ids), pin or spec.pin, now, rid)
        self.waiters.items.append(Waiter(client, rid, name, {i for i in ids if self.models[i].state == P.STATE_LOADING}))
        self._answer()

    def unload(self, client: bytes, msg: dict, now: float) -> None:
        rid, model, copies = msg.get("id"), msg.get("model"), msg.get("copies")
        if is_int(model, 0):
            m = self.models.get(model)
            if m is None or m.state == P.STATE_UNLOADING:
                raise P.ProtocolError(f"model ID {model} is not loaded", P.UNKNOWN_MODEL, rid)
            name, ids = m.name, [model]
        else:
            known_spec(self.catalog, model, rid)
            name, ids = model, sorted(self.by_name.get(model, []), reverse=True)
        if copies is not None and not is_int(copies, 1):
            raise P.ProtocolError(f"copies must be an integer >= 1 (how many to unload) or null (all), got {copies!r}",
                                  request_id=rid)
        if not ids:
            raise P.ProtocolError(f"model {name!r} is not loaded", request_id=rid)
        if any(self.models[i].state == P.STATE_LOADING for i in ids):
            raise P.ProtocolError(f"model {name!r} is loading; unload it when the load is done", P.CONFLICT, rid)
        chosen = ids[:copies] if copies is not None else ids
        for mid in chosen:
            self.begin_unload(mid, "unload", now)
        self.waiters.items.append(Waiter(client, rid, name, set(chosen), unload=True))
        self._answer()

    def autoload(self, name, rid, now: float) -> list[int] | None:
        """A request names a variant with no copy: the copy it queues on (None: not a variant)."""
        spec = self.catalog.specs.get(name) if isinstance(name, str) else None
        if spec is None:
            return None
        if not self.config.autoload:
            raise P.ProtocolError(f"model {name!r} is not loaded (runconfig.autoload is off): load it first",
                                  P.UNLOADED, rid)
        ids = self._start(spec, 1, spec.pin, now, rid, guarded=True)
        self.stats.autoloads += 1
        self.log(f"router: a request for {name!r} loads it (model ID {ids[0]})")
        return ids

    def touch(self, model_id: int, now: float) -> None:
        """A request named the copy (the dispatch keeps its entry's last_use): its use counts toward
        what keeping it is worth (routing/residency.py)."""
        r = self.residency.copies.get(model_id)
        if r is not None:
            r.use(now)

    # --- loading -----------------------------------------------------------------------------------
    def _start(self, spec: ModelSpec, n: int, pin: bool, now: float, rid, guarded: bool = False) -> list[int]:
        if n <= 0:
            return []
        placer = self.catalog.placer
        sizes = [placer.size(spec, d) for d in placer.devices]
        protect = self.guard.protect_s(guarded)
        try:
            placements: list[Placement | None] = self.residency.choose_many(spec.name, sizes, n, self._busy,
                                                                            now=now, protect_s=protect)
            if any(self.guard.holds(p, guarded, now) for p in placements):
                placements = [None] * n
                self.stats.held += 1
        except NoMemory as exc:
            try:  # there is room once the copies loading now serve (and may then go): wait for them
                self.residency.choose_many(spec.name, sizes, n, self._busy, wait=True)
            except NoMemory:
                raise P.ProtocolError(str(exc), P.NO_MEMORY, rid) from None
            if guarded and protect:
                self.stats.held += 1
            placements = [None] * n
        ids = []
        for p in placements:
            mid, self.next_id = self.next_id, self.next_id + 1
            self.models[mid] = ModelEntry(mid, spec.name, spec, state=P.STATE_LOADING, pinned=pin, last_use=now,
                                          since=now)
            self.by_name.setdefault(spec.name, []).append(mid)
            if p is None:
                self.deferred.append(mid)
                if guarded:
                    self.guarded.add(mid)
                self.log(f"router: {spec.name!r} (model ID {mid}) waits to load: for room, or for the copies "
                         f"loading or just loaded to be evictable (min_resident_s, max_loads_per_minute)")
            else:
                self._place(mid, p, now, guarded)
            ids.append(mid)
        return ids

    def _place_deferred(self, now: float) -> None:
        """Place the loads that waited for room, first come first placed."""
        while self.deferred:
            m = self.models.get(self.deferred[0])
            if m is None or m.state != P.STATE_LOADING:
                self.deferred.pop(0)  # failed (load_timeout) meanwhile
                continue
            placer = self.catalog.placer
            guarded = m.model_id in self.guarded
            try:
                p = self.residency.choose(m.name, [placer.size(m.spec, d) for d in placer.devices], self._busy,
                                          now=now, protect_s=self.guard.protect_s(guarded))
            except NoMemory:
                return
            if self.guard.holds(p, guarded, now):
                return
            self.deferred.pop(0)
            self.guarded.discard(m.model_id)
            self._place(m.model_id, p, now, guarded)

    def _place(self, mid: int, p: Placement, now: float, guarded: bool = False) -> None:
        m = self.models[mid]
        spec = m.spec
        evicted = [k for i in p.evict for k in self.registry.slots_of(i)]
        cpus = [c for k in evicted for c in (self.registry.worker_specs[k].cpus or ())]
        bound = evicted and all(self.registry.worker_specs[k].cpus for k in evicted)
        on_device = sum(1 for r in self.residency.copies.values() if r.size.device == p.device and not r.leaving)
        wspec = self.catalog.placer.worker_spec(spec, mid, p.device, tuple(sorted(cpus)) if bound else None,
                                                on_device + 1)
        self.residency.apply(p, mid, m.pinned, now)
        self.residency.copies[mid].reload_s = self.reload_s.get(spec.name, 0.0)
        self.placed_at[mid] = now
        if guarded:
            self.guard.placed(now)
        slot = self.registry.add_slot(wspec)
        for i in p.evict:
            if self.models[i].state != P.STATE_UNLOADING:
                self.begin_unload(i, "evicted", now)
        self.log(f"router: loading {spec.name!r} as model ID {mid} on {p.device} (slot {slot}"
                 + (f", after unloading model IDs {list(p.evict)})" if p.evict else ")"))
        waiting = {i for i in p.evict if i in self.models}
        if waiting:
            self.blocked[slot] = waiting
        else:
            self.outbox.supervisor(start_order(slot, wspec, p.size))

    def loaded(self, model_id: int, now: float) -> None:
        """A worker of the model answered LOADED: a loading copy now serves."""
        m = self.models.get(model_id)
        if m is None or m.state != P.STATE_LOADING:
            return
        m.state, m.since, load_s = P.STATE_LOADED, now, now - m.since
        r = self.residency.copies.get(model_id)
        if r is not None:
            r.evictable, r.loaded_at = True, now
        # a reload's cost: the model's latest load time (a wait for room before it is not counted)
        self.reload_s[m.name] = now - self.placed_at.pop(model_id, now - load_s)
        for other in self.residency.copies.values():
            if other.model_id in self.models and self.models[other.model_id].name == m.name:
                other.reload_s = self.reload_s[m.name]
        self.stats.loads += 1
        _keep(self.stats.load_seconds, load_s, 100)
        for p in m.queue:
            _keep(self.stats.queue_wait_seconds, now - p.queued_at, 1000)
        self.log(f"router: model ID {model_id} ({m.name!r}) loaded in {load_s:.1f}s")
        self._place_deferred(now)
        self._answer()

    def load_failed(self, model_id: int, why: str, now: float) -> None:
        """A copy loading at run time cannot serve: its load fails, its queue with it."""
        m = self.models.get(model_id)
        if m is None or m.state != P.STATE_LOADING:
            return
        self.stats.load_failures += 1
        message = f"model {m.name!r} (ID {model_id}) could not be loaded: {why}"
        self.log(f"router: {message}")
        self.waiters.fail(model_id, message)
        for p in list(m.queue):
            m.queue.remove(p)
            self.fail(p, P.NO_WORKER, message)
        self.begin_unload(model_id, "load_failed", now)

    # --- unloading ---------------------------------------------------------------------------------
    def begin_unload(self, model_id: int, reason: str, now: float) -> None:
        m = self.models[model_id]
        m.state, m.since = P.STATE_UNLOADING, now
        ids = self.by_name.get(m.name, [])
        if model_id in ids:
            ids.remove(model_id)
        if not ids:
            self.by_name.pop(m.name, None)
        r = self.residency.copies.get(model_id)
        if r is not None:
            r.leaving = True
        self.stats.evictions[reason] += 1
        self.stats.last_evictions.append({"model_id": model_id, "model": m.name, "reason": reason,
                                          "at": round(now + self.wall, 3)})
        self.log(f"router: unloading model ID {model_id} ({m.name!r}): {reason}")
        self._check_drain(m, now)

    def _check_drain(self, m: ModelEntry, now: float) -> None:
        if m.model_id in self.stopping:
            return
        workers = self.registry.of_model(m.model_id)
        inflight = sum(len(w.inflight) for w in workers)
        if (inflight or m.queue) and now - m.since < self.config.unload_timeout:
            return
        why = (f"model {m.name!r} (ID {m.model_id}) was unloaded before this request finished "
               f"(unload_timeout {self.config.unload_timeout:g}s)")
        for p in list(m.queue):
            m.queue.remove(p)
            self.stats.unloaded_requests += 1
            self.fail(p, P.UNLOADED, why)
        for w in workers:
            for key in sorted(w.inflight):
                self.outbox.worker(w.ident, P.pack({"type": P.CANCEL, "id": key}))
                if key in self.pending:
                    self.stats.unloaded_requests += 1
                    self.fail(self.pending[key], P.UNLOADED, why)
        stop = set()
        for slot in self.registry.slots_of(m.model_id):
            self.registry.retired.add(slot)
            if self.blocked.pop(slot, None) is None:  # a blocked slot never started: nothing to stop
                stop.add(slot)
                self.outbox.supervisor({"type": P.STOP_WORKER, "slot": slot})
        for w in workers:
            if w.slot is None:  # a hand-started worker: the supervisor cannot stop it, it stops itself
                self.outbox.worker(w.ident, P.pack({"type": P.SHUTDOWN}))
        self.stopping[m.model_id] = stop
        self._check_gone(m.model_id, now)

    def exited(self, slot: int | None, now: float) -> None:
        """A worker process exited for good (`slot`: its supervisor says so), or a worker was dropped."""
        for mid, slots in list(self.stopping.items()):
            slots.discard(slot)
            self._check_gone(mid, now)

    def _check_gone(self, model_id: int, now: float) -> None:
        """A leaving copy whose processes have all exited is gone: its memory is free."""
        if self.stopping.get(model_id, True) or self.registry.of_model(model_id):
            return
        del self.stopping[model_id]
        m = self.models.pop(model_id, None)
        self.residency.remove(model_id)
        if m is not None:
            self.log(f"router: model ID {model_id} ({m.name!r}) unloaded")
        for slot, waiting in list(self.blocked.items()):
            waiting.discard(model_id)
            if not waiting:
                del self.blocked[slot]
                spec = self.registry.worker_specs[slot]
                self.outbox.supervisor(start_order(slot, spec, self.residency.copies[spec.model_id].size))
        self._place_deferred(now)
        self._answer()

    # --- clock -------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        if self.deferred:
            self._place_deferred(now)  # protections expire and the minute's loads free up as time passes
        for m in list(self.models.values()):
            if m.state == P.STATE_UNLOADING:
                self._check_drain(m, now)
            elif m.state == P.STATE_LOADING and now - m.since > self.config.load_timeout:
                self.load_failed(m.model_id, f"it did not load within load_timeout ({self.config.load_timeout:g}s)",
                                 now)
        idle = self.config.idle_unload_s
        if idle is not None:
            for ids in list(self.by_name.values()):
                ms = [self.models[i] for i in ids]
                if (all(m.state == P.STATE_LOADED and not m.pinned and not m.queue for m in ms)
                        and not any(w.inflight for i in ids for w in self.registry.of_model(i))
                        and now - max(m.last_use for m in ms) >= idle):
                    for i in list(ids):
                        self.begin_unload(i, "idle", now)

    # --- what clients see --------------------------------------------------------------------------
    def info(self, m: ModelEntry) -> dict:
        return self.registry.model_info(m, self.residency.resident_bytes(m.model_id), self.wall)

    def models_info(self) -> list[dict]:
        """One entry per model ID, and one per variant with no copy (`id` None)."""
        return [*(self.info(m) for m in self.models.values()), *self.catalog.available(self.by_name)]

    def status(self) -> dict:
        res = self.residency
        return {"models": {**self.stats.as_dict(), "budgets": res.budgets, "resident_bytes": res.by_device(),
                           "models": {str(mid): res.resident_bytes(mid) for mid in sorted(res.copies)}}}

    # --- helpers -----------------------------------------------------------------------------------
    def _busy(self, model_id: int) -> bool:
        m = self.models.get(model_id)
        return bool(m is not None and m.queue) or any(w.inflight for w in self.registry.of_model(model_id))

    def _answer(self) -> None:
        self.waiters.answer(self.models, self.info)


class LoadGuard:
    """Against thrash, for loads that requests start (an operator's load is never held back): a copy
    that began serving less than `min_resident_s` ago is not evicted for one, and beyond
    `max_loads_per_minute` such loads in the last minute one that would evict waits."""

    def __init__(self, min_resident_s: float, max_loads_per_minute: int | None):
        self.min_resident_s, self.max_loads_per_minute = min_resident_s, max_loads_per_minute
        self.started: deque[float] = deque()  # when request-started loads were placed, over the last minute

    def protect_s(self, guarded: bool) -> float:
        """How long a copy that began serving is kept from eviction by this load."""
        return self.min_resident_s if guarded else 0.0

    def holds(self, p: Placement, guarded: bool, now: float) -> bool:
        """A request-started load that would evict, with the minute's loads used up: it waits."""
        cap = self.max_loads_per_minute
        while self.started and self.started[0] <= now - 60.0:
            self.started.popleft()
        return guarded and cap is not None and bool(p.evict) and len(self.started) >= cap

    def placed(self, now: float) -> None:
        """A request-started load was placed now."""
        self.started.append(now)


def known_spec(catalog: Catalog, name, rid) -> ModelSpec:
    """The variant `name` of the catalog; a ProtocolError names the deployment's variants."""
    spec = catalog.specs.get(name) if isinstance(name, str) else None
    if spec is None:
        raise P.ProtocolError(f"unknown model {name!r}; this deployment's variants: {sorted(catalog.specs)}",
                              P.UNKNOWN_MODEL, rid)
    return spec


def start_order(slot: int, spec: WorkerSpec, size: CopySize) -> dict:
    """The supervisor's order to start a slot's worker, with what a cluster placing it needs."""
    return {"type": P.START_WORKER, "slot": slot, "device": spec.device, "threads": spec.threads,
            "memory": size.alone, "resources": spec.model.resources}


def _keep(xs: list, x: float, most: int) -> None:
    xs.append(x)
    del xs[:-most]
