"""Derived weights whose source has changed or gone leave the cache.

The shared weights (`shared/<source key>-<dtype>/`), the quantized linears and their AMX tiles
(`quantized/<source key>-...safetensors`) are keyed by their source's files, sizes and times
(workers.weights.sources.source_key). Reinstalling a model's package, or deleting a checkout
that held it, gives the source a new key, and the old entries could never be read again: four
installs of SmolLM2 on one machine left 3.0 GB, three of them unreachable. So each entry gets a
record of the files it came from (`<entry>.source.json`), and whenever a new entry is written, the
entries of that folder whose recorded files are missing or changed are removed, as Ollama prunes
the blobs no model names when it starts.

An entry a process still maps is kept: `workers.weights.shared.map_tensors` holds a shared lock on
the file for as long as its mapping lives (the kernel drops it when the process dies), and an entry
goes only under an exclusive lock that no mapping holds, taken without waiting. Entries without a
record (written before records existed, or from a tiny model) are left as they are.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
from pathlib import Path

from workers.files import atomic_replace, one_at_a_time
from workers.weights.sources import source_files

log = logging.getLogger("mmfusion.cache")
RECORD_SUFFIX = ".source.json"
RECORD_FORMAT = "mmfusion-source-1"


def record_path(entry: Path) -> Path:
    return entry.with_name(entry.name + RECORD_SUFFIX)


def write_record(entry: Path, source: str) -> None:
    """Record the files `entry` was derived from (nothing for a source without files)."""
    files = source_files(source)
    if not files:
        return
    body = json.dumps({"format": RECORD_FORMAT, "source": source, "files": [list(f) for f in files]})
    with contextlib.suppress(OSError):  # a read-only cache: the entry stays, unrecorded
        atomic_replace(record_path(entry), lambda tmp: tmp.write_text(body))


def stale(record: Path) -> bool:
    """Whether a record names a file that is gone or no longer has its size and time: the key of
    its entry can then never be computed again. An unreadable record is not judged stale."""
    try:
        body = json.loads(record.read_text())
        if body.get("format") != RECORD_FORMAT:
            return False
        files = [(str(p), int(size), int(mtime)) for p, size, mtime in body["files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    for path, size, mtime in files:
        try:
            st = os.stat(path)
        except OSError:
            return True
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            return True
    return False


def mapped(path: Path) -> bool:
    """Whether some process maps `path` (holds map_tensors' shared lock on it). A file this process
    cannot open or lock counts as mapped: it is kept."""
    try:
        with open(path, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return True
    return False


def prune_stale(folder: Path) -> list[Path]:
    """Remove the entries of `folder` whose records are stale and that no process maps, with their
    records. Returns the entries removed."""
    removed = []
    try:
        records = sorted(folder.glob("*" + RECORD_SUFFIX))
    except OSError:
        return removed
    for record in records:
        if not stale(record):
            continue
        entry = record.with_name(record.name.removesuffix(RECORD_SUFFIX))
        with one_at_a_time(entry):
            if not stale(record):
                continue
            # a shared weights directory's mapped files are its safetensors (workers.weights.shared)
            data = sorted(entry.glob("*.safetensors")) if entry.is_dir() else [entry] if entry.exists() else []
            if any(mapped(f) for f in data):
                continue
            try:
                if entry.is_dir():
                    shutil.rmtree(entry)
                elif entry.exists():
                    entry.unlink()
                record.unlink()
            except OSError as exc:
                log.warning("could not remove the stale cache entry %s (%s)", entry, exc)
                continue
        log.info("removed %s from the cache: the source it was derived from changed or is gone", entry)
        removed.append(entry)
    return removed


def recorded(entry: Path, source: str) -> None:
    """After `entry` was written for `source`: record it, then prune its folder's stale entries."""
    write_record(entry, source)
    prune_stale(entry.parent)


def adopt(entry: Path, source: str) -> None:
    """After `entry` was opened for `source` under its current key: record it where it has no
    record yet (an entry written before records existed), so that it can be pruned later."""
    if not record_path(entry).exists():
        write_record(entry, source)
