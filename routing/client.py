"""Clients for the router: `Client` (blocking) and `AsyncClient` (asyncio), and a small CLI.

    with Client("tcp://127.0.0.1:5555", timeout=60) as c:
        c.models(); c.status()
        c.complete(model="smollm2", prompt="Hello", max_tokens=16, temperature=0.0)
        for chunk in c.stream(model="smollm2", prompt=[1, 2, 3], max_tokens=16): ...

    python -m routing.client --router tcp://127.0.0.1:5555 --model smollm2 "Once upon a time"

Errors from the router raise `RouterError` (with `.code`: bad_request, unknown_model, busy,
worker_lost, no_worker, too_large); a timeout raises TimeoutError and cancels the request on the
worker, as does leaving a stream early. When the connection to the router drops (the router
restarted), requests in flight raise RouterError `router_lost` at once instead of waiting for
their timeout; the socket reconnects by itself, and the next request (even after a long idle time)
is served by the new router. A reply that can't be decoded or is too large fails only the request
it belongs to (`bad_reply`, `too_large`); the others go on.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import logging
import sys
import time
import uuid

import msgpack
import zmq

from routing.openai_objects import text_completion
from wire import protocol as P
from wire.security import connect_curve, endpoint_problem

_WATCH = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_SUCCEEDED)
_REFUSED = ("the router refused the connection (CurveZMQ handshake failed: is this client's key in the router's "
            "authorized_clients, and the router's server.key the one given here?)")


log = logging.getLogger(__name__)
REPLY_TYPES = {P.CHUNK, P.RESULT, P.REPLY, P.ERROR}
RECEIVE_QUEUE = 100_000  # messages: one connection may carry many streams (AsyncClient, the HTTP gateway)
BAD_REPLY = "bad_reply"


def decode_reply(frame: bytes) -> dict:
    """A reply, or an error message for the request it names when it can't be accepted (too large,
    malformed); its id is None when not even that can be read."""
    try:
        return P.unpack(frame, REPLY_TYPES)
    except P.ProtocolError as exc:
        rid = exc.request_id
        if rid is None:
            try:  # unbounded, to find the id of an oversized reply: its request must hear why it failed
                whole = msgpack.unpackb(frame, raw=False, strict_map_key=False)
                rid = whole.get("id") if isinstance(whole, dict) else None
            except Exception:
                rid = None
        code = exc.code if exc.code == P.TOO_LARGE else BAD_REPLY
        return P.error(rid if isinstance(rid, str) else None, code, f"the router's reply could not be used: {exc}")


def replies(frame: bytes) -> list[dict]:
    """The replies one frame from the router holds: a bundle of them (wire.protocol) or one."""
    bodies = P.unbundle(frame)
    return [decode_reply(frame)] if bodies is None else [decode_reply(b) for b in bodies]


class RouterError(RuntimeError):
    """An error answer: its code (wire.protocol), message and, for a refused request parameter,
    that parameter's name."""

    def __init__(self, code: str, message: str, param: str | None = None, retry_after: float | None = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.param = code, message, param
        self.retry_after = retry_after  # rate_limited: seconds after which the request would be admitted


def _frame(msg: dict) -> bytes:
    """A request's frame. A value the wire cannot carry (an integer beyond 64 bits, which JSON
    allows) is refused here, as the router would refuse a bad value: a bad_request naming it; a
    request past the router's size limits too (too_large)."""
    try:
        P.check_request(msg)
        frame = P.pack(msg)
        P.check_request(msg, frame)
        return frame
    except P.ProtocolError as exc:
        raise RouterError(exc.code, str(exc), exc.param) from None


def _check(msg: dict) -> dict:
    if msg.get("type") == P.ERROR:
        param, wait = msg.get("param"), msg.get("retry_after")
        raise RouterError(msg.get("code", P.INTERNAL), msg.get("message", ""), param if isinstance(param, str) else None,
                          wait if isinstance(wait, (int, float)) and not isinstance(wait, bool) else None)
    return msg


def _response(msg: dict):
    """A result message's response, with the router's timing of it (`timing`) where it is a map."""
    response = msg["response"]
    if isinstance(response, dict) and isinstance(msg.get("timing"), dict):
        response = {**response, "timing": msg["timing"]}
    return response


def _completion(result, token_ids: bool) -> dict:
    """The OpenAI completion of a generate result; a result that is not one is a bad reply."""
    try:
        return text_completion(result, result["model"], token_ids)
    except (KeyError, TypeError, AttributeError) as exc:
        raise RouterError(BAD_REPLY, f"the router's result is not a completion ({type(exc).__name__}: {exc})") from None


class _Base:
    """The connection both clients share: a DEALER (CURVE when given keys) and a monitor of it that
    reports a dropped or refused connection."""

    def __init__(self, address: str, timeout: float | None, ctx: zmq.Context, curve_keys: str | None,
                 curve_name: str):
        self.address, self.timeout = address, timeout
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self.ctx = ctx
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        if curve_keys:
            connect_curve(self.sock, curve_keys, curve_name)
        self.monitor = self.sock.get_monitor_socket(_WATCH)
        self.sock.connect(address)
        # A refused handshake is not retried by zmq: the refusal holds until a handshake succeeds,
        # so a request made after it (even long after) must hear it at once, not at its timeout.
        self._refusal: dict | None = None

    def close(self) -> None:
        if self.sock.closed:
            return
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)

    def _event(self, frames: list[bytes]) -> dict | None:
        """The error a connection event means for the requests in flight (the router went away, or
        refused our handshake), or None (a handshake succeeded)."""
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._refusal = None
            return None
        if event == zmq.EVENT_DISCONNECTED:
            return P.error(None, P.ROUTER_LOST, "the connection to the router dropped with this request in "
                                                "flight; it may be sent again")
        self._refusal = P.error(None, P.REFUSED, _REFUSED)
        return self._refusal

    def _forget_stale_events(self) -> None:
        """Take in the connection events from while no request was in flight (an idle client whose
        router restarted: the socket has reconnected by itself), then fail at once if the router
        refuses us."""
        if self.sock.closed:  # zmq would say only "Socket operation on non-socket"
            raise RuntimeError(f"this client of {self.address} is closed: make a new one")
        while True:
            try:
                self._event(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        self._raise_if_refused()

    def _raise_if_refused(self) -> None:
        if self._refusal is not None:
            _check(self._refusal)

    @staticmethod
    def _answers(msg: dict, rid: str) -> bool:
        """Whether `msg` is for request `rid`: its own answer, or a connection failure (for all)."""
        return msg.get("id") == rid or msg.get("code") in (P.ROUTER_LOST, P.REFUSED)

    def models(self):
        """One entry per model ID ({id, name, workers, state, pinned, resident_bytes, last_use}); where
        the deployment can load models, also one per variant with no copy (`id` None, state
        `available`). AsyncClient: await it."""
        return self._admin({"type": P.MODELS})

    def status(self):
        """The router's workers, queues and counters (AsyncClient: await it)."""
        return self._admin({"type": P.STATUS})

    def load(self, model: str, copies: int = 1, pin: bool = False, timeout: float | None = None):
        """Have `copies` copies of the variant `model` in all (a retry never adds more), pinned
        (never evicted) with `pin`; returns {model, copies: [its models entries]} once every copy
        serves. A cold load can take minutes: `timeout` (seconds) overrides the client's for this
        call. AsyncClient: await it."""
        return self._admin({"type": P.LOAD, "model": model, "copies": copies, "pin": pin}, timeout)

    def unload(self, model: str | int, copies: int | None = None, timeout: float | None = None):
        """Unload `copies` copies of `model` (highest model IDs first; None: all), or the one model ID
        `model`; each finishes its requests first (up to the deployment's unload_timeout). Returns
        {model, copies: [what is left]} once they are gone. AsyncClient: await it."""
        return self._admin({"type": P.UNLOAD, "model": model, "copies": copies}, timeout)

    def _new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    @staticmethod
    def _complete_msg(rid: str, model, prompt, stream: bool, params: dict, tenant: str | None = None) -> dict:
        """`params`: the request's parameters; `tenant`: whose request it is (routing/tenants.py)."""
        msg = {"type": P.COMPLETE, "id": rid, "model": model, "prompt": prompt, "params": params, "stream": stream}
        if tenant is not None:
            msg["tenant"] = tenant
        return msg


class Client(_Base):
    """Blocking client. One request at a time per Client; use one per thread."""

    def __init__(self, address: str = P.DEFAULT_FRONTEND, timeout: float | None = 60.0,
                 ctx: zmq.Context | None = None, curve_keys: str | None = None, curve_name: str = "client"):
        super().__init__(address, timeout, ctx or zmq.Context.instance(), curve_keys, curve_name)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self._backlog: collections.deque[dict] = collections.deque()  # replies of a bundle not yet returned

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send_raw(self, frame: bytes) -> None:
        """Send an arbitrary frame (for tests of the router's input checking)."""
        self.sock.send(frame)

    def recv(self, deadline: float | None) -> dict:
        if self._backlog:
            return self._backlog.popleft()
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            events = dict(self.poller.poll(None if wait is None else wait * 1000))
            if not events:
                raise TimeoutError(f"no answer from {self.address} within {self.timeout}s")
            if self.sock in events:
                self._backlog.extend(replies(self.sock.recv()))
                return self._backlog.popleft()
            err = self._event(self.monitor.recv_multipart())
            if err is not None:
                return err

    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def _admin(self, msg: dict, timeout: float | None = None):
        rid = self._new_id()
        self._forget_stale_events()
        self.sock.send(_frame({**msg, "id": rid}))
        deadline = self._deadline() if timeout is None else time.monotonic() + timeout
        while True:
            msg = self.recv(deadline)
            if self._answers(msg, rid):
                return _check(msg)["data"]

    def _run(self, model, prompt, stream: bool, params: dict, tenant: str | None = None):
        rid = self._new_id()
        self._forget_stale_events()
        self.sock.send(_frame(self._complete_msg(rid, model, prompt, stream, params, tenant)))
        deadline = self._deadline()
        try:
            while True:
                msg = self.recv(deadline)
                if not self._answers(msg, rid):
                    continue  # a late answer to an earlier, timed-out request
                _check(msg)
                yield msg
                if msg["type"] == P.RESULT:
                    return
        except (TimeoutError, GeneratorExit):
            if not self.sock.closed:
                try:
                    self.sock.send(P.pack({"type": P.CANCEL, "id": rid}), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the router is unreachable: it cancels on its own when it can't deliver
            raise

    def complete(self, model, prompt, *, tenant: str | None = None, **params) -> dict:
        """An OpenAI completions response dict (with `return_token_ids=True`, each choice keeps its
        `token_ids`). `tenant`: whose request it is (routing/tenants.py)."""
        for msg in self._run(model, prompt, False, params, tenant):
            if msg["type"] == P.RESULT:
                return _completion(_response(msg), bool(params.get("return_token_ids")))
        raise RouterError(P.INTERNAL, "stream ended without a result")

    def stream(self, model, prompt, *, tenant: str | None = None, **params):
        """Yield {"index", "token_ids", "text", "finish_reason"} per new token and sample."""
        for msg in self._run(model, prompt, True, params, tenant):
            if msg["type"] == P.CHUNK:
                yield from msg["outputs"]


class _Inbox:
    """One request's replies: a deque and at most one waiter (lighter than an asyncio.Queue, which
    the gateway would build and tear down for every HTTP request), and when that waiter gives up."""

    __slots__ = ("items", "waiter", "deadline")

    def __init__(self):
        self.items: collections.deque = collections.deque()
        self.waiter = None
        self.deadline = 0.0

    def put(self, msg: dict) -> None:
        self.items.append(msg)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class _InFlight:
    """One request of an AsyncClient, from its send to its result: `with` it, then `await next()`
    until `done`. Left before its result (an error of ours, a cancelled task, a closed generator),
    it cancels the request on the worker."""

    __slots__ = ("client", "rid", "done", "timeout")

    def __init__(self, client: AsyncClient, rid: str, timeout: float | None = None):
        self.client, self.rid, self.done = client, rid, False
        self.timeout = timeout  # None: the client's

    def __enter__(self) -> _InFlight:
        return self

    def __exit__(self, *exc) -> None:
        self.client._queues.pop(self.rid, None)
        if not self.done:
            self.client._sender.cancel(self.rid)

    async def next(self) -> dict:
        try:
            msg = await self.client._get(self.rid, self.timeout)
        except (RouterError, TimeoutError):
            self.done = True  # the router has forgotten it already (a timeout sent its own cancel)
            raise
        if msg["type"] == P.RESULT:
            self.done = True
        return msg


class _Sender:
    """An AsyncClient's writes. The requests of one event-loop turn reach zmq together, on the next
    turn: each hand-over wakes zmq's I/O thread and costs a loopback write; under load a turn
    holds many requests (answers come in bursts, one engine step's worth), and one write carries
    them all. A full queue (the router not reading) is retried until the request's own timeout
    gives up on it, which takes it out of the queue unsent."""

    __slots__ = ("sock", "after_send", "loop", "outbox", "flush_at")

    def __init__(self, sock: zmq.Socket, after_send):
        self.sock, self.after_send = sock, after_send
        self.loop = None
        self.outbox: dict[str, bytes] = {}  # request id -> its frame, not yet handed to zmq
        self.flush_at = None  # the loop callback (or timer) that will hand them over

    def send(self, loop, msg: dict) -> None:
        self.loop = loop
        self.outbox[msg["id"]] = _frame(msg)
        if self.flush_at is None:
            self.flush_at = loop.call_soon(self.flush)

    def flush(self) -> None:
        self.flush_at = None
        out = self.outbox
        try:
            while out:
                rid = next(iter(out))
                self.sock.send(out[rid], zmq.NOBLOCK)
                del out[rid]
        except zmq.Again:  # the queue is full: try again shortly
            self.flush_at = self.loop.call_later(0.005, self.flush)
        except zmq.ZMQError:  # closed: the requests' timeouts (or close) end them
            out.clear()
        self.after_send()

    def cancel(self, rid: str) -> None:
        """Usable where awaiting is not (a generator being closed): the write happens at once or
        not at all (the socket's queue full, or closed)."""
        if self.outbox.pop(rid, None) is not None:
            return  # never sent: nothing to cancel on the router
        try:
            self.sock.send(P.pack({"type": P.CANCEL, "id": rid}), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def clear(self) -> None:
        """The loop is going away: the requests queued on it went with it."""
        if self.flush_at is not None:
            self.flush_at.cancel()
            self.flush_at = None
        self.outbox.clear()


class AsyncClient(_Base):
    """asyncio client with the same methods; many requests may be in flight at once.

    The socket is a plain (blocking-API) zmq socket driven from the event loop: its file descriptor
    is watched with `loop.add_reader`, replies are drained without blocking, and writes use NOBLOCK.
    zmq.asyncio would make a future, and a poll, per message; at gateway rates that was most of the
    cost of a request."""

    def __init__(self, address: str = P.DEFAULT_FRONTEND, timeout: float | None = 60.0,
                 curve_keys: str | None = None, curve_name: str = "client"):
        super().__init__(address, timeout, zmq.Context.instance(), curve_keys, curve_name)
        self.sock.setsockopt(zmq.SNDHWM, RECEIVE_QUEUE)
        self._queues: dict[str, _Inbox] = {}
        self._loop = None  # the event loop whose reader watches the socket
        self._fds: tuple[int, int] = (self.sock.getsockopt(zmq.FD), self.monitor.getsockopt(zmq.FD))
        self._recheck = False
        self._sender = _Sender(self.sock, self._after_send)
        self._sweep_at = None  # the timer that fails requests waiting past their timeout
        self.reader_errors = 0  # exceptions the reader survived
        self.bad_replies = 0  # undecodable replies that named no request in flight

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._unwatch()
        super().close()

    # --- reading: one callback drains both sockets ---------------------------------------------------
    def _watch(self) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        self._unwatch()  # a loop from an earlier asyncio.run
        self._forget_stale_events()
        for fd in self._fds:
            loop.add_reader(fd, self._readable)
        self._loop = loop

    def _unwatch(self) -> None:
        self._sender.clear()
        if self._sweep_at is not None:
            self._sweep_at.cancel()
            self._sweep_at = None
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            for fd in self._fds:
                loop.remove_reader(fd)

    def _readable(self) -> None:
        self._recheck = False
        try:
            self._drain()
        except Exception:  # the one reader of every request in flight must outlive any bad moment
            self.reader_errors += 1
            log.exception("AsyncClient reader: an error, going on")

    def _after_send(self) -> None:
        """zmq's descriptor is edge-triggered, and a send may take in replies without it firing:
        look once more, soon (once per loop turn, however many sends)."""
        if not self._recheck and self._loop is not None:
            self._recheck = True
            self._loop.call_soon(self._readable)

    def _drain(self) -> None:
        while self.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            err = self._event(self.monitor.recv_multipart(zmq.NOBLOCK))
            if err is None:
                continue
            for q in self._queues.values():  # every request in flight: the router that had it is gone
                q.put(err)
        while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            for msg in replies(self.sock.recv(zmq.NOBLOCK)):
                q = self._queues.get(msg.get("id"))
                if q is not None:
                    q.put(msg)
                elif msg.get("type") == P.ERROR and msg.get("code") in (BAD_REPLY, P.TOO_LARGE):
                    self.bad_replies += 1
                    log.warning("AsyncClient: a reply for no known request was dropped: %s", msg.get("message"))

    def _open(self) -> str:
        self._watch()
        self._raise_if_refused()  # the reader may have heard it while no request was in flight
        rid = self._new_id()
        self._queues[rid] = _Inbox()
        return rid

    async def _get(self, rid: str, timeout: float | None = None) -> dict:
        q = self._queues[rid]
        if q.items:  # the common case under load: no future
            return _check(q.items.popleft())
        q.waiter = self._loop.create_future()
        timeout = self.timeout if timeout is None else timeout
        if timeout is not None:
            q.deadline = self._loop.time() + timeout
            if self._sweep_at is None:
                self._sweep_at = self._loop.call_later(min(1.0, timeout / 4), self._sweep)
        try:
            await q.waiter
        except TimeoutError:
            self._sender.cancel(rid)
            raise TimeoutError(f"no answer from {self.address} within {timeout}s") from None
        finally:
            q.waiter = None
        return _check(q.items.popleft())

    def _sweep(self) -> None:
        """Fail the waits that are past their deadline; look again later while any wait. One timer
        for all the requests in flight instead of one per request (a timeout is late by at most a
        quarter of itself, and by at most 1 s)."""
        self._sweep_at = None
        now, waiting = self._loop.time(), False
        for q in self._queues.values():  # set_exception only schedules: nothing leaves this dict meanwhile
            w = q.waiter
            if w is None or w.done():
                continue
            if q.deadline <= now:
                w.set_exception(TimeoutError())
            else:
                waiting = True
        if waiting:
            self._sweep_at = self._loop.call_later(min(1.0, (self.timeout or 1.0) / 4), self._sweep)

    async def _admin(self, msg: dict, timeout: float | None = None):
        with self._start(msg, timeout) as req:
            return (await req.next())["data"]

    def _start(self, msg: dict, timeout: float | None = None) -> _InFlight:
        rid = self._open()
        msg["id"] = rid
        try:
            self._sender.send(self._loop, msg)
        except RouterError:
            del self._queues[rid]  # never sent: nothing will answer it
            raise
        return _InFlight(self, rid, timeout)

    def _request(self, model, prompt, stream: bool, params: dict, task: str, tenant: str | None) -> _InFlight:
        msg = self._complete_msg("", model, prompt, stream, params, tenant)
        if task != P.GENERATE:
            msg["task"] = task
        return self._start(msg)

    async def events(self, model, prompt, stream: bool = True, task: str = P.GENERATE, *, tenant: str | None = None,
                     **params):
        """The raw messages of one request: chunks (when streamed), then the result; a RouterError
        for an error. Left early (a consumer that stops iterating, aclose, a cancelled task), it
        cancels the request on the worker. `tenant`: whose request it is (routing/tenants.py)."""
        with self._request(model, prompt, stream, params, task, tenant) as req:
            while not req.done:
                yield await req.next()

    async def result(self, model, prompt, task: str = P.GENERATE, *, tenant: str | None = None, **params) -> dict:
        """The request's neutral result (wire/protocol.py) with the router's `timing` of it, or
        for a tokenizer task its answer."""
        with self._request(model, prompt, False, params, task, tenant) as req:
            while not req.done:  # a non-streamed request: its result, or an error
                msg = await req.next()
        return _response(msg) if task in (P.GENERATE, P.CHAT) else msg["response"]

    async def complete(self, model, prompt, task: str = P.GENERATE, *, tenant: str | None = None, **params) -> dict:
        """An OpenAI completions response dict (with `return_token_ids=True`, each choice keeps its
        `token_ids`), or for another task that task's answer."""
        result = await self.result(model, prompt, task, tenant=tenant, **params)
        if task not in (P.GENERATE, P.CHAT):
            return result
        return _completion(result, bool(params.get("return_token_ids")))

    async def stream(self, model, prompt, *, tenant: str | None = None, **params):
        """Yield {"index", "token_ids", "text", "finish_reason"} per new token and sample; closing it
        early (aclose, or a cancelled task) cancels the request on the worker."""
        async with contextlib.aclosing(self.events(model, prompt, True, tenant=tenant, **params)) as msgs:
            async for msg in msgs:
                if msg["type"] == P.CHUNK:
                    for out in msg["outputs"]:
                        yield out


# the command line's waits for an answer: a completion (a load queued behind others, a long
# answer), and a question of the router's own, which it answers at once when it runs
ANSWER_WAIT_S, QUERY_WAIT_S = 120.0, 10.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Send a completion request to a running router.")
    ap.add_argument("prompt", nargs="?", help="prompt text (omit with --models or --status)")
    ap.add_argument("--router", default=P.DEFAULT_FRONTEND)
    ap.add_argument("--model", default=None, help="model name, or an integer model ID")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=None,
                    help=f"seconds to wait for an answer (default {ANSWER_WAIT_S:g}; {QUERY_WAIT_S:g} for --models "
                         "and --status, which a running router answers at once)")
    ap.add_argument("--models", action="store_true", help="list the models")
    ap.add_argument("--status", action="store_true", help="show the workers")
    ap.add_argument("--load", metavar="NAME", help="load the variant NAME (with --copies N in all, --pin)")
    ap.add_argument("--unload", metavar="NAME", help="unload the variant NAME (--copies N of them; default all)")
    ap.add_argument("--copies", type=int, help="with --load: copies wanted in all (default 1); with --unload: "
                                               "how many to unload")
    ap.add_argument("--pin", action="store_true", help="with --load: never evict it")
    ap.add_argument("--curve-keys", help="CurveZMQ keys directory (server.key + clients/NAME.key_secret)")
    ap.add_argument("--curve-name", default="client")
    args = ap.parse_args(argv)
    if not (args.load or args.unload or args.models or args.status) and (args.prompt is None or args.model is None):
        ap.error("give --model and a prompt (or --models / --status)")
    if args.copies is not None and args.copies < 1:  # not taken as the default: 0 copies is no request
        ap.error(f"--copies must be an integer >= 1, got {args.copies}")
    if args.timeout is not None and not args.timeout > 0:  # nan too; not taken as the default
        ap.error(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    try:
        if problem := endpoint_problem(args.router, bind=False):
            raise ValueError(problem)
        wait = args.timeout or (QUERY_WAIT_S if args.models or args.status else ANSWER_WAIT_S)
        client = Client(args.router, timeout=wait, curve_keys=args.curve_keys, curve_name=args.curve_name)
    except (ValueError, zmq.ZMQError) as exc:  # zmq's own refusal of a host it cannot read, too
        ap.error(f"--router {args.router!r} {exc}; give e.g. {P.DEFAULT_FRONTEND}")
    except OSError as exc:  # a keys directory without the keys (zmq.auth's "Invalid certificate file")
        ap.error(f"--curve-keys {args.curve_keys!r}: {exc}")
    with client as c:
        started = False  # the prompt is echoed, then its tokens: an error starts on a line of its own
        try:
            if args.load or args.unload:
                out = (c.load(args.load, args.copies or 1, args.pin) if args.load
                       else c.unload(int(args.unload) if args.unload.isdigit() else args.unload, args.copies))
                print(json.dumps(out, indent=2))
                return 0
            if args.models or args.status:
                try:
                    print(json.dumps(c.models() if args.models else c.status(), indent=2))
                except TimeoutError as exc:
                    raise TimeoutError(f"{exc}: is a deployment serving there? (run_mm.py --mode serve "
                                       "prints the address its clients connect to)") from None
                return 0
            model = int(args.model) if args.model.isdigit() else args.model
            sys.stdout.write(args.prompt)
            started = True
            for chunk in c.stream(model, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature):
                sys.stdout.write(chunk["text"])
                sys.stdout.flush()
            sys.stdout.write("\n")
        except (RouterError, TimeoutError) as exc:
            if started:
                sys.stdout.write("\n")
                sys.stdout.flush()
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
