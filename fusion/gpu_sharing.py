"""How the workers that share a GPU share it: `runconfig.gpu_sharing`.

Each worker is a process with its own CUDA context, and a GPU runs the kernels of one context at a
time, switching between them (`timeslice`): copies on one GPU take turns. NVIDIA's Multi-Process
Service runs the kernels of several processes at once through one server (`mps`), which is what
Triton Inference Server and Ray document for models sharing a GPU.

- `timeslice`: nothing is started.
- `mps`: the deployment starts its own MPS control daemon (`nvidia-cuda-mps-control -d`) with a
  pipe and a log directory of its own under the temporary directory, gives the workers and the
  weight owners those directories (CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY: their CUDA
  contexts then go through it), and at exit tells it to quit and removes both directories. Refused
  by name where there is no CUDA worker or no control program.
- `auto`: `mps` where the control program is on PATH and some CUDA device has two or more
  workers, else `timeslice`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fusion.plan import DeploymentPlan
from workers.devices import device_kind

MPS_CONTROL = "nvidia-cuda-mps-control"
GPU_SHARING = ("auto", "mps", "timeslice")
QUIT_TIMEOUT_S = 10.0


@dataclass(slots=True, frozen=True)
class Sharing:
    mode: str  # "mps" or "timeslice"
    why: str

    def describe(self) -> str:
        return f"gpu sharing: {self.mode} ({self.why})"


def shared_gpus(plan: DeploymentPlan) -> list[str]:
    """The CUDA devices two or more of the plan's workers run on."""
    count: dict[str, int] = {}
    for w in plan.workers:
        if not device_kind(w.device).host:
            count[w.device] = count.get(w.device, 0) + 1
    return sorted(d for d, n in count.items() if n > 1)


def decide(setting: str, plan: DeploymentPlan, control: str | None = None) -> Sharing:
    """The sharing `setting` (runconfig.gpu_sharing) comes to for `plan`; `control`: the MPS control
    program's path (None: looked up on PATH). Raises ValueError for an `mps` that cannot be."""
    if setting not in GPU_SHARING:
        raise ValueError(f"runconfig.gpu_sharing must be one of {', '.join(GPU_SHARING)}, got {setting!r}")
    control = control or shutil.which(MPS_CONTROL)
    gpus = [w.device for w in plan.workers if not device_kind(w.device).host]
    shared = shared_gpus(plan)
    if setting == "timeslice":
        return Sharing("timeslice", "as set")
    if setting == "mps":
        if not gpus:
            raise ValueError("runconfig.gpu_sharing: mps shares a CUDA GPU between processes, and no worker of this "
                             "deployment runs on one; use timeslice or auto")
        if control is None:
            raise ValueError(f"runconfig.gpu_sharing: mps needs NVIDIA's {MPS_CONTROL} on PATH, which is not there "
                             "(it comes with the CUDA toolkit's Multi-Process Service); use timeslice or auto")
        return Sharing("mps", "as set")
    if not shared:
        return Sharing("timeslice", "no GPU has two or more workers")
    if control is None:
        return Sharing("timeslice", f"{', '.join(shared)} shared, but {MPS_CONTROL} is not on PATH")
    return Sharing("mps", f"{', '.join(shared)} shared by several workers")


class MpsDaemon:
    """The deployment's own MPS control daemon: start(), env() for the CUDA processes, stop()."""

    def __init__(self, control: str | None = None, log=None):
        self.control = control or shutil.which(MPS_CONTROL) or MPS_CONTROL
        self.log = log or (lambda line: None)
        self.root: Path | None = None

    def env(self) -> dict[str, str]:
        if self.root is None:
            return {}
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(self.root / "log")}

    def start(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="mmfusion-mps-"))
        (self.root / "pipe").mkdir()
        (self.root / "log").mkdir()
        try:
            out = subprocess.run([self.control, "-d"], env={**os.environ, **self.env()}, capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._remove()
            raise RuntimeError(f"gpu_sharing mps: {self.control} -d could not start: {exc}") from None
        if out.returncode != 0:
            self._remove()
            raise RuntimeError(f"gpu_sharing mps: {self.control} -d failed (exit code {out.returncode}): "
                               f"{(out.stderr or out.stdout).strip()[-500:]}")
        self.log(f"gpu sharing: MPS control daemon started (pipe {self.root / 'pipe'})")

    def stop(self) -> None:
        """Tell the daemon to quit (it stops its server once no client is left), then remove its
        directories; bounded: a daemon that does not answer is left to its pipe's removal."""
        if self.root is None:
            return
        try:
            subprocess.run([self.control], input="quit\n", env={**os.environ, **self.env()}, capture_output=True,
                           text=True, timeout=QUIT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.log(f"gpu sharing: the MPS control daemon did not take quit ({exc})")
        self._remove()

    def _remove(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
