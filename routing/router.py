"""The router (broker): clients on a frontend ROUTER, workers on a backend ROUTER.

This module is the I/O loop only: it reads the three sockets (clients, workers, the local
supervisor's control socket), hands every message to `routing.dispatch.Dispatch` (the state and
every decision, socket-free), and writes what the dispatch queued. Both ROUTER sockets are
mandatory-routing and written without blocking, so a message that cannot be delivered (a slow
client's full queue, a vanished peer) comes back to the dispatch instead of vanishing.
One thread, one poller: no locks.
"""

from __future__ import annotations

import sys
import time
import traceback

import zmq

from routing.dispatch import BACK, SUPER, Catalog, Dispatch, ModelEntry, RouterConfig, Send
from routing.open_files import raise_open_files
from wire import protocol as P
from wire.frames import recv_routed, send_frames
from wire.security import check_bind, serve_curve
from workers.spec import ModelSpec

__all__ = ["Catalog", "ModelEntry", "Router", "RouterConfig"]


class Router:
    def __init__(self, models: list[ModelEntry], config: RouterConfig | None = None,
                 ctx: zmq.Context | None = None, worker_specs: list | None = None, log=None,
                 catalog: Catalog | None = None):
        self.config = config or RouterConfig()
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.dispatch = Dispatch(models, self.config, worker_specs, self.log, catalog)
        for addr in (self.config.frontend, self.config.backend):
            check_bind(addr, self.config.curve_keys, self.config.insecure)
        # a context of our own, terminated on shutdown (CURVE also installs an authenticator on it)
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.auth = None
        self._stop = False
        self._release_workers = True
        self.frontend = self._socket(self.config.client_queue)
        self.backend = self._socket(self.config.worker_queue)
        try:
            if self.config.curve_keys:
                self.auth = serve_curve(self.ctx, [self.frontend, self.backend], self.config.curve_keys)
            self._bind(self.frontend, self.config.frontend)
            self._bind(self.backend, self.config.backend)
        except Exception:
            self._close()
            raise
        # a supervisor that saw a worker process exit says so here: no waiting for missed heartbeats
        self.control = self.ctx.socket(zmq.PULL)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control_addr = f"inproc://router-control-{id(self)}"
        self.control.bind(self.control_addr)
        # and the other way: start this worker, stop that one (models loaded and unloaded at run time)
        self.supervise = self.ctx.socket(zmq.PUSH)
        self.supervise.setsockopt(zmq.LINGER, 0)
        self.supervise_addr = f"inproc://router-supervise-{id(self)}"
        self.supervise.bind(self.supervise_addr)

    @property
    def models(self) -> dict[int, ModelEntry]:
        return self.dispatch.models

    def status(self) -> dict:
        return self.dispatch.status()

    def _socket(self, queue: int) -> zmq.Socket:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, queue)
        s.setsockopt(zmq.MAXMSGSIZE, self.config.hard_message_limit)
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable or over the high-water mark: an error, not a drop
        return s

    def _bind(self, s: zmq.Socket, addr: str) -> None:
        deadline = time.monotonic() + 5.0
        while True:  # a restarted router may find its port still held by the closing previous socket
            try:
                s.bind(addr)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE:
                    raise
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router cannot bind {addr}: the address is in use (another deployment "
                                       "there? give --frontend and --backend other addresses)") from None
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
        d = self.dispatch
        next_beat = time.monotonic() + self.config.heartbeat_interval
        try:
            while not self._stop:
                events = dict(poller.poll(max(0.0, next_beat - time.monotonic()) * 1000))
                if self.backend in events:
                    self._drain(self.backend)
                if self.frontend in events:
                    self._drain(self.frontend)
                if self.control in events:
                    self._guarded(d.control, self.control.recv(), time.monotonic())
                now = time.monotonic()
                if now >= next_beat:
                    self._guarded(d.tick, now)
                    next_beat = now + self.config.heartbeat_interval
        finally:
            self.shutdown()

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # a bug here must cost one message, never the router
            self._internal_error()
        self._flush()

    def _internal_error(self) -> None:
        self.dispatch.internal_errors += 1
        traceback.print_exc()

    def _drain(self, sock: zmq.Socket) -> None:
        """Hand what waits on `sock` to the dispatch, then write what it queued, once: the requests
        a drain sends one worker go as one bundle, and a turn's data for one client as one."""
        d = self.dispatch
        front = sock is self.frontend
        for _ in range(1000):  # bounded, so one busy side cannot starve the other
            frames = recv_routed(sock)
            if frames is None:
                break
            now = time.monotonic()
            if len(frames) != 2:
                if front:  # a client answered; a worker speaking another protocol has no one to read it
                    d.misframed(frames[0], frames[1:])
                continue
            try:  # a bug here must cost one message, never the router
                if front:
                    d.client(frames[0], frames[1], now)
                    continue
                turn = P.unbundle(frames[1])
                if turn is None:
                    d.worker(frames[0], frames[1], now)
                    continue
            except Exception:
                self._internal_error()
                continue
            # a worker's turn of data messages, [header, body, header, body, ...]: each forwarded
            # by its header (the body is never decoded); a bad one costs itself only
            ident = frames[0]
            for i in range(0, len(turn) - 1, 2):
                try:
                    d.worker_data(ident, turn[i], turn[i + 1], now)
                except Exception:
                    self._internal_error()
        self._flush()

    def _flush(self) -> None:
        """Write what the dispatch queued; a failed write goes back to it (which may queue more)."""
        d = self.dispatch
        for _ in range(100):  # each round is a reaction to failures of the previous one: bounded
            out = d.take()
            if not out:
                return
            for send in out:
                self._write(send)

    def _write(self, send: Send) -> None:
        if send.side == SUPER:
            try:
                self.supervise.send(send.frames[0], zmq.NOBLOCK)
            except zmq.Again:  # no supervisor listens: the load waits out load_timeout, and says so
                self.log("router: no supervisor took a start/stop message")
            return
        sock = self.backend if send.side == BACK else self.frontend
        try:
            send_frames(sock, send.frames)
        except zmq.Again:
            self.dispatch.undeliverable_send(send, "its receive queue is full", time.monotonic())
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.dispatch.undeliverable_send(send, "it is no longer connected", time.monotonic(), gone=True)

    def shutdown(self) -> None:
        if self._release_workers and not self.backend.closed:
            self.dispatch.shutdown_messages()
            for send in self.dispatch.take():
                try:
                    send_frames(self.backend, send.frames)
                except zmq.ZMQError:
                    pass  # a worker that cannot hear us exits when our heartbeats stop
        self._close()

    def _close(self) -> None:
        for name in ("frontend", "backend", "control", "supervise"):
            sock = getattr(self, name, None)
            if sock is not None and not sock.closed:
                sock.close(linger=100 if name == "backend" else 0)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        if self._own_ctx:
            self.ctx.term()


def main(argv: list[str] | None = None) -> None:
    """Run a bare router: `python -m routing.router --models NAME [NAME ...]` (model ID i serves source NAME i)."""
    import argparse
    import signal

    defaults = RouterConfig()
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--frontend", default=defaults.frontend)
    ap.add_argument("--backend", default=defaults.backend)
    ap.add_argument("--models", nargs="+", required=True, help="model sources; model ID i is the i-th")
    ap.add_argument("--dtype", default="auto", help="the workers' dtype (auto, bfloat16, float32, ...)")
    ap.add_argument("--curve-keys", help="CurveZMQ keys directory (python -m wire.security DIR)")
    ap.add_argument("--insecure", action="store_true", help="allow binding off loopback without CurveZMQ")
    args = ap.parse_args(argv)
    try:
        specs = [ModelSpec(name, name, dtype=args.dtype) for name in args.models]
    except ValueError as exc:
        ap.error(str(exc))
    router = Router([ModelEntry(i, spec.name, spec) for i, spec in enumerate(specs)],
                    RouterConfig(frontend=args.frontend, backend=args.backend, curve_keys=args.curve_keys,
                                 insecure=args.insecure))
    signal.signal(signal.SIGTERM, lambda *_: router.stop())
    signal.signal(signal.SIGINT, lambda *_: router.stop())
    raise_open_files()  # its clients, a connection a file
    print(f"router: clients {router.frontend_addr}, workers {router.backend_addr}", flush=True)
    router.run()


if __name__ == "__main__":
    main()
