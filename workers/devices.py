"""What each kind of device means to a deployment, in one table: how its workers share it, what a
worker costs there beyond its model, how Ray places one, how much memory it has free.

The plan, the catalog of models loaded at run time, the Ray deployment and the weight owners ask
`device_kind(device)` instead of comparing device strings; the engine's own choices (precision,
runner, attention) are workers.platform's. This module imports no torch: the command line, the
gateway and a plan read back start without it. A new device kind is one more DeviceKind here and
one more platform there.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# a worker process before its model (interpreter, torch, transformers, zmq), as PSS when several run
# together: measured by bench/memory.py
CPU_WORKER_OVERHEAD_BYTES = 280 * 2**20
# GPU memory of a CUDA worker beyond its weights and KV pool (the CUDA context, cuBLAS workspaces, the
# step's activations and logits in the caching allocator), and of a weight owner beyond the weights
# (its context): measured by bench/gpu.py (H100, torch 2.11, SmolLM2 at 512 batch tokens)
CUDA_WORKER_OVERHEAD_BYTES = 960 * 2**20
CUDA_OWNER_OVERHEAD_BYTES = 560 * 2**20


@dataclass(frozen=True, slots=True)
class DeviceKind:
    """One kind of device, as the deployment sees it."""

    name: str  # "cpu", "cuda": torch's device type
    worker_overhead: int  # bytes of the device's memory a worker takes beyond weights, packed linears, KV
    # copies that share weights attach to one owner process per device (CUDA IPC); otherwise they map
    # one read-only file (workers.weights.shared)
    owner_shares_weights: bool
    owner_overhead: int  # what that owner process adds (its context)
    # the machine itself: its memory is the host's, and its workers split the host's cores as torch
    # threads, each bound to cores of its own
    host: bool

    def ray_bundle(self, threads: int | None, gpu_share: float) -> dict[str, float]:
        """The resources an actor of a worker on this kind of device asks Ray for."""
        if self.owner_shares_weights:
            return {"GPU": gpu_share, "CPU": 1.0}
        return {"CPU": float(threads or 1)}

    def actor_device(self, device: str) -> str:
        """The device a worker placed by Ray names: an actor sees only the GPU Ray gave it, as index 0."""
        return device if self.host else f"{self.name}:0"


CPU = DeviceKind("cpu", CPU_WORKER_OVERHEAD_BYTES, owner_shares_weights=False, owner_overhead=0, host=True)
CUDA = DeviceKind("cuda", CUDA_WORKER_OVERHEAD_BYTES, owner_shares_weights=True,
                  owner_overhead=CUDA_OWNER_OVERHEAD_BYTES, host=False)
KINDS = {k.name: k for k in (CPU, CUDA)}


def device_kind(device) -> DeviceKind:
    """The kind of `device` ('cpu', 'cuda', 'cuda:N', or a torch.device)."""
    name = str(getattr(device, "type", device)).split(":", 1)[0]
    kind = KINDS.get(name)
    if kind is None:
        raise ValueError(f"device {device!r} is not one of {', '.join(sorted(KINDS))} (with an index: 'cuda:N')")
    return kind


def check_device(device) -> str:
    """`device` when it names a device a worker can run on ('cpu', 'cuda', 'cuda:N'), else ValueError."""
    if isinstance(device, str):
        name, _, index = device.partition(":")
        if name in KINDS and (not index or (index.isdigit() and not KINDS[name].host)):
            return device
    raise ValueError(f"device must be 'cpu' or 'cuda:N', got {device!r}")


def resolve_devices(devices) -> list[str]:
    """The `devices` setting as a list: `auto` is every CUDA device, else the CPU."""
    if devices in (None, "auto"):
        import torch

        n = torch.cuda.device_count()
        return [f"cuda:{i}" for i in range(n)] or ["cpu"]
    if isinstance(devices, str):
        devices = [d.strip() for d in devices.split(",") if d.strip()]
    if not isinstance(devices, list) or not devices:
        raise ValueError(f"devices must be 'auto', 'cpu', 'cuda:N' or a list of them, got {devices!r}")
    for d in devices:
        try:
            check_device(d)
        except ValueError:
            raise ValueError(f"devices: {d!r} is not 'cpu' or 'cuda:N'") from None
    return devices


def absent_devices(devices) -> str | None:
    """Why a CUDA device among `devices` is not on this machine, as torch sees it, or None when each is
    (a worker placed on one would fail its load, and be started again, for nothing)."""
    cuda = sorted({str(d) for d in devices if not device_kind(d).host})
    if not cuda:
        return None
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        why = (f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None
               else "torch finds no CUDA device")
        return f"devices: {', '.join(cuda)} given, but this machine has no CUDA device ({why}); use cpu or auto"
    missing = [d for d in cuda if (torch.device(d).index or 0) >= n]
    if missing:
        return (f"devices: {', '.join(missing)} given, but this machine has {n} CUDA device(s), "
                f"cuda:0 to cuda:{n - 1}")
    return None


def available_bytes(device: str) -> int | None:
    """Memory free on `device` now (None where it cannot be read)."""
    if device_kind(device).host:  # the host's memory
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"devices: {device} does not exist: this machine has {torch.cuda.device_count()} CUDA "
                         f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    # asked in a child process: a CUDA context here would hold ~500 MiB of the GPU for as long as the
    # serving process lives (the router and gateway never use the GPU)
    code = f"import torch; print(torch.cuda.mem_get_info({index})[0])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"could not read the free memory of {device}: {out.stderr.strip()[-500:]}")
    return int(out.stdout.split()[-1])
