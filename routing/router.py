"""The router (broker): clients on a frontend ROUTER, workers on a backend ROUTER.

A worker's READY gets a worker ID and a model ID - round-robin in registration order (worker k
serves model k mod M; a model left with no live worker is filled first). Requests name a model
(any replica: the least loaded) or a model ID (that copy). Only that model's workers see them.
Requests for a model with no loaded worker wait in a bounded queue; past the bound the client
gets `busy`. Heartbeats go both ways; a worker silent for `liveness` intervals is dropped and
its in-flight requests are sent again to another live worker of a model they may use (greedy and
seeded requests give the same tokens anywhere; a stream's seed is fixed here on arrival, and the
resend carries how many tokens of each stream the client already has, so none is sent twice).
With no such worker, or after `max_redispatch` resends, the client gets `worker_lost` at once.
One thread, one poller: no locks.
"""

from __future__ import annotations

import itertools
import random
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import zmq

from routing import protocol as P
from routing.security import check_bind, serve_curve


@dataclass(slots=True)
class RouterConfig:
    frontend: str = "tcp://127.0.0.1:5555"
    backend: str = "tcp://127.0.0.1:5556"
    heartbeat_interval: float = 0.5
    liveness: int = 6
    max_queue: int = 1024  # waiting requests per model before `busy`
    max_inflight: int = 256  # requests one worker holds at once; the rest wait in the model's queue
    max_redispatch: int = 2  # resends of one request after losing its worker (a request that kills
    # every worker it reaches must not take down the whole deployment)
    hard_message_limit: int = 64 * 1024 * 1024  # the socket drops peers beyond this (ZMQ_MAXMSGSIZE)
    curve_keys: str | None = None  # CurveZMQ keys directory (routing.security): both sockets then need keys
    insecure: bool = False  # allow binding off loopback without CurveZMQ

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_inflight", "liveness"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass(slots=True)
class ModelEntry:
    model_id: int
    name: str
    spec: dict  # sent to the worker in ASSIGN: source, dtype, engine config, defaults
    queue: deque = field(default_factory=deque)


@dataclass(slots=True)
class WorkerState:
    ident: bytes
    worker_id: int
    model_id: int
    capabilities: dict
    alive: bool = True
    loaded: bool = False
    last_seen: float = 0.0
    inflight: set = field(default_factory=set)
    served: int = 0
    tokens: int = 0
    errors: int = 0
    load_error: str | None = None
    engine: dict = field(default_factory=dict)  # the worker's own counters, from its heartbeats


@dataclass(slots=True)
class Pending:
    key: str
    client: bytes
    client_id: str
    model_id: int
    frame: bytes  # the client's request, forwarded to the worker as received
    candidates: list[int] = field(default_factory=list)  # model IDs that may serve it
    worker: bytes | None = None
    streamed: dict = field(default_factory=dict)  # sample index -> tokens the client already has
    resends: int = 0


class Router:
    def __init__(self, models: list[ModelEntry], config: RouterConfig | None = None,
                 ctx: zmq.Context | None = None, worker_overrides: list[dict] | None = None):
        if not models:
            raise ValueError("the router needs at least one model")
        self.config = config or RouterConfig()
        self.models = {m.model_id: m for m in models}
        self.by_name: dict[str, list[int]] = {}
        for m in models:
            self.by_name.setdefault(m.name, []).append(m.model_id)
        for addr in (self.config.frontend, self.config.backend):
            check_bind(addr, self.config.curve_keys, self.config.insecure)
        # CURVE installs an authenticator on its context: give it a context of its own
        self.ctx = ctx or (zmq.Context() if self.config.curve_keys else zmq.Context.instance())
        self.auth = None
        # the deployment plan's per-worker settings (device, threads, batch limits), by registration order
        self.worker_overrides = worker_overrides or []
        self.workers: dict[bytes, WorkerState] = {}
        self.pending: dict[str, Pending] = {}
        self.client_keys: dict[tuple[bytes, str], str] = {}
        self._keys = itertools.count()
        self._registrations = 0
        self.resent = 0  # requests sent again after losing their worker
        self.internal_errors = 0
        self._stop = False
        self._release_workers = True
        self.frontend = self._socket()
        self.backend = self._socket()
        try:
            if self.config.curve_keys:
                self.auth = serve_curve(self.ctx, [self.frontend, self.backend], self.config.curve_keys)
            self._bind(self.frontend, self.config.frontend)
            self._bind(self.backend, self.config.backend)
        except Exception:
            self.frontend.close(linger=0)
            self.backend.close(linger=0)
            if self.auth is not None:
                self.auth.stop()
            raise
        # a supervisor that saw a worker process exit says so here: no waiting for missed heartbeats
        self.control = self.ctx.socket(zmq.PULL)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control_addr = f"inproc://router-control-{id(self)}"
        self.control.bind(self.control_addr)

    def _socket(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, self.config.hard_message_limit)
        s.setsockopt(zmq.ROUTER_MANDATORY, 0)
        return s

    def _bind(self, s: zmq.Socket, addr: str) -> None:
        deadline = time.monotonic() + 5.0
        while True:  # a restarted router may find its port still held by the closing previous socket
            try:
                s.bind(addr)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    s.close(linger=0)
                    raise
                time.sleep(0.1)

    @property
    def frontend_addr(self) -> str:
        return self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def backend_addr(self) -> str:
        return self.backend.getsockopt_string(zmq.LAST_ENDPOINT)

    # --- main loop -----------------------------------------------------------------------------
    def stop(self, release_workers: bool = True) -> None:
        """End run(). release_workers=False leaves workers up (they reconnect to the next router)."""
        self._release_workers = release_workers
        self._stop = True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        poller.register(self.control, zmq.POLLIN)
        next_beat = time.monotonic() + self.config.heartbeat_interval
        try:
            while not self._stop:
                events = dict(poller.poll(max(0.0, next_beat - time.monotonic()) * 1000))
                if self.backend in events:
                    self._drain(self.backend, self._on_worker)
                if self.frontend in events:
                    self._drain(self.frontend, self._on_client)
                if self.control in events:
                    self._on_control(self.control.recv())
                now = time.monotonic()
                if now >= next_beat:
                    self._heartbeat(now)
                    next_beat = now + self.config.heartbeat_interval
        finally:
            self.shutdown()

    def _drain(self, sock: zmq.Socket, handler) -> None:
        for _ in range(1000):  # bounded, so one busy side cannot starve the other
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(frames) == 2:
                    handler(frames[0], frames[1])
                elif len(frames) == 3 and sock is self.backend:
                    self._on_worker_data(frames[0], frames[1], frames[2])
                # anything else is a peer speaking another protocol: nothing sensible to answer
            except Exception:  # a bug here must cost one message, never the router
                self.internal_errors += 1
                traceback.print_exc()

    def shutdown(self) -> None:
        for w in self.workers.values():
            if w.alive and self._release_workers:
                self.backend.send_multipart([w.ident, P.pack({"type": P.SHUTDOWN})])
        for sock in (self.frontend, self.backend, self.control):
            if not sock.closed:
                sock.close(linger=100)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None

    # --- clients ---------------------------------------------------------------------------------
    def _reply(self, client: bytes, msg: dict) -> None:
        self.frontend.send_multipart([client, P.pack(msg)])

    def _on_client(self, client: bytes, frame: bytes) -> None:
        try:
            msg = P.unpack(frame, P.CLIENT_TYPES)
            mtype = msg["type"]
            if mtype == P.COMPLETE:
                self._on_complete(client, msg, frame)
            elif mtype == P.CANCEL:
                if isinstance(msg.get("id"), str):
                    self._on_cancel(client, msg["id"])
            elif mtype == P.MODELS:
                self._reply(client, {"type": P.REPLY, "id": msg.get("id"), "data": self.models_info()})
            elif mtype == P.STATUS:
                self._reply(client, {"type": P.REPLY, "id": msg.get("id"), "data": self.status()})
        except P.ProtocolError as exc:
            self._reply(client, P.error(exc.request_id, exc.code, str(exc)))

    def _resolve(self, model) -> list[int]:
        if isinstance(model, int):
            if model not in self.models:
                raise P.ProtocolError(f"unknown model ID {model}; known IDs: {sorted(self.models)}", P.UNKNOWN_MODEL)
            return [model]
        if model not in self.by_name:
            raise P.ProtocolError(f"unknown model {model!r}; known models: {sorted(self.by_name)}", P.UNKNOWN_MODEL)
        return self.by_name[model]

    def _load(self, model_id: int) -> tuple[float, int]:
        """Pending work per live worker, then requests served: idle copies take turns."""
        ws = [w for w in self.workers.values() if w.alive and w.loaded and w.model_id == model_id]
        queued = len(self.models[model_id].queue)
        served = sum(w.served + len(w.inflight) for w in self.workers.values() if w.model_id == model_id)
        if not ws:
            return 1e9 + queued, served
        return (sum(len(w.inflight) for w in ws) + queued) / len(ws), served

    def _on_complete(self, client: bytes, msg: dict, frame: bytes) -> None:
        req = P.CompleteRequest.from_msg(msg)
        try:
            candidates = self._resolve(req.model)
        except P.ProtocolError as exc:
            exc.request_id = req.id
            raise
        if (client, req.id) in self.client_keys:
            raise P.ProtocolError(f"request id {req.id!r} is already in flight", request_id=req.id)
        model_id = min(candidates, key=self._load)
        key = str(next(self._keys))
        if req.stream and req.params.get("seed") is None:
            # a resent stream must continue with the same tokens: fix its seed now
            msg["params"] = {**req.params, "seed": random.getrandbits(63)}
            frame = P.pack(msg)
        p = Pending(key, client, req.id, model_id, frame, list(candidates))
        worker = self._pick_worker(model_id)
        if worker is None:
            q = self.models[model_id].queue
            if len(q) >= self.config.max_queue:
                raise P.ProtocolError(f"model {self.models[model_id].name!r} (ID {model_id}) is busy: "
                                      f"{len(q)} requests queued; retry later", P.BUSY, req.id)
            q.append(p)
        else:
            self._dispatch(p, worker)
        self.pending[key] = p
        self.client_keys[(client, req.id)] = key

    def _pick_worker(self, model_id: int) -> WorkerState | None:
        ws = [w for w in self.workers.values()
              if w.alive and w.loaded and w.model_id == model_id and len(w.inflight) < self.config.max_inflight]
        return min(ws, key=lambda w: (len(w.inflight), w.served)) if ws else None

    def _dispatch(self, p: Pending, w: WorkerState) -> None:
        p.worker = w.ident
        w.inflight.add(p.key)
        self.backend.send_multipart([w.ident, P.header(P.REQUEST, p.key), p.frame])

    def _drain_queue(self, model_id: int) -> None:
        q = self.models[model_id].queue
        while q:
            w = self._pick_worker(model_id)
            if w is None:
                return
            self._dispatch(q.popleft(), w)

    def _on_cancel(self, client: bytes, client_id) -> None:
        key = self.client_keys.get((client, client_id))
        if key is None:
            return
        p = self._finish(key)
        if p is None:
            return
        if p.worker is not None and p.worker in self.workers:
            self.backend.send_multipart([p.worker, P.pack({"type": P.CANCEL, "id": key})])
        else:
            q = self.models[p.model_id].queue
            if p in q:
                q.remove(p)

    def _finish(self, key: str) -> Pending | None:
        p = self.pending.pop(key, None)
        if p is None:
            return None
        self.client_keys.pop((p.client, p.client_id), None)
        w = self.workers.get(p.worker) if p.worker else None
        if w is not None:
            w.inflight.discard(key)
            self._drain_queue(w.model_id)
        return p

    # --- workers ---------------------------------------------------------------------------------
    def _assign_model(self) -> int:
        live = {mid: 0 for mid in self.models}
        for w in self.workers.values():
            if w.alive:
                live[w.model_id] += 1
        ids = sorted(self.models)
        rr = ids[self._registrations % len(ids)]
        orphaned = [mid for mid in ids if live[mid] == 0]
        return rr if live[rr] == 0 or not orphaned else orphaned[0]

    def _spec_for(self, worker_id: int, model_id: int) -> dict:
        spec = dict(self.models[model_id].spec)
        if self.worker_overrides:
            o = self.worker_overrides[worker_id % len(self.worker_overrides)]
            if o.get("model_id", model_id) != model_id:
                # a restarted worker takes over a model ID out of turn: use that model's planned settings
                o = next((x for x in self.worker_overrides if x.get("model_id") == model_id), {})
            spec.update({k: v for k, v in o.items() if k != "model_id"})
        return spec

    def _on_worker(self, ident: bytes, frame: bytes) -> None:
        try:
            msg = P.unpack(frame, P.WORKER_TYPES)
        except P.ProtocolError:
            return
        w = self.workers.get(ident)
        mtype = msg["type"]
        if mtype == P.READY:
            if w is not None and w.alive:
                self._drop(w, "re-registered")
            model_id = self._assign_model()
            caps = msg.get("capabilities") if isinstance(msg.get("capabilities"), dict) else {}
            w = WorkerState(ident, self._registrations, model_id, caps, last_seen=time.monotonic())
            self._registrations += 1
            self.workers[ident] = w
            self.backend.send_multipart([ident, P.pack({"type": P.ASSIGN, "worker_id": w.worker_id,
                                                        "model_id": model_id,
                                                        "model": self._spec_for(w.worker_id, model_id)})])
            return
        if w is None or not w.alive:
            return  # a worker we dropped: it re-registers when our heartbeats stop reaching it
        w.last_seen = time.monotonic()
        if mtype == P.HEARTBEAT and isinstance(msg.get("engine"), dict):
            w.engine = {k: v for k, v in msg["engine"].items() if k in ("running", "aborted") and isinstance(v, int)}
        if mtype == P.LOADED:
            w.loaded = True
            w.load_error = None
            self._drain_queue(w.model_id)
        elif mtype == P.LOAD_FAILED:
            w.load_error = str(msg.get("message"))[:2000]  # shown in status; the model's queue keeps waiting

    def _on_worker_data(self, ident: bytes, head: bytes, body: bytes) -> None:
        w = self.workers.get(ident)
        if w is None or not w.alive:
            return
        w.last_seen = time.monotonic()
        try:
            mtype, key, tokens = P.unpack_header(head)
        except P.ProtocolError:
            return
        p = self.pending.get(key)
        if p is None:
            return  # cancelled meanwhile
        if mtype == P.CHUNK and isinstance(tokens, list):
            for index, total in tokens:
                p.streamed[index] = max(total, p.streamed.get(index, 0))
        elif mtype == P.RESULT:
            w.served += 1
            w.tokens += tokens if isinstance(tokens, int) else 0
        elif mtype == P.ERROR:
            w.errors += 1
        if mtype != P.CHUNK:
            self._finish(key)
        self.frontend.send_multipart([p.client, body])

    def _drop(self, w: WorkerState, why: str) -> None:
        w.alive = False
        lost = f"worker {w.worker_id} serving model {w.model_id} was lost ({why})"
        requeued: set[int] = set()
        for key in list(w.inflight):
            w.inflight.discard(key)
            p = self.pending.get(key)
            if p is None:
                continue
            p.worker = None
            live = [mid for mid in p.candidates if self._has_live_worker(mid)]
            if live and p.resends < self.config.max_redispatch:
                self._resend(p, min(live, key=self._load))
                requeued.add(p.model_id)
                continue
            self._finish(key)
            more = "" if live else "; no other live worker serves it"
            self._reply(p.client, P.error(p.client_id, P.WORKER_LOST, lost + more))
        w.inflight.clear()
        for mid in requeued:
            self._drain_queue(mid)

    def _has_live_worker(self, model_id: int) -> bool:
        return any(w.alive and w.loaded and w.model_id == model_id for w in self.workers.values())

    def _resend(self, p: Pending, model_id: int) -> None:
        p.resends += 1
        self.resent += 1
        p.model_id = model_id
        if p.streamed:
            msg = P.unpack(p.frame, {P.COMPLETE})
            msg["resume"] = [[i, n] for i, n in sorted(p.streamed.items())]
            p.frame = P.pack(msg)
        # ahead of new requests and past the queue bound: it was admitted already
        self.models[model_id].queue.appendleft(p)

    def _on_control(self, frame: bytes) -> None:
        try:
            msg = P.unpack(frame, {P.WORKER_EXITED})
        except P.ProtocolError:
            return
        for w in self.workers.values():
            if w.alive and w.capabilities.get("pid") == msg.get("pid") and w.capabilities.get("host") == msg.get("host"):
                self._drop(w, "its process exited")

    def _heartbeat(self, now: float) -> None:
        deadline = self.config.heartbeat_interval * self.config.liveness
        beat = P.pack({"type": P.HEARTBEAT})
        for w in list(self.workers.values()):
            if not w.alive:
                continue
            if now - w.last_seen > deadline:
                self._drop(w, "no heartbeat")
                continue
            self.backend.send_multipart([w.ident, beat])

    # --- admin -----------------------------------------------------------------------------------
    def models_info(self) -> list[dict]:
        return [{"id": m.model_id, "name": m.name,
                 "workers": sorted(w.worker_id for w in self.workers.values() if w.alive and w.model_id == m.model_id)}
                for m in self.models.values()]

    def status(self) -> dict:
        return {
            "workers": [{"id": w.worker_id, "model_id": w.model_id, "alive": w.alive, "loaded": w.loaded,
                         "served": w.served, "tokens": w.tokens, "errors": w.errors, "inflight": len(w.inflight),
                         "pid": w.capabilities.get("pid"), "load_error": w.load_error,
                         "engine": w.engine}
                        for w in sorted(self.workers.values(), key=lambda w: w.worker_id)],
            "queued": {str(m.model_id): len(m.queue) for m in self.models.values()},
            "pending": len(self.pending),
            "resent": self.resent,
            "internal_errors": self.internal_errors,
        }


def main(argv: list[str] | None = None) -> None:
    """Run a bare router: `python -m routing.router --models NAME [NAME ...]` (workers get {"source": NAME})."""
    import argparse
    import signal

    defaults = RouterConfig()
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--frontend", default=defaults.frontend)
    ap.add_argument("--backend", default=defaults.backend)
    ap.add_argument("--models", nargs="+", required=True, help="model sources; model ID i is the i-th")
    ap.add_argument("--dtype", default="auto", help="the workers' dtype (auto, bfloat16, float32, ...)")
    ap.add_argument("--curve-keys", help="CurveZMQ keys directory (python -m routing.security DIR)")
    ap.add_argument("--insecure", action="store_true", help="allow binding off loopback without CurveZMQ")
    args = ap.parse_args(argv)
    router = Router([ModelEntry(i, name, {"name": name, "source": name, "dtype": args.dtype})
                     for i, name in enumerate(args.models)],
                    RouterConfig(frontend=args.frontend, backend=args.backend, curve_keys=args.curve_keys,
                                 insecure=args.insecure))
    signal.signal(signal.SIGTERM, lambda *_: router.stop())
    signal.signal(signal.SIGINT, lambda *_: router.stop())
    print(f"router: clients {router.frontend_addr}, workers {router.backend_addr}", flush=True)
    router.run()


if __name__ == "__main__":
    main()
