"""The runners: the packed runner every device builds on (paged.py), the compat runner for models
whose attention is their own (compat.py), and each device's own in its room (workers/engine/cpu/,
workers/engine/cuda/), imported only where that device runs. The engine builds one through
`make_runner` and takes it through Runner's interface (base.py)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from workers.devices import CPU, CUDA
from workers.engine.runners.base import Runner
from workers.engine.runners.compat import CompatRunner

if TYPE_CHECKING:
    from workers.engine.attention import ContextHolder
    from workers.engine.attention_backend import AttentionBackend
    from workers.engine.kv_cache import CacheLayout
    from workers.platform import Platform
    from workers.weights.loaded_model import LoadedModel

# a platform's device kind (workers.devices) -> the module of its room whose DeviceRunner runs it:
# imported by name, so a process loads only its own device's modules (tests/test_imports.py)
ROOMS: dict[str, str] = {CPU.name: "workers.engine.cpu.runner", CUDA.name: "workers.engine.cuda.runner"}


def make_runner(platform: Platform, lm: LoadedModel, holder: ContextHolder | None, layout: CacheLayout,
                backend: AttentionBackend | None, max_batch_size: int) -> Runner:
    """The runner of `lm` on `platform`: its device's packed runner, or the compat runner where the
    model's attention is its own (`holder` None). `backend`: attention kernels to run instead of
    those the device's chooser picks (a checked one in a test)."""
    if holder is None:
        if platform.deterministic:
            raise ValueError(f"deterministic: true needs the paged attention, and {type(lm.model).__name__} keeps an "
                             f"attention of its own: use {platform.deterministic_needs}")
        return CompatRunner(lm, platform, layout)
    room = importlib.import_module(ROOMS[platform.kind.name])
    return room.DeviceRunner(lm, platform, holder, layout, backend, max_batch_size)
