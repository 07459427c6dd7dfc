"""Routers, workers and deployments started for real (threads and processes on loopback), and
the in-process engine answers they are checked against."""

from __future__ import annotations

import queue
import re
import socket
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from fusion import launcher
from fusion.deploy import build_fusion
from fusion.launcher import WorkerProcess
from fusion.local import LocalDeployment
from fusion.params import load_params
from fusion.plan import make_plan
from routing.client import Client
from routing.router import ModelEntry, Router, RouterConfig
from support.models import tiny
from wire import protocol as P
from workers.engine import Engine, EngineConfig
from workers.request_params import sampling_params
from workers.spec import ModelSpec, WorkerSpec
from workers.thread_messages import Assign
from workers.worker import EngineThread

ROOT = Path(__file__).resolve().parents[2]
TINY_CONFIG = ROOT / "configs" / "tiny.yaml"
ANY_PORT = "tcp://127.0.0.1:*"  # the OS picks a free port when the socket binds
TINY = ModelSpec("llama", "tiny:llama", dtype="float32", max_batch_size=8, max_batch_tokens=64)


def loaded_deployment(params: dict, variants: list[str], threads_per_worker: int = 1,
                      timeout: float = 120) -> LocalDeployment:
    """A deployment of `params` on loopback, started and with every worker loaded; the caller stops
    it (`__exit__`). One that does not load is stopped before the error reaches the caller."""
    fusion = build_fusion(params, variants)
    d = LocalDeployment(fusion, make_plan(fusion, None, "cpu", threads_per_worker=threads_per_worker), ANY_PORT,
                        ANY_PORT)
    d.__enter__()
    try:
        d.wait_loaded(timeout)
    except BaseException:
        d.__exit__(None, None, None)
        raise
    return d


def wait_for(pred, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise TimeoutError("condition not reached")


def wait_loaded(c: Client, timeout=60.0) -> None:
    wait_for(lambda: c.status()["workers"] and c.status()["workers"][0]["loaded"], timeout)


def start_router(backend=ANY_PORT, frontend=ANY_PORT, **cfg) -> tuple[Router, threading.Thread]:
    """A router for tiny Llama on a thread of this process."""
    box: queue.Queue = queue.Queue()

    def serve():
        r = Router([ModelEntry(0, "llama", TINY)], RouterConfig(frontend=frontend, backend=backend,
                                                                heartbeat_interval=0.2, **cfg))
        box.put(r)
        r.run()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return box.get(timeout=10), t


def start_worker(backend: str) -> WorkerProcess:
    """A worker process for `backend`, forked as deployments start theirs (fusion.launcher)."""
    return launcher.start_worker(["--backend", backend, "--threads", "1", "--heartbeat", "0.2"])



@contextmanager
def one_worker(**cfg):
    """A router thread and one loaded tiny-Llama worker process; yields (router, worker, client)."""
    router, thread = start_router(**cfg)
    worker = start_worker(router.backend_addr)
    try:
        with Client(router.frontend_addr, timeout=60) as c:
            wait_loaded(c)
            yield router, worker, c
    finally:
        router.stop()
        thread.join(10)
        if worker.poll() is None:
            worker.wait(10)


class Deployment(LocalDeployment):
    """What run_mm serve starts (router thread + worker processes), on ephemeral ports, tiny models."""

    def __init__(self, variants: list[str], num_workers: int, router: dict | None = None):
        fusion = build_fusion(load_params(TINY_CONFIG), variants)
        super().__init__(fusion, make_plan(fusion, num_workers, "cpu", threads_per_worker=1), ANY_PORT, ANY_PORT,
                         router=router)
        self.__enter__()
        self.wait_loaded(120)

    def close(self) -> None:
        self.__exit__(None, None, None)


def engine_reference(arch: str, prompt, **params) -> list[int]:
    """The tokens the engine in-process gives for one request to tiny `arch` (float32)."""
    eng = Engine(tiny(arch, "float32"), EngineConfig(max_batch_size=8, max_batch_tokens=64))
    return eng.generate([prompt], sampling_params(params)[0])[0].outputs[0].token_ids


def run_stream(address: str, prompt, started: threading.Event | None = None, **params) -> dict:
    """Stream one request to tiny Llama; what the client saw: chunk tokens and texts, and the final response."""
    with Client(address, timeout=120) as c:
        toks, text = [], ""
        for msg in c._run("llama", prompt, True, {**params, "return_token_ids": True}):
            if msg["type"] == P.CHUNK:
                for out in msg["outputs"]:
                    toks += out["token_ids"]
                    text += out["text"]
                if started is not None:
                    started.set()
            else:
                return {"tokens": toks, "text": text, "response": msg["response"]}


SERVING = re.compile(r"serving: clients connect to (\S+)")


def read_frontend(proc: subprocess.Popen, lines: list[str] | None = None, timeout: float = 300) -> str:
    """The client address a `run_mm.py --mode serve` subprocess (stdout piped, text) prints."""
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if lines is not None:
            lines.append(line)
        m = SERVING.match(line)
        if m:
            return m.group(1)
        if time.monotonic() > deadline:
            break
    raise RuntimeError("serve printed no client address" + ("".join(lines) if lines else ""))


def free_port() -> int:
    """A port that was free a moment ago, from the OS (port 0). Only for what must be told a port
    before it binds (a subprocess's HTTP address, a Ray address where nothing listens); sockets
    this process binds itself take ANY_PORT or port 0 and read back what they got."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def worker_threads(model: ModelSpec, addr: str = "inproc://engine-test"):
    """A worker's engine and output threads without its router socket, `model` loaded: yields the
    engine thread (put workers.thread_messages.Submit(key, msg) in its inbox) and the PAIR socket
    its messages arrive on."""
    import msgpack
    import zmq

    ctx = zmq.Context()
    pair = ctx.socket(zmq.PAIR)
    pair.bind(addr)
    th = EngineThread(1)
    output = th.connect(ctx, addr)
    output.start()
    th.start()
    try:
        th.inbox.put(Assign(0, 0, WorkerSpec(model, 0, threads=1).to_wire()))
        assert msgpack.unpackb(pair.recv())["type"] == P.LOADED
        yield th, pair
    finally:
        for t in (th, output):
            t.stop.set()
            t.join(10)
        pair.close(0)
        ctx.term()
