"""Security: loopback by default, CurveZMQ off loopback, key generation, unknown clients refused."""

from __future__ import annotations

import asyncio
import os
import queue
import subprocess
import threading
import time
from pathlib import Path

import pytest

from routing.client import AsyncClient, Client, RouterError
from routing.entrypoints import CLI, KEYS, WORKER, command
from routing.router import ModelEntry, Router, RouterConfig
from wire import protocol as P
from wire.security import SecurityError, generate, is_loopback
from workers.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("addr,local", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.3.2.1:*", True), ("tcp://localhost:5555", True),
    ("tcp://[::1]:5555", True), ("ipc:///tmp/x", True), ("inproc://x", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://10.1.2.3:5555", False),
    ("tcp://eth0:5555", False), ("tcp://example.com:5555", False),
])
def test_is_loopback(addr, local):
    assert is_loopback(addr) is local


def test_defaults_bind_loopback_and_off_loopback_needs_keys_or_insecure():
    cfg = RouterConfig()
    assert is_loopback(cfg.frontend) and is_loopback(cfg.backend)
    with pytest.raises(SecurityError, match=r"binding tcp://0.0.0.0:\* .*--curve_keys DIR.*--insecure"):
        Router([ModelEntry(0, "m", ModelSpec("m", "tiny:llama"))], RouterConfig(frontend="tcp://0.0.0.0:*", backend="tcp://127.0.0.1:*"))
    r = Router([ModelEntry(0, "m", ModelSpec("m", "tiny:llama"))], RouterConfig(frontend="tcp://0.0.0.0:*", backend="tcp://127.0.0.1:*",
                                                      insecure=True))
    r.shutdown()


def test_run_mm_refuses_off_loopback_before_starting_anything(tmp_path):
    out = subprocess.run([*command(CLI), "--mode", "serve", "--params", "configs/tiny.yaml",
                          "--frontend", "tcp://0.0.0.0:*"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--insecure" in out.stderr and "Traceback" not in out.stderr


def test_keygen_cli(tmp_path):
    out = subprocess.run([*command(KEYS), str(tmp_path / "k"), "--client", "alice"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    k = tmp_path / "k"
    assert (k / "server.key").exists() and (k / "server.key_secret").exists()
    assert (k / "clients" / "alice.key_secret").exists() and (k / "authorized_clients" / "alice.key").exists()
    assert oct((k / "server.key_secret").stat().st_mode & 0o777) == "0o600"


def test_curve_refuses_unknown_clients_and_serves_allowed_ones(tmp_path):
    keys, other = tmp_path / "keys", tmp_path / "other"
    generate(keys, ["client", "worker"])
    generate(other, ["mallory"])  # a well-formed keypair the router has never been told about
    (keys / "clients" / "mallory.key_secret").write_bytes((other / "clients" / "mallory.key_secret").read_bytes())
    box: queue.Queue = queue.Queue()

    def serve():
        r = Router([ModelEntry(0, "echo", ModelSpec("echo", "tiny:llama"))], RouterConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*",
                                                             curve_keys=str(keys)))
        box.put(r)
        r.run()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    router = box.get(timeout=10)
    worker = subprocess.Popen([*command(WORKER), "--backend", router.backend_addr, "--echo",
                               "--parent-pid", str(os.getpid()), "--curve-keys", str(keys)], cwd=ROOT)
    try:
        with Client(router.frontend_addr, timeout=30, curve_keys=str(keys)) as ok:
            assert ok.complete(model="echo", prompt="hi")["choices"][0]["text"] == "hi"  # worker and client allowed
        for kw in ({"curve_keys": str(keys), "curve_name": "mallory"}, {}):  # unknown key; no CURVE at all
            for idle in (0.0, 0.5):  # asked at once, or after the refusal came in (zmq does not retry it)
                with Client(router.frontend_addr, timeout=10, **kw) as bad:
                    time.sleep(idle)
                    t0 = time.monotonic()
                    with pytest.raises(RouterError) as info:
                        bad.status()
                    assert info.value.code == P.REFUSED and time.monotonic() - t0 < 5  # at once, not at a timeout

                async def ask(kw=kw, idle=idle):
                    async with AsyncClient(router.frontend_addr, timeout=10, **kw) as bad:
                        await asyncio.sleep(idle)
                        with pytest.raises(RouterError) as info:
                            await bad.status()
                        return info.value.code
                assert asyncio.run(ask()) == P.REFUSED
        with Client(router.frontend_addr, timeout=30, curve_keys=str(keys)) as ok:
            assert ok.status()["workers"][0]["alive"]  # still serving
    finally:
        router.stop()
        t.join(10)
        worker.wait(10)
