"""The gateway as a process of its own, supervised by `run_mm.py --mode serve --http`.

The router runs on a thread of the serving process; a gateway on another thread there would share
its GIL, and every HTTP request would wait on routing work (and the other way round). A process of
its own costs one more loopback connection and runs both at full speed. API keys (and the tenants'
keys) reach it through the environment, never its command line (which `ps` shows to every user).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

from routing import entrypoints
from routing.http.server import KEYS_ENV, READY_LINE, TENANT_KEYS_ENV, GatewayError


class GatewayProcess:
    def __init__(self, router: str, listen: str, api_keys: tuple[str, ...] = (), curve_keys: str | None = None,
                 insecure: bool = False, log=print, tenant_keys: dict[str, str] | None = None):
        self.router, self.listen, self.api_keys = router, listen, api_keys
        self.tenant_keys = dict(tenant_keys or {})  # API key -> its tenant (accepted besides api_keys)
        self.curve_keys, self.insecure, self.log = curve_keys, insecure, log
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._next_try = 0.0

    def _command(self) -> list[str]:
        cmd = entrypoints.command(entrypoints.GATEWAY, "--router", self.router, "--http", self.listen,
                                  "--parent-pid", str(os.getpid()), "--log-level", "warning")
        if self.curve_keys:
            cmd += ["--curve-keys", self.curve_keys]
        if self.insecure:
            cmd.append("--insecure")
        return cmd

    def _relay(self, proc: subprocess.Popen) -> None:
        """Its stdout goes on to ours; the ready line tells start() that it listens."""
        for line in proc.stdout:
            if line.startswith(READY_LINE):
                # port 0 asks the OS for one: keep the one it gave, a restart listens there again
                self.listen = line.split()[-1].removeprefix("http://")
                self._ready.set()
            print(line, end="", flush=True)

    def start(self, timeout: float = 60.0) -> GatewayProcess:
        self._ready.clear()
        env = {**os.environ, KEYS_ENV: ",".join(self.api_keys), TENANT_KEYS_ENV: json.dumps(self.tenant_keys)}
        self.proc = subprocess.Popen(self._command(), env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
        threading.Thread(target=self._relay, args=(self.proc,), name="gateway-out", daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                raise GatewayError(f"the HTTP gateway could not start on {self.listen} (exit code "
                                   f"{self.proc.returncode}; see above)")
            if time.monotonic() > deadline:
                self.stop()
                raise GatewayError(f"the HTTP gateway did not start on {self.listen} within {timeout:g}s")
        return self

    @property
    def url(self) -> str:
        return f"http://{self.listen}"

    def check(self, retry_every: float = 5.0) -> None:
        """Start it again if it died (the deployment behind it is unaffected); a start that fails
        (say its port was taken meanwhile) is logged and tried again `retry_every` seconds later."""
        if self.proc is None or self.proc.poll() is None or time.monotonic() < self._next_try:
            return
        self.log(f"gateway: process {self.proc.pid} exited with code {self.proc.returncode}; starting it again")
        try:
            self.start()
        except GatewayError as exc:
            self._next_try = time.monotonic() + retry_every
            self.log(f"gateway: {exc}; trying again in {retry_every:g}s")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
