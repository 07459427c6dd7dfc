"""Loading a model behind serving: the load's CPU work runs in a thread of its own at a lower CPU
priority, so that on cores shared with other models' workers the scheduler gives serving threads
most of the CPU, and the load takes what they leave.

Priority is per thread on Linux (a nice value set on a thread ID), and threads inherit it from the
thread that starts them: the OpenMP threads torch starts for the load belong to the load thread
and end with it, while the engine thread that serves afterwards keeps the priority it had. Raising
a nice value needs no privilege; lowering it again would, which is why the load gets a thread of
its own rather than a raise and a lowering of the engine thread's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
# nice +10: about a tenth of a core's time against a serving thread at 0. On 2 cores saturated by
# one model (bench/models.py's head-of-line scenario) its p50 while Gemma 3 loads was 1.15x its p50
# alone and the loads took 0.6-3 s; at +19 1.01x, but the loads took 4-14 s; at +5 1.86x.
LOAD_NICE = 10


def at_low_priority(fn: Callable[[], T], nice: int = LOAD_NICE) -> T:
    """fn()'s result (or its exception, raised here), computed in a thread whose nice value is
    `nice` more than this thread's; where priorities cannot be set, at this thread's own."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except (OSError, AttributeError):  # no per-thread priorities here: load at ours
            pass
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
