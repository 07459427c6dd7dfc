"""The generation engine: continuous batching over a packed forward (see workers/engine/engine.py)."""

from workers.engine.engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig"]
