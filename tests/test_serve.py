"""`run_mm.py --mode serve` as a user runs it: one deployment through its whole life.

Started on ports the OS picks (read back from what serve prints), with the HTTP gateway as a
process of its own; a crashed worker and a killed gateway are started again; SIGINT stops
everything: exit 0, "stopped", every worker and the gateway gone, no C++ abort, no traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
from support.cluster import ANY_PORT, ROOT, read_frontend, wait_for
from support.cluster import TINY_CONFIG as CONFIG

from routing.client import Client
from routing.entrypoints import CLI, GATEWAY, command


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def _thread_cores(pid: int) -> set[str]:
    """The cores each thread of a process may run on (Cpus_allowed_list), as a set of lists."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found.add(line.split(":", 1)[1].strip())
    return found


def test_serve_restarts_what_crashes_and_stops_cleanly():
    proc = subprocess.Popen([*command(CLI), "--mode", "serve", "--params", str(CONFIG), "--variants", "llama,1",
                             "gpt2,1", "--devices", "cpu", "--frontend", ANY_PORT, "--backend", ANY_PORT,
                             "--http", "127.0.0.1:0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # a process group of its own, as a terminal gives it
    try:
        front = read_frontend(proc)
        url = next(ln for ln in proc.stdout if ln.startswith("serving: OpenAI-compatible HTTP at "))
        url = url.split()[-1].removesuffix("/v1")

        def healthy() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        def completes_over_http() -> bool:
            r = httpx.post(url + "/v1/completions", timeout=30,
                           json={"model": "llama", "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            return r.status_code == 200 and json.loads(r.text)["usage"]["completion_tokens"] == 3

        def gateways() -> list[psutil.Process]:
            return [c for c in psutil.Process(proc.pid).children() if GATEWAY in " ".join(c.cmdline())]

        with Client(front, timeout=10) as c:
            wait_for(lambda: len(c.status()["workers"]) == 2 and all(w["loaded"] for w in c.status()["workers"]),
                     timeout=120)
            wait_for(healthy, timeout=60)
            assert completes_over_http()
            if len(os.sched_getaffinity(0)) >= 2:
                # each worker's engine thread (and its OpenMP threads) is bound to cores of its own
                bound = [_thread_cores(w["pid"]) - _thread_cores(proc.pid) for w in c.status()["workers"]]
                assert all(len(b) == 1 for b in bound) and bound[0] != bound[1], bound

            # a crashed worker comes back on its slot: same planned model and device, a new worker ID
            gpt2 = next(w for w in c.status()["workers"] if w["model_id"] == 1)
            os.kill(gpt2["pid"], signal.SIGKILL)
            wait_for(lambda: any(w["model_id"] == 1 and w["alive"] and w["loaded"] and w["pid"] != gpt2["pid"]
                                 for w in c.status()["workers"]), timeout=120)
            back = next(w for w in c.status()["workers"] if w["alive"] and w["pid"] != gpt2["pid"]
                        and w["model_id"] == 1)
            assert (back["slot"], back["device"]) == (gpt2["slot"], gpt2["device"]) == (1, "cpu")
            assert back["id"] not in (0, 1)
            assert c.models()[1]["workers"] and c.complete(model="gpt2", prompt=[1, 2], max_tokens=2)["choices"]

            # the gateway is a process of its own (no GIL shared with the router), restarted when it dies,
            # on the port it had
            (first,) = gateways()
            first.kill()
            first.wait(10)
            wait_for(lambda: len(gateways()) == 1 and healthy(), timeout=60)
            assert gateways()[0].pid != first.pid and completes_over_http()
            second = gateways()[0]
            pids = [w["pid"] for w in c.status()["workers"] if w["alive"]]
            assert len(pids) == 2

        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the group gets it
        assert proc.wait(timeout=60) == 0
        out, err = proc.stdout.read(), proc.stderr.read()
        assert "stopped" in out
        assert f"worker process {gpt2['pid']}" in err and "killed by SIGKILL" in err and "started again" in err
        assert "terminate called" not in err and "Traceback" not in err, err[-3000:]
        time.sleep(0.5)
        assert all(_gone(pid) for pid in [*pids, second.pid])
    finally:
        if proc.poll() is None:
            proc.kill()
