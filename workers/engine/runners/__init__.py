"""The runners, one file a device (cpu.py, cuda.py) beside the packed runner they build on
(paged.py) and the compat runner for models whose attention is their own (compat.py). The engine
builds one through `make_runner` and takes it through Runner's interface (base.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.devices import CPU, CUDA
from workers.engine.runners.base import Runner
from workers.engine.runners.compat import CompatRunner
from workers.engine.runners.cpu import CpuRunner
from workers.engine.runners.cuda import CudaRunner
from workers.engine.runners.paged import PagedRunner

if TYPE_CHECKING:
    from workers.engine.attention import ContextHolder
    from workers.engine.attention_backend import AttentionBackend
    from workers.engine.kv_cache import CacheLayout
    from workers.platform import Platform
    from workers.weights.loaded_model import LoadedModel

# a platform's device kind (workers.devices) -> its packed runner
RUNNERS: dict[str, type[PagedRunner]] = {CPU.name: CpuRunner, CUDA.name: CudaRunner}


def make_runner(platform: Platform, lm: LoadedModel, holder: ContextHolder | None, layout: CacheLayout,
                backend: AttentionBackend | None, max_batch_size: int) -> Runner:
    """The runner of `lm` on `platform`: its device's packed runner, or the compat runner where the
    model's attention is its own (`holder` None)."""
    if holder is None:
        return CompatRunner(lm, platform, layout)
    return RUNNERS[platform.kind.name](lm, platform, holder, layout, backend, max_batch_size)
