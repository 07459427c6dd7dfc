"""Forward-only timing of a schedule: record the model calls a runner makes, then run them again
alone (bench/engine.py's `forward` figures)."""

from __future__ import annotations

import torch


def record_calls(runner) -> list:
    """From now until stop_recording, each model call of the PagedRunner (its step layout and inputs)."""
    calls: list = []
    run_call = runner.run_call

    def recording(ctx, call):
        calls.append((ctx, call))
        return run_call(ctx, call)

    runner.run_call = recording
    return calls


def stop_recording(runner) -> None:
    del runner.run_call  # the class's own again


@torch.inference_mode()
def replay(runner, calls: list) -> None:
    """Re-run recorded model calls alone: the forward-only cost of a schedule."""
    for ctx, call in calls:
        ctx.masks.clear()
        ctx.prompt_groups.clear()
        runner.run_call(ctx, call)
