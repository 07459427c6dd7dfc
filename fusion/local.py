"""A router plus its worker processes on this machine: what serve and predict start."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time

from fusion.deploy import model_entries, worker_overrides
from fusion.model_info import MultiModelFusion
from fusion.plan import DeploymentPlan
from routing.router import Router, RouterConfig


class LocalDeployment:
    """Context manager: the router runs in a thread of this process, one subprocess per planned worker."""

    def __init__(self, fusion: MultiModelFusion, plan: DeploymentPlan, frontend: str, backend: str):
        self.fusion, self.plan = fusion, plan
        self.config = RouterConfig(frontend=frontend, backend=backend)
        self.router: Router | None = None
        self.thread: threading.Thread | None = None
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> LocalDeployment:
        box: queue.Queue = queue.Queue()

        def serve():
            try:
                r = Router(model_entries(self.fusion), self.config, worker_overrides=worker_overrides(self.plan))
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
        for _ in self.plan.workers:
            self.procs.append(subprocess.Popen([sys.executable, "-m", "workers.worker", "--backend",
                                                self.router.backend_addr, "--parent-pid", str(os.getpid())]))
        return self

    @property
    def frontend(self) -> str:
        return self.router.frontend_addr

    def wait_loaded(self, timeout: float = 600) -> None:
        from routing.client import Client

        deadline = time.monotonic() + timeout
        n = len(self.plan.workers)
        while time.monotonic() < deadline:
            with Client(self.frontend, timeout=10) as c:  # ask over the socket: the router owns its state
                st = c.status()
            if sum(w["alive"] and w["loaded"] for w in st["workers"]) >= n:
                return
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{len(dead)} worker process(es) exited while loading; see their output above")
            time.sleep(0.2)
        raise TimeoutError(f"workers not loaded within {timeout}s")

    def __exit__(self, *exc) -> None:
        if self.router is not None:
            self.router.stop()
        if self.thread is not None:
            self.thread.join(timeout=10)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
