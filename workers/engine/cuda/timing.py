"""How the CUDA room times a kernel at load, to choose between ways of computing the same thing
(workers.engine.cuda.tile_choice, int4_rows): CUDA events on the current stream, the best of a few
calls after a warm-up."""

from __future__ import annotations

from collections.abc import Callable

import torch

CALLS = 20  # timed calls of each way (after WARM_UP)
WARM_UP = 3

Timer = Callable[[Callable[[], object]], float]  # seconds one call of fn takes


def cuda_timer(fn: Callable[[], object]) -> float:
    """The fastest of CALLS calls of fn on the current CUDA stream, timed by CUDA events."""
    for _ in range(WARM_UP):
        fn()
    best = float("inf")
    for _ in range(CALLS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best
