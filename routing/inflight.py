"""The requests the router holds, and what it sends: each request's Pending record from arrival to
its answer, the keys clients know them by, and how a request reaches a worker, waits in its
model's queue, is sent again after its worker was lost, is cancelled or finishes. Socket-free like
the dispatch (routing/dispatch.py), which decides when each of these happens; everything to send
goes to the Outbox, which the router's I/O loop (routing/router.py) writes to its sockets.

Request keys are `<epoch>-<n>`, the epoch new for every router: a worker still holding work from
an earlier router can never answer a request of this one.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field

from routing.registry import ModelEntry, WorkerRegistry, WorkerState
from routing.tenants import DEFAULT_TENANT, TenantBook
from wire import protocol as P

FRONT, BACK = "front", "back"
SUPER = "super"  # the supervisor (routing/lifecycle.py's start_worker and stop_worker)


@dataclass(slots=True)
class Pending:
    key: str
    client: bytes
    client_id: str
    model_id: int
    frame: bytes  # the client's request (seed fixed), forwarded to the worker as is
    queued_at: float
    candidates: list[int] = field(default_factory=list)  # model IDs that may serve it
    worker: bytes | None = None
    streamed: dict = field(default_factory=dict)  # sample index -> tokens the client already has
    resends: int = 0
    tenant: str = DEFAULT_TENANT
    cost: int = 1  # the completion tokens it may be served (its tenant's reservation, its fair-queue cost)
    weight: float = 1.0  # its tenant's
    served: int = 0  # completion tokens its result reported
    arrived: float = 0.0  # when the router took it (queued_at moves when it is sent again)
    dispatched: float = 0.0  # when it was last sent to a worker
    load_wait: float = 0.0  # of the time before that, what it spent waiting for its model to load
    for_load: bool = False  # queued while its copy had no loaded worker


@dataclass(slots=True)
class Send:
    side: str  # FRONT (a client), BACK (a worker) or SUPER (the supervisor: frames is [message])
    frames: list[bytes]  # [peer identity, *message frames]
    keys: tuple[str, ...] = ()  # the requests a data message (or a bundle of them) belongs to


class Outbox:
    """What the dispatch sends, in order, until the router's I/O loop takes it."""

    def __init__(self) -> None:
        self.sends: list[Send] = []

    def take(self) -> list[Send]:
        """The sends in order, where the data messages of one peer go as one bundle (at the place of
        its first): a worker's turn reaches each client as one frame, each request's messages in
        order, and the requests a drain of the clients' socket sends one worker reach it as one."""
        out, self.sends = self.sends, []
        if len(out) < 2:
            return out
        groups: dict[tuple[str, bytes], list[Send]] = {}
        for send in out:
            if send.keys:
                groups.setdefault((send.side, send.frames[0]), []).append(send)
        if len(groups) == sum(map(len, groups.values())):
            return out  # one data message a peer at most: nothing to bundle
        merged: list[Send] = []
        for send in out:
            group = groups.get((send.side, send.frames[0])) if send.keys else None
            if group is None:
                merged.append(send)
            elif group:  # the peer's first: all its data messages, bundled
                merged.append(send if len(group) == 1 else Send(
                    send.side, [send.frames[0], P.bundle([f for g in group for f in g.frames[1:]])],
                    tuple(k for g in group for k in g.keys)))
                group.clear()
        return merged

    def client(self, client: bytes, msg: dict, envelope: bool = False) -> None:
        """`envelope`: after an empty frame, as a REQ socket reads its replies."""
        self.sends.append(Send(FRONT, [client, b"", P.pack(msg)] if envelope else [client, P.pack(msg)]))

    def data(self, client: bytes, body: bytes, key: str) -> None:
        """A worker's data message for a request, forwarded as is."""
        self.sends.append(Send(FRONT, [client, body], (key,)))

    def worker(self, ident: bytes, frame: bytes) -> None:
        """A control message for a worker."""
        self.sends.append(Send(BACK, [ident, frame]))

    def request(self, ident: bytes, key: str, frame: bytes) -> None:
        """A request for a worker: its header and the client's frame."""
        self.sends.append(Send(BACK, [ident, P.header(P.REQUEST, key), frame], (key,)))

    def supervisor(self, msg: dict) -> None:
        self.sends.append(Send(SUPER, [P.pack(msg)]))


class Requests:
    """The requests in flight (`pending`, by key) and the clients' ids for them (`client_keys`)."""

    def __init__(self, models: dict[int, ModelEntry], registry: WorkerRegistry, outbox: Outbox, tenants: TenantBook,
                 max_inflight: int, fair: bool):
        """`max_inflight`: requests one worker holds at once; `fair`: with tenants, a worker holds at
        most its batch, so that the rest wait in the model's queue, where the tenants' weights order them."""
        self.models, self.registry, self.outbox, self.tenants = models, registry, outbox, tenants
        self.workers = registry.workers
        self.max_inflight, self.fair = max_inflight, fair
        self.epoch = uuid.uuid4().hex[:12]
        self.pending: dict[str, Pending] = {}
        self.client_keys: dict[tuple[bytes, str], str] = {}
        self._keys = itertools.count()
        self.resent = 0  # requests sent again after losing their worker

    def new_key(self) -> str:
        return f"{self.epoch}-{next(self._keys)}"

    def dispatch(self, p: Pending, w: WorkerState, now: float) -> None:
        """Send the request to worker `w`."""
        if p.for_load:  # it came while no worker of its copy had loaded: it waited for a load until one had
            p.load_wait += max(0.0, min(self.models[p.model_id].ready_at, now) - p.queued_at)
            p.for_load = False
        p.dispatched = now
        p.worker = w.ident
        w.inflight.add(p.key)
        self.outbox.request(w.ident, p.key, p.frame)

    def drain(self, model_id: int, now: float) -> None:
        """Send the model's queued requests to its workers while they have room."""
        q = self.models[model_id].queue
        while q:
            w = self.registry.pick(model_id, self.max_inflight, self.fair)
            if w is None:
                return
            self.dispatch(q.popleft(), w, now)

    def cancel(self, key: str, now: float) -> None:
        """Forget the request, and cancel it on its worker (or take it out of its queue)."""
        p = self.finish(key, now)
        if p is None:
            return
        if p.worker is not None and p.worker in self.workers:
            self.outbox.worker(p.worker, P.pack({"type": P.CANCEL, "id": key}))
        else:
            q = self.models[p.model_id].queue
            if p in q:
                q.remove(p)

    def finish(self, key: str, now: float) -> Pending | None:
        """The request is answered: forget it, settle its tenant's tokens, and give its worker's room
        to its model's queue."""
        p = self.pending.pop(key, None)
        if p is None:
            return None
        self.client_keys.pop((p.client, p.client_id), None)
        self.tenants.settle(p.tenant, p.cost, p.served or sum(p.streamed.values()), now)
        w = self.workers.get(p.worker) if p.worker else None
        if w is not None:
            w.inflight.discard(key)
            self.drain(w.model_id, now)
        return p

    def fail(self, p: Pending, code: str, message: str, now: float) -> None:
        """Answer the request with an error and forget it."""
        self.finish(p.key, now)
        self.outbox.client(p.client, P.error(p.client_id, code, message))

    def resend(self, p: Pending, model_id: int, now: float) -> None:
        """Queue a request whose worker was lost on copy `model_id`, ahead of new requests (it was
        admitted earlier), carrying how many tokens of each stream the client already has."""
        p.resends += 1
        self.resent += 1
        p.model_id = model_id
        p.queued_at = now
        p.for_load = not self.registry.has_loaded(model_id)
        if p.streamed:
            msg = P.unpack(p.frame, {P.COMPLETE})
            msg["resume"] = [[i, n] for i, n in sorted(p.streamed.items())]
            p.frame = P.pack(msg)
        self.models[model_id].queue.appendleft(p)


def timed(p: Pending, body: bytes, now: float) -> bytes:
    """The result with the router's timing of it (wire/protocol.py)."""
    queued = max(0.0, p.dispatched - p.arrived - p.load_wait)
    try:
        return P.with_timing(body, round(queued, 6), round(p.load_wait, 6), round(max(0.0, now - p.dispatched), 6))
    except P.ProtocolError:
        return body  # not a map: the client refuses it as it would have
