"""A router plus its worker processes on this machine: what serve and predict start.

The worker processes are supervised: one that exits while the deployment runs is logged with its
cause and started again after a capped backoff, up to `max_restarts` times per worker. The new
process registers with the router naming its slot in the plan, so it takes back its planned model
ID and device. The router hears of every exit at once, and of the supervisor giving up on a slot
(its model's queued requests then fail with `no_worker` instead of waiting).

With a catalog (serve), the router loads and unloads models at run time (routing/lifecycle.py):
it tells the supervisor to start a worker in a new slot (`start_worker`), or to stop one for good
(`stop_worker`: terminated, killed after STOP_GRACE seconds, never restarted), and hears back when
that process has exited.
"""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import zmq

from fusion.deploy import model_entries
from fusion.gpu_sharing import MpsDaemon, Sharing, decide
from fusion.launcher import WorkerProcess, start_worker
from fusion.model_info import MultiModelFusion
from fusion.owners import WeightOwners
from fusion.params import RUNCONFIG_DEFAULTS
from fusion.plan import DeploymentPlan
from routing.router import Catalog, Router, RouterConfig
from wire import protocol as P

STOP_GRACE = 10.0  # seconds an unloaded worker has to exit on SIGTERM before it is killed


@dataclass(slots=True)
class SupervisorConfig:
    max_restarts: int = RUNCONFIG_DEFAULTS["max_restarts"]  # per worker; then it stays down and the log says so
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    poll_interval: float = 0.2

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.backoff_initial <= 0 or self.backoff_max < self.backoff_initial:
            raise ValueError("max_restarts must be >= 0 and 0 < backoff_initial <= backoff_max")


def exit_cause(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class LocalDeployment:
    """Context manager: the router runs in a thread of this process, one subprocess per planned worker."""

    def __init__(self, fusion: MultiModelFusion, plan: DeploymentPlan, frontend: str, backend: str,
                 supervisor: SupervisorConfig | None = None, log=None, curve_keys: str | None = None,
                 insecure: bool = False, restart_wait: float = P.RESTART_WAIT, catalog: Catalog | None = None,
                 router: dict | None = None, sharing: Sharing | None = None):
        """`sharing`: how workers on one GPU share it (fusion.gpu_sharing; None: timeslice)."""
        self.fusion, self.plan, self.catalog = fusion, plan, catalog
        self.sharing = sharing or Sharing("timeslice", "as set")
        self.config = RouterConfig(frontend=frontend, backend=backend, curve_keys=curve_keys, insecure=insecure,
                                   restart_wait=restart_wait, gpu_sharing=self.sharing.mode, **(router or {}))
        self.supervisor = supervisor or SupervisorConfig()
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.router: Router | None = None
        self.thread: threading.Thread | None = None
        self.procs: list[WorkerProcess | None] = []  # by slot; None: a run-time slot not started (yet)
        self.restarts: list[int] = []
        self.gave_up: set[int] = set()
        self.stopped: dict[int, float] = {}  # slot -> when to kill it (told to stop for good)
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self.owners = WeightOwners(fusion, plan, self.log, self.supervisor.max_restarts)
        self.mps = MpsDaemon(log=self.log) if self.sharing.mode == "mps" else None

    def __enter__(self) -> LocalDeployment:
        if self.mps is not None:  # first: the owners' and the workers' CUDA contexts go through it
            self.mps.start()
            self.owners.extra_env = self.mps.env()
        try:
            self.owners.start()
            owners = self.owners.addresses()
            self._start_router([w.spec.placed(weights_owner=owners[k]) if k in owners else w.spec
                                for k, w in enumerate(self.plan.workers)])
        except BaseException:
            self.owners.stop()
            if self.mps is not None:
                self.mps.stop()
            raise
        self.procs = [self._spawn(i) for i in range(len(self.plan.workers))]
        self.restarts = [0] * len(self.procs)
        self._watcher = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._watcher.start()
        return self

    def _start_router(self, specs: list) -> None:
        """The router, in a thread of this process; raises what stopped it from starting."""
        box: queue.Queue = queue.Queue()

        def serve():
            try:
                r = Router(model_entries(self.fusion), self.config, worker_specs=specs, log=self.log,
                           catalog=self.catalog)
            except Exception as exc:  # e.g. the address is taken: report it to the caller
                box.put(exc)
                return
            box.put(r)
            r.run()

        self.thread = threading.Thread(target=serve, name="router", daemon=True)
        self.thread.start()
        got = box.get(timeout=30)
        if isinstance(got, Exception):
            raise got
        self.router = got

    @classmethod
    def from_runconfig(cls, fusion: MultiModelFusion, plan: DeploymentPlan, run: dict,
                       catalog: Catalog | None = None) -> LocalDeployment:
        """`catalog`: the models it may load at run time (fusion.catalog; serve), with the runconfig's
        load settings; None: its copies stay as started."""
        router = {k: run[k] for k in ("autoload", "load_timeout", "unload_timeout", "idle_unload_s", "tenants", "min_resident_s",
                                  "max_loads_per_minute")}
        return cls(fusion, plan, run["frontend"], run["backend"], SupervisorConfig(max_restarts=run["max_restarts"]),
                   curve_keys=run["curve_keys"], insecure=run["insecure"], restart_wait=run["restart_wait"],
                   catalog=catalog, router=router, sharing=decide(run["gpu_sharing"], plan))

    def client_kw(self) -> dict:
        """What a client of this deployment needs besides the address."""
        return {"curve_keys": self.config.curve_keys} if self.config.curve_keys else {}

    def _spawn(self, slot: int) -> WorkerProcess:
        argv = ["--backend", self.router.backend_addr, "--slot", str(slot)]
        if self.config.curve_keys:
            argv += ["--curve-keys", self.config.curve_keys]
        # per-tensor GGUF conversion bars from every worker would bury the run's own progress
        mps = self.mps.env() if self.mps is not None else {}
        return start_worker(argv, {**self.owners.env, **mps, "TQDM_DISABLE": "1"})

    def _supervise(self) -> None:
        tell = self.router.ctx.socket(zmq.PUSH)  # the router's control socket: "this worker exited"
        tell.setsockopt(zmq.LINGER, 0)
        tell.connect(self.router.control_addr)
        orders = self.router.ctx.socket(zmq.PULL)  # the router's: start_worker, stop_worker
        orders.setsockopt(zmq.LINGER, 0)
        orders.connect(self.router.supervise_addr)
        try:
            self._watch(tell, orders)
        finally:
            tell.close(linger=0)
            orders.close(linger=0)

    def _orders(self, orders: zmq.Socket, now: float) -> None:
        """The router's orders waiting on the socket, each carried out."""
        while True:
            try:
                self._order(P.unpack(orders.recv(zmq.NOBLOCK), P.SUPERVISOR_TYPES), now)
            except zmq.Again:
                return

    def _order(self, msg: dict, now: float) -> None:
        """start_worker: spawn the slot's worker; stop_worker: terminate it, for good."""
        slot = msg.get("slot")
        if msg["type"] == P.START_WORKER and isinstance(slot, int) and slot >= len(self.procs):
            # a run-time slot; one that waited for evictions may come after a later one
            grow = slot + 1 - len(self.procs)
            self.procs += [None] * grow
            self.restarts += [0] * grow
            self.procs[slot] = self._spawn(slot)
            self.log(f"supervisor: worker slot {slot} started as process {self.procs[slot].pid}")
        elif (msg["type"] == P.STOP_WORKER and isinstance(slot, int) and 0 <= slot < len(self.procs)
              and self.procs[slot] is not None):
            self.stopped[slot] = now + STOP_GRACE
            self.procs[slot].terminate()

    def _reap_stopped(self, tell: zmq.Socket, due: dict[int, float], host: str, now: float) -> None:
        """Stopped workers: once exited, the router hears it (for good); past the grace, killed."""
        for i, kill_at in list(self.stopped.items()):
            proc = self.procs[i]
            if proc.poll() is None:
                if now >= kill_at:
                    proc.kill()
                continue
            del self.stopped[i]
            due.pop(i, None)
            self.gave_up.add(i)
            tell.send(P.pack({"type": P.WORKER_EXITED, "pid": proc.pid, "host": host, "slot": i, "restart": False}))

    def _watch(self, tell: zmq.Socket, orders: zmq.Socket) -> None:
        cfg = self.supervisor
        due: dict[int, float] = {}  # worker slot -> when to start it again
        host = socket.gethostname()
        while not self._closing.is_set():
            orders.poll(cfg.poll_interval * 1000)  # wakes at once for the router's orders
            if self._closing.is_set():
                return
            self.owners.check()
            now = time.monotonic()
            self._orders(orders, now)
            self._reap_stopped(tell, due, host, now)
            for i, proc in enumerate(self.procs):
                if proc is None or i in self.gave_up or i in self.stopped or proc.poll() is None:
                    continue
                if i not in due:
                    n = self.restarts[i]
                    restart = n < cfg.max_restarts and not self._closing.is_set()
                    tell.send(P.pack({"type": P.WORKER_EXITED, "pid": proc.pid, "host": host, "slot": i,
                                      "restart": restart}))
                    if not restart:
                        self.gave_up.add(i)
                        self.log(f"supervisor: worker process {proc.pid} (slot {i}) {exit_cause(proc.returncode)}; "
                                 f"not restarting it: it was restarted {n} times already (max_restarts)")
                        continue
                    delay = min(cfg.backoff_initial * 2 ** n, cfg.backoff_max)
                    due[i] = now + delay
                    self.log(f"supervisor: worker process {proc.pid} (slot {i}) {exit_cause(proc.returncode)}; "
                             f"restart {n + 1}/{cfg.max_restarts} in {delay:.1f}s")
                elif now >= due[i] and not self._closing.is_set():
                    del due[i]
                    self.restarts[i] += 1
                    self.procs[i] = self._spawn(i)
                    self.log(f"supervisor: worker slot {i} started again as process {self.procs[i].pid}")

    @property
    def frontend(self) -> str:
        return self.router.frontend_addr

    def wait_loaded(self, timeout: float = 600) -> None:
        from routing.client import Client

        deadline = time.monotonic() + timeout
        n = len(self.plan.workers)
        with Client(self.frontend, timeout=10, **self.client_kw()) as c:  # the router owns its state
            while time.monotonic() < deadline:
                workers = c.status()["workers"]
                if sum(w["alive"] and w["loaded"] for w in workers) >= n:
                    return
                failed = [w for w in workers if w["alive"] and w.get("load_error")]
                if failed:
                    w = failed[0]
                    raise RuntimeError(f"worker {w['id']} could not load model {w['model_id']}: {w['load_error']}")
                if self.gave_up:
                    raise RuntimeError(f"{len(self.gave_up)} worker process(es) kept exiting while loading; "
                                       "see their output above")
                time.sleep(0.2)
        raise TimeoutError(f"workers not loaded within {timeout}s")

    def __exit__(self, *exc) -> None:
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        if self.router is not None:
            self.router.stop()
        if self.thread is not None:
            self.thread.join(timeout=10)
        self._stop_workers()
        self.owners.stop()  # no worker uses the weights any more
        if self.mps is not None:  # last: no CUDA process of the deployment is left
            self.mps.stop()

    def _stop_workers(self) -> None:
        """The router told every worker to shut down; wait for them, then kill what remains."""
        deadline = time.monotonic() + 10
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
