"""The router's state and decisions, without sockets: unit tests drive it directly.

Every input (a client frame, a worker frame, a supervisor notice, a clock tick, a message the
socket could not deliver) is a method call; every output is a `Send` appended to `outbox`, which
the router's I/O loop (routing/router.py) writes to its sockets and empties.

- A worker's READY gets a worker ID and a model ID (routing/registry.py, which keeps the workers).
- Request keys are `<epoch>-<n>`, the epoch new for every router: a worker still holding work from
  an earlier router can never answer a request of this one. Data is accepted only from the worker
  a request was given to.
- Requests name a model (any copy: the least loaded) or a model ID (that copy). A model without a
  live worker queues them in a bounded queue for at most `restart_wait` seconds, then they fail
  with `no_worker` (at once when the supervisor has given up on the model's last worker).
- A lost worker's in-flight requests go to another live worker that may serve them (the router
  fixes every unseeded request's seed on arrival, so a resend gives the same tokens); the resend
  carries how many tokens of each stream the client already has. With no such worker, or after
  `max_redispatch` resends, or with every such queue full, the client gets `worker_lost` at once.
- A message the frontend cannot deliver (the client's queue is full, or it is gone) cancels its
  request on the worker and is counted (`undeliverable`) and logged: nothing is dropped silently.
- Tenants (routing/tenants.py): a request over its tenant's quota is refused at once with
  `rate_limited` and `retry_after`; each model's queue serves tenants by their weights. With
  tenants configured, a worker holds at most its max_batch_size requests, so that the rest wait
  here, where the weights order them.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from routing.inflight import BACK, FRONT, SUPER, Outbox, Pending, Requests, Send, timed
from routing.lifecycle import Catalog, Lifecycle, ModelLifecycle, StaticLifecycle
from routing.registry import ModelEntry, WorkerRegistry, WorkerState
from routing.tenants import DEFAULT_TENANT, Tenant, TenantBook, request_tokens
from wire import protocol as P
from workers.config_keys import DEFAULT_MAX_TOKENS
from workers.spec import WorkerSpec

__all__ = ["BACK", "FRONT", "SUPER", "Catalog", "Dispatch", "ModelEntry", "Pending", "RouterConfig", "Send",
           "WorkerState"]


@dataclass(slots=True)
class RouterConfig:
    frontend: str = P.DEFAULT_FRONTEND
    backend: str = P.DEFAULT_BACKEND
    heartbeat_interval: float = P.HEARTBEAT_INTERVAL
    liveness: int = P.LIVENESS
    max_queue: int = 1024  # waiting requests per model (resent ones included) before `busy`
    max_inflight: int = 256  # requests one worker holds at once; the rest wait in the model's queue
    max_redispatch: int = 2  # resends of one request after losing its worker (a request that kills
    # every worker it reaches must not take down the whole deployment)
    restart_wait: float = P.RESTART_WAIT  # how long queued requests wait for a model without a live worker
    keep_dead: int = 64  # lost workers kept for `status`; older ones are pruned
    # messages queued for one peer before a write to it fails (and is handled, never dropped silently):
    # one client connection may carry hundreds of streams (the HTTP gateway), so its queue is deep
    client_queue: int = 100_000
    worker_queue: int = 10_000
    hard_message_limit: int = P.SOCKET_MESSAGE_LIMIT  # the socket drops peers beyond this (ZMQ_MAXMSGSIZE)
    curve_keys: str | None = None  # CurveZMQ keys directory (wire.security): both sockets then need keys
    insecure: bool = False  # allow binding off loopback without CurveZMQ
    # models at run time (routing/lifecycle.py), with a supervisor to start and stop workers
    autoload: bool = True  # a request for a variant with no copy loads one
    load_timeout: float = 600.0  # a copy that does not serve within this fails its load and its queue
    unload_timeout: float = 60.0  # an unloaded copy's requests may finish for this long, then fail `unloaded`
    idle_unload_s: float | None = None  # unload an unpinned model no request named for this long (None: never)
    # against thrash, for loads requests start (routing/lifecycle.py): a copy serving for less than this is not
    # evicted for one; past this many such loads in a minute, one that would evict waits (None: no cap)
    min_resident_s: float = 0.0
    max_loads_per_minute: int | None = None
    tenants: tuple[Tenant, ...] = ()  # weights and quotas by tenant (routing/tenants.py); () : one default tenant
    gpu_sharing: str = "timeslice"  # how the deployment's workers on one GPU share it (fusion/gpu_sharing.py)

    def __post_init__(self) -> None:
        self.tenants = tuple(self.tenants or ())
        if not all(isinstance(t, Tenant) for t in self.tenants):
            raise ValueError("RouterConfig.tenants must be Tenant settings (routing.tenants.parse_tenants)")
        for name in ("max_queue", "max_inflight", "liveness", "keep_dead", "client_queue", "worker_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"RouterConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.heartbeat_interval > 0:
            raise ValueError(f"RouterConfig.heartbeat_interval must be > 0, got {self.heartbeat_interval!r}")
        for name in ("restart_wait", "load_timeout", "unload_timeout"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"RouterConfig.{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        if not self.min_resident_s >= 0:
            raise ValueError(f"RouterConfig.min_resident_s must be >= 0 seconds, got {self.min_resident_s!r}")
        if self.max_loads_per_minute is not None and not (isinstance(self.max_loads_per_minute, int)
                                                         and self.max_loads_per_minute >= 1):
            raise ValueError("RouterConfig.max_loads_per_minute must be an integer >= 1 or None, got "
                             f"{self.max_loads_per_minute!r}")
        if self.idle_unload_s is not None and not self.idle_unload_s > 0:
            raise ValueError(f"RouterConfig.idle_unload_s must be > 0 seconds or None, got {self.idle_unload_s!r}")


class Dispatch:
    def __init__(self, models: list[ModelEntry], config: RouterConfig | None = None,
                 worker_specs: list[WorkerSpec] | None = None, log=None, catalog: Catalog | None = None):
        if not models and catalog is None:
            raise ValueError("the router needs at least one model")
        self.config = config or RouterConfig()
        self.models = {m.model_id: m for m in models}
        self.by_name: dict[str, list[int]] = {}
        for m in models:
            self.by_name.setdefault(m.name, []).append(m.model_id)
        self.registry = WorkerRegistry(self.models, worker_specs or [], self.config.keep_dead)
        self.workers = self.registry.workers  # live workers only, by socket identity
        self.log = log or (lambda line: None)
        self.wall = time.time() - time.monotonic()  # the models reply gives last_use as a Unix time
        self.outbox = Outbox()
        self.take = self.outbox.take  # the router's I/O loop empties it after every input
        self.undeliverable = 0  # messages the frontend could not deliver (slow or vanished client)
        self.stray = 0  # data from a worker the request was not given to, or from a dropped one (refused)
        self.no_worker = 0  # queued requests failed because no worker came for their model
        self.internal_errors = 0
        self.tenants = TenantBook(self.config.tenants)
        self.fair = self.tenants.configured  # workers hold at most a batch; the rest queue here
        self.now = 0.0  # the time of the input being handled (a request's quota settles at it)
        # the requests held from arrival to answer (routing/inflight.py)
        self.requests = Requests(self.models, self.registry, self.outbox, self.tenants, self.config.max_inflight,
                                 self.fair)
        self.pending, self.client_keys, self.epoch = self.requests.pending, self.requests.client_keys, self.requests.epoch
        # load and unload at run time: only with a supervisor to start and stop workers (its catalog)
        self.lifecycle: ModelLifecycle = (StaticLifecycle(self) if catalog is None
                                          else Lifecycle(catalog, self.config, self))

    # --- clients ---------------------------------------------------------------------------------
    def client(self, client: bytes, frame: bytes, now: float) -> None:
        self.now = now
        try:
            msg = P.unpack(frame, P.CLIENT_TYPES)
            mtype = msg["type"]
            if mtype == P.COMPLETE:
                self._on_complete(client, msg, frame, now)
            elif mtype == P.CANCEL:
                key = self.client_keys.get((client, msg.get("id"))) if isinstance(msg.get("id"), str) else None
                if key is not None:
                    self.requests.cancel(key, now)
            elif mtype == P.MODELS:
                self.outbox.client(client, {"type": P.REPLY, "id": msg.get("id"), "data": self.models_info()})
            elif mtype == P.STATUS:
                self.outbox.client(client, {"type": P.REPLY, "id": msg.get("id"), "data": self.status()})
            elif mtype == P.LOAD:
                self.lifecycle.load(client, msg, now)
            else:
                self.lifecycle.unload(client, msg, now)
        except P.ProtocolError as exc:
            self.outbox.client(client, P.error(exc.request_id, exc.code, str(exc), exc.param, exc.retry_after))

    def misframed(self, client: bytes, frames: list[bytes]) -> None:
        """A client's message of several frames, not one: answered by name, not dropped, so that its
        sender is not left waiting. A REQ socket puts an empty frame first and reads only a reply
        that has one too; a stream needs a DEALER, which sends the message alone."""
        req = len(frames) == 2 and frames[0] == b""
        why = ("a REQ socket's message (an empty frame, then the message): connect a DEALER socket (as "
               "routing.client does), which sends the message alone and can read a stream's many replies"
               if req else f"a message of {len(frames)} frames: send each message as one frame")
        self.outbox.client(client, P.error(None, P.BAD_REQUEST, f"a message is one frame, a msgpack map; got {why}"),
                           envelope=req)

    def _resolve(self, model, rid, now: float) -> list[int]:
        if isinstance(model, int):
            if model not in self.models:
                raise P.ProtocolError(f"unknown model ID {model}; known IDs: {sorted(self.models)}",
                                      P.UNKNOWN_MODEL, rid)
            if self.models[model].state == P.STATE_UNLOADING:
                raise P.ProtocolError(f"model ID {model} is being unloaded; name the model to reach its other "
                                      "copies (or a reload)", P.UNLOADED, rid)
            return [model]
        if model not in self.by_name:
            loading = self.lifecycle.autoload(model, rid, now)
            if loading is not None:
                return loading
        if model not in self.by_name:
            raise P.ProtocolError(f"unknown model {model!r}; known models: {sorted(self.by_name)}",
                                  P.UNKNOWN_MODEL, rid)
        return self.by_name[model]

    def _on_complete(self, client: bytes, msg: dict, frame: bytes, now: float) -> None:
        req = P.CompleteRequest.from_msg(msg)
        if (client, req.id) in self.client_keys:  # before resolving: a refused request must not start a load
            raise P.ProtocolError(f"request id {req.id!r} is already in flight", request_id=req.id)
        tenant, cost = self._admit(req, now)  # before resolving too: a refused request starts no load
        try:
            p = self._queue_or_send(client, msg, frame, req, self._resolve(req.model, req.id, now), tenant, cost, now)
        except P.ProtocolError:
            self.tenants.settle(tenant, cost, 0, now)  # refused after all: its reservation goes back
            raise
        self.pending[p.key] = p
        self.client_keys[(client, req.id)] = p.key

    def _admit(self, req: P.CompleteRequest, now: float) -> tuple[str, int]:
        """The request's tenant and its tokens, reserved against the tenant's quotas."""
        tenant = req.tenant or DEFAULT_TENANT
        if tenant not in self.tenants.tenants:
            raise P.ProtocolError(f"unknown tenant {tenant!r}; this deployment's tenants: "
                                  f"{', '.join(sorted(self.tenants.tenants))}", P.BAD_REQUEST, req.id, "tenant")
        ids = self.by_name.get(req.model) if isinstance(req.model, str) else [req.model]
        spec = self.models[ids[0]].spec if ids and ids[0] in self.models else None
        cost = request_tokens(req.params, spec.max_tokens if spec and spec.max_tokens is not None else DEFAULT_MAX_TOKENS)
        try:
            wait = self.tenants.admit(tenant, cost, now)
        except ValueError as exc:
            raise P.ProtocolError(str(exc), P.BAD_REQUEST, req.id, "max_tokens") from None
        if wait is not None:
            raise P.ProtocolError(f"tenant {tenant!r} is over its quota of {self.tenants.quota_hit(tenant)}; "
                                  f"retry after {wait:.3g}s", P.RATE_LIMITED, req.id, retry_after=wait)
        return tenant, cost

    def _queue_or_send(self, client: bytes, msg: dict, frame: bytes, req: P.CompleteRequest, candidates: list[int],
                       tenant: str, cost: int, now: float) -> Pending:
        if all(self.models[m].abandoned and not self.registry.usable(m) for m in candidates):
            raise P.ProtocolError(f"no worker serves model {req.model!r}: its workers kept failing and were not "
                                  "restarted (see the deployment's log)", P.NO_WORKER, req.id)
        model_id = candidates[0] if len(candidates) == 1 else min(candidates, key=self.registry.load)
        self.models[model_id].last_use = now
        self.lifecycle.touch(model_id, now)
        key = self.requests.new_key()
        if "seed" in msg:  # the field the router's own seed goes in (wire/protocol.py): not the client's
            del msg["seed"]
            frame = P.pack(msg)
        if req.params.get("seed") is None and req.params.get("temperature") != 0:
            # fixed here, once: a resent or retried request then gives the same tokens anywhere; appended
            # to the frame as received (a prompt of thousands of tokens is not encoded again)
            frame = P.with_field(frame, "seed", random.getrandbits(63))
        p = Pending(key, client, req.id, model_id, frame, now, list(candidates), tenant=tenant, cost=cost,
                    weight=self.tenants.weight(tenant), arrived=now)
        worker = self.registry.pick(model_id, self.config.max_inflight, self.fair)
        if worker is None:
            q = self.models[model_id].queue
            if len(q) >= self.config.max_queue:
                raise P.ProtocolError(f"model {self.models[model_id].name!r} (ID {model_id}) is busy: "
                                      f"{len(q)} requests queued; retry later", P.BUSY, req.id)
            p.for_load = not self.registry.has_loaded(model_id)
            q.append(p)
        else:
            self.requests.dispatch(p, worker, now)
        return p

    def fail(self, p: Pending, code: str, message: str) -> None:
        """Answer a pending request with an error and forget it (the lifecycle's LifecycleHost.fail)."""
        self.requests.fail(p, code, message, self.now)

    def undeliverable_send(self, send: Send, why: str, now: float, gone: bool = False) -> None:
        """The socket could not deliver `send` (full queue; `gone`: the peer is no longer connected):
        never lose it silently."""
        self.now = now
        if send.side == BACK:
            w = self.workers.get(send.frames[0])
            if w is not None:
                self._drop(w, f"unreachable: {why}", now)
            return
        self.undeliverable += 1
        keys = dict.fromkeys(send.keys)  # the undelivered message's requests first, then in arrival order
        if gone:  # every request of a client that has gone is cancelled at once: one line, not one a reply
            keys.update(dict.fromkeys(k for (client, _), k in self.client_keys.items() if client == send.frames[0]))
        live = [p for p in (self.pending.get(k) for k in keys) if p is not None]
        for p in live:
            self.requests.cancel(p.key, now)
        if live:
            ids = ", ".join(repr(p.client_id) for p in live[:3]) + (f" and {len(live) - 3} more" if len(live) > 3 else "")
            self.log(f"router: cannot deliver to the client of request{'s' if len(live) > 1 else ''} {ids} ({why}); "
                     "cancelled")
        elif not gone:  # a reply to a client already gone and its requests cancelled says nothing more
            self.log(f"router: cannot deliver a reply to a client ({why})")

    # --- workers ---------------------------------------------------------------------------------
    def worker(self, ident: bytes, frame: bytes, now: float) -> None:
        self.now = now
        try:
            msg = P.unpack(frame, P.WORKER_TYPES)
        except P.ProtocolError:
            return
        w = self.workers.get(ident)
        mtype = msg["type"]
        if mtype == P.READY:
            if w is not None:
                self._drop(w, "re-registered", now)
            caps = msg.get("capabilities") if isinstance(msg.get("capabilities"), dict) else {}
            w = self.registry.register(ident, caps, now)
            self.outbox.worker(ident, P.pack({"type": P.ASSIGN, "worker_id": w.worker_id, "model_id": w.model_id,
                                              "model": self.registry.spec_for(w).to_wire()}))
            return
        if w is None:
            return  # a worker we dropped: it registers again when our heartbeats stop reaching it
        w.last_seen = now
        if mtype == P.HEARTBEAT and isinstance(msg.get("engine"), dict):
            w.engine = {k: v for k, v in msg["engine"].items() if k in P.ENGINE_STATS and isinstance(v, int)}
        if mtype == P.LOADED:
            self.models[w.model_id].ready_at = now
            w.loaded = True
            w.load_error = None
            if isinstance(msg.get("weights"), dict):
                w.weights = {k: v for k, v in msg["weights"].items() if k in ("bytes", "shared", "path")}
            if isinstance(msg.get("compile"), dict):
                w.compile = dict(msg["compile"])
            if isinstance(msg.get("kernels"), dict):
                w.kernels = {str(k): str(v) for k, v in msg["kernels"].items()}
            self.lifecycle.loaded(w.model_id, now)
            self.requests.drain(w.model_id, now)
        elif mtype == P.LOAD_FAILED:
            # shown in status; the model's queue waits restart_wait for a worker that can load it
            w.load_error = str(msg.get("message"))[:2000]
            m = self.models[w.model_id]
            if not self.registry.usable(w.model_id) and m.orphan_since is None:
                m.orphan_since = now
            self.lifecycle.load_failed(w.model_id, w.load_error, now)  # a copy loading at run time fails at once

    def worker_data(self, ident: bytes, head: bytes, body: bytes, now: float) -> None:
        self.now = now
        w = self.workers.get(ident)
        if w is None:
            self.stray += 1  # a dropped worker's late output (its requests went elsewhere): refused
            return
        w.last_seen = now
        try:
            mtype, key, tokens = P.unpack_header(head)
        except P.ProtocolError:
            return
        p = self.pending.get(key)
        if p is None:
            return  # cancelled meanwhile, or from an earlier router's epoch
        if p.worker != ident:
            self.stray += 1  # another worker's request (a dropped worker's late output): never cross results
            return
        if mtype == P.CHUNK and isinstance(tokens, list):
            for index, total in tokens:
                p.streamed[index] = max(total, p.streamed.get(index, 0))
        elif mtype == P.RESULT:
            w.served += 1
            w.tokens += tokens if isinstance(tokens, int) else 0
            p.served = tokens if isinstance(tokens, int) else 0
        elif mtype == P.ERROR:
            w.errors += 1
        if mtype != P.CHUNK:
            self.requests.finish(key, now)
        if mtype == P.RESULT:
            body = timed(p, body, now)
        self.outbox.data(p.client, body, key)

    def _drop(self, w: WorkerState, why: str, now: float) -> None:
        self.registry.remove(w, why, now)
        lost = f"worker {w.worker_id} serving model {w.model_id} was lost ({why})"
        requeued: set[int] = set()
        for key in sorted(w.inflight):
            p = self.pending.get(key)
            if p is None:
                continue
            p.worker = None
            live = [mid for mid in p.candidates if self.registry.has_loaded(mid)]
            room = [mid for mid in live if len(self.models[mid].queue) < self.config.max_queue]
            if room and p.resends < self.config.max_redispatch:
                self.requests.resend(p, min(room, key=self.registry.load), now)
                requeued.add(p.model_id)
                continue
            more = ("; no other live worker serves it" if not live else
                    "; every other copy's queue is full" if not room else
                    f"; it was sent again {p.resends} times already (max_redispatch)")
            self.fail(p, P.WORKER_LOST, lost + more)
        w.inflight.clear()
        for mid in requeued:
            self.requests.drain(mid, now)
        self.lifecycle.exited(None, now)

    def control(self, frame: bytes, now: float) -> None:
        """The local supervisor: worker_exited {pid, host, slot, restart}."""
        self.now = now
        try:
            msg = P.unpack(frame, {P.WORKER_EXITED})
        except P.ProtocolError:
            return
        model_id = None
        slot = msg.get("slot")
        specs = self.registry.worker_specs
        if isinstance(slot, int) and 0 <= slot < len(specs):
            model_id = specs[slot].model_id
        for w in list(self.workers.values()):
            if w.capabilities.get("pid") == msg.get("pid") and w.capabilities.get("host") == msg.get("host"):
                model_id = w.model_id
                self._drop(w, "its process exited", now)
        if msg.get("restart") is False and model_id in self.models and not self.registry.usable(model_id):
            m = self.models[model_id]
            if m.state == P.STATE_LOADING:
                why = msg.get("why") if isinstance(msg.get("why"), str) else None
                self.lifecycle.load_failed(model_id, why or "its worker process kept exiting (see the deployment's log)",
                                           now)
            elif m.state != P.STATE_UNLOADING:
                m.abandoned = True
                self._expire_queue(m, now)
        self.lifecycle.exited(slot if isinstance(slot, int) else None, now)

    def tick(self, now: float) -> None:
        """Heartbeats out, silent workers dropped, queued requests of workerless models expired."""
        self.now = now
        deadline = self.config.heartbeat_interval * self.config.liveness
        beat = P.pack({"type": P.HEARTBEAT})
        for w in list(self.workers.values()):
            if now - w.last_seen > deadline:
                self._drop(w, "no heartbeat", now)
            else:
                self.outbox.worker(w.ident, beat)
        for m in list(self.models.values()):
            if self.registry.usable(m.model_id):
                m.orphan_since = None
            else:
                self._expire_queue(m, now)
        self.lifecycle.tick(now)

    def _expire_queue(self, m: ModelEntry, now: float) -> None:
        loading = m.state == P.STATE_LOADING
        wait = self.config.load_timeout if loading else self.config.restart_wait
        failed = [w for w in self.registry.of_model(m.model_id) if w.load_error]
        why = f"; its worker could not load it: {failed[0].load_error}" if failed else ""
        for p in list(m.queue):
            since = max(p.queued_at, m.orphan_since or 0.0)
            if m.abandoned or now - since >= wait:
                m.queue.remove(p)
                self.no_worker += 1
                self.fail(p, P.NO_WORKER, f"no worker served model {m.name!r} (ID {m.model_id}) within "
                                           f"{'load_timeout' if loading else 'restart_wait'} ({wait:g}s){why}")

    def shutdown_messages(self) -> None:
        for w in self.workers.values():
            self.outbox.worker(w.ident, P.pack({"type": P.SHUTDOWN}))

    # --- admin -----------------------------------------------------------------------------------
    def models_info(self) -> list[dict]:
        """One entry per model ID; with a supervisor, also one per variant with no copy (`id` None)."""
        return self.lifecycle.models_info()

    def status(self) -> dict:
        return {
            "epoch": self.epoch,
            "workers": self.registry.status(),
            "queued": {str(m.model_id): len(m.queue) for m in self.models.values()},
            "pending": len(self.pending),
            "resent": self.requests.resent,
            "undeliverable": self.undeliverable,
            "stray": self.stray,
            "no_worker": self.no_worker,
            "internal_errors": self.internal_errors,
            "tenants": self.tenants.status(self._queued_by_tenant(), self.now),
            "gpu_sharing": self.config.gpu_sharing,
            **self.lifecycle.status(),
        }

    def _queued_by_tenant(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.models.values():
            for tenant, n in m.queue.by_tenant().items():
                out[tenant] = out.get(tenant, 0) + n
        return out
