"""The weight owners of a local deployment: one process per (CUDA device, source, dtype,
quantization) whose copies share their weights (workers.weights.owner). Started before the workers, given back their
socket address in each worker's assignment, started again if one dies, stopped last.

CPU copies need no owner: they map one file (workers.weights.shared)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from fusion.model_info import MultiModelFusion
from fusion.plan import DeploymentPlan
from routing import entrypoints
from workers.devices import device_kind
from workers.weights.owner_ipc import KEY_ENV, remove_ipc_files


def owner_groups(fusion: MultiModelFusion, plan: DeploymentPlan) -> dict[tuple, list[int]]:
    """(device, source, dtype, quantization) -> the planned workers that attach to one owner there.
    The quantization is the planned precision's key: copies that run weight-only blocks share an
    owner holding those blocks in place of the 16-bit linears, which copies of other settings would
    need (workers.weights.owner.blocks_for_copies)."""
    groups: dict[tuple, list[int]] = {}
    for w in plan.workers:
        if w.shares_weights and device_kind(w.device).owner_shares_weights:
            model = w.spec.model
            # "none" where it runs no blocks
            groups.setdefault((w.device, model.source, model.dtype, w.precision.quantized_key), []).append(w.worker_id)
    return groups


class WeightOwners:
    def __init__(self, fusion: MultiModelFusion, plan: DeploymentPlan, log, max_restarts: int = 5,
                 backoff: float = 1.0):
        self.groups = owner_groups(fusion, plan)
        self.log = log
        self.max_restarts, self.backoff = max_restarts, backoff
        self.restarts: dict[tuple, int] = {}
        self.due: dict[tuple, float] = {}  # group -> when to start its owner again
        self.gave_up: set[tuple] = set()
        self.key = secrets.token_hex(16)
        self.dir: Path | None = None
        self.procs: dict[tuple, subprocess.Popen] = {}
        self.address: dict[tuple, str] = {}
        self.pids: list[int] = []
        self.extra_env: dict[str, str] = {}  # the deployment's besides the key (its MPS directories)

    @property
    def env(self) -> dict:
        """What every worker process (and owner) needs: the deployment's owner key."""
        return {KEY_ENV: self.key} if self.groups else {}

    def addresses(self) -> dict[int, str]:
        """Worker ID -> its owner's address."""
        return {k: self.address[g] for g, ks in self.groups.items() for k in ks}

    def start(self) -> None:
        if not self.groups:
            return
        self.dir = Path(tempfile.mkdtemp(prefix="mmfusion-owners-"))  # 0700: the sockets are ours alone
        for i, g in enumerate(self.groups):
            self.address[g] = str(self.dir / f"owner-{i}.sock")
            self._spawn(g)

    def _spawn(self, g: tuple) -> None:
        device, source, dtype, quantization = g
        cmd = entrypoints.command(entrypoints.WEIGHT_OWNER, "--source", source, "--dtype", str(dtype), "--device", device,
                                  "--quantization", quantization, "--address", self.address[g],
                                  "--parent-pid", str(os.getpid()))
        Path(self.address[g]).unlink(missing_ok=True)
        self.procs[g] = subprocess.Popen(cmd, env={**os.environ, **self.env, **self.extra_env, "TQDM_DISABLE": "1"})
        self.pids.append(self.procs[g].pid)

    def check(self) -> None:
        """An owner that died is started again after a capped backoff, up to max_restarts times (an
        owner that cannot load its model would otherwise be restarted forever); its copies fail,
        are restarted by the supervisor, and attach to the new one, or fail to load saying why."""
        now = time.monotonic()
        for g, p in list(self.procs.items()):
            if p.poll() is None or g in self.gave_up:
                continue
            if g not in self.due:
                remove_ipc_files(p.pid)
                n = self.restarts.get(g, 0)
                if n >= self.max_restarts:
                    self.gave_up.add(g)
                    self.log(f"weight owner for {g[1]} on {g[0]} (process {p.pid}) exited with code {p.returncode}; "
                             f"not starting it again: it was restarted {n} times already")
                    continue
                self.due[g] = now + min(self.backoff * 2 ** n, 30.0)
                self.log(f"weight owner for {g[1]} on {g[0]} (process {p.pid}) exited with code {p.returncode}; "
                         f"restart {n + 1}/{self.max_restarts}")
            elif now >= self.due[g]:
                del self.due[g]
                self.restarts[g] = self.restarts.get(g, 0) + 1
                self._spawn(g)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for pid in self.pids:  # every owner this deployment ran, restarted ones too
            remove_ipc_files(pid)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
