"""The generation engine: continuous batching over a packed forward (see workers/engine/engine.py).

`Engine` and `EngineConfig` are imported on first use: the engine's modules import torch (seconds),
and the parts of a worker that only carry text (its output thread, its messages, the echo worker
of router benchmarks) import the modules beside them without it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.engine.engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig"]


def __getattr__(name: str):
    if name in __all__:
        from workers.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
