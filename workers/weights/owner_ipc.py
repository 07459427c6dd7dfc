"""What a deployment needs to know about weight owners without loading torch: the key variable and
the shared-memory files an owner's IPC leaves behind."""

from __future__ import annotations

import contextlib
from pathlib import Path

KEY_ENV = "MMFUSION_OWNER_KEY"  # the deployment's key reaches owners and copies through this variable


def ipc_files(pid: int, shm: Path = Path("/dev/shm")) -> list[Path]:
    """The shared-memory files a process's IPC left: the CUDA driver's `cuda.shm.<dev>.<pid in hex>.<n>`
    (an exporting process leaves them behind on H100 with driver 580, however it exits) and torch's
    `torch_<pid>_...` (file_system sharing)."""
    return [*shm.glob(f"cuda.shm.*.{pid:x}.*"), *shm.glob(f"torch_{pid}_*")]


def remove_ipc_files(pid: int) -> int:
    """After process `pid` has exited: remove what its IPC left in /dev/shm. Returns how many."""
    n = 0
    for f in ipc_files(pid):
        with contextlib.suppress(FileNotFoundError):
            f.unlink()
            n += 1
    return n
