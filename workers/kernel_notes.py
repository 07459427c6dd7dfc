"""The kernels a model's workers picked by measuring at load (workers.engine.cpu.row_kernels, and
prefill_route for the prompt chunks' attention), kept
per machine in the cache so that `validate_only` shows them before any worker starts. A note is
keyed by all the choice depends on: the model's weights, its precision, the threads, the most rows
a step has, the CPU and torch; a deployment that changes any of them is measured again at load."""

from __future__ import annotations

import hashlib
import re

from workers.capability import machine_tag
from workers.files import cache_root, read_keyed, write_keyed
from workers.precision import Precision
from workers.spec import WorkerSpec
from workers.weights.sources import source_key

# the row kernels' measurement and rule (workers.engine.cpu.row_kernels keys its kept choices with it):
# bumped when either changes, so that the choices kept on a machine, and the notes of them that plans
# read here, are measured and written anew
CHOICE_VERSION = 6


def note_key(source: str, precision: Precision, threads: int, max_rows: int) -> str:
    return "|".join(map(str, ("kernels", f"row kernels {CHOICE_VERSION}", source_key(source), precision,
                              f"{threads} threads", f"{max_rows} rows", machine_tag())))


def planned(spec: WorkerSpec, precision: Precision) -> dict[str, str] | None:
    """What an earlier load on this machine picked for a planned worker (its model, precision,
    threads and most rows a step: max of its batch tokens and batch size, as the engine counts
    them), or None: not measured yet, or the worker's threads not fixed by the plan."""
    if not spec.threads:
        return None
    return recall(note_key(spec.model.source, precision, spec.threads, max(spec.batch_tokens, spec.batch_size)))


def _path(key: str):
    return cache_root() / "calibration" / f"note-{hashlib.sha1(key.encode()).hexdigest()[:20]}.json"


def remember(key: str, kernels: dict[str, str]) -> None:
    """Keep what was picked under `key` (a read-only cache keeps nothing)."""
    write_keyed(_path(key), key, kernels)


def recall(key: str) -> dict[str, str] | None:
    """What was picked under `key` at an earlier load on this machine, or None."""
    kept = read_keyed(_path(key), key)
    return dict(kept) if isinstance(kept, dict) else None


def takes(kernels: dict[str, str], way: str) -> bool:
    """Whether any linear's choice among `kernels` (a note: shape -> RowChoice.describe()) takes the
    row kernels' way named `way` at some row count."""
    return any(way in re.findall(r"[a-z0-9_]+", choice) for choice in kernels.values())
