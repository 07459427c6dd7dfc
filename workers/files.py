"""Where the project keeps what it builds, and the one way it replaces a file or directory.

Everything cached (GGUF conversions, shared weights, compiled artifacts, inductor's kernels) lives
under one root, `$MMFUSION_CACHE` (default `~/.cache/mmfusion`).

`atomic_replace` writes into a temporary sibling and renames it into place once complete and on
disk, then syncs the directory: after a crash, or to a concurrent reader, the target is the old
version or the whole new one, never a part.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

CACHE_ENV = "MMFUSION_CACHE"
T = TypeVar("T")


def cache_root() -> Path:
    """The root of everything the project caches: `$MMFUSION_CACHE`, default `~/.cache/mmfusion`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mmfusion")


def inductor_default() -> Path:
    """Where inductor's cache goes until a compile names its CPU level's directory (see the
    package's text)."""
    return cache_root() / "inductor"


@contextlib.contextmanager
def one_at_a_time(path: Path) -> Iterator[None]:
    """Held by one process at a time for the cached thing at `path` (an exclusive lock on a hidden
    file beside it, `.<name>.lock`; the kernel lets go of it when its holder dies): copies starting
    together build or measure it once, the others wait and read it. Where the lock file cannot be
    made (a read-only cache), each goes on alone.

    The holder removes the lock file before it lets go, so none is left in the cache. A waiter
    that then gets the lock holds a file no longer at that path (its inode is not the path's), and
    takes the path's new one instead: two holders never hold different files at once."""
    name = path.parent / f".{path.name}.lock"
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = open(name, "w")
        except OSError:
            yield
            return
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            same = os.stat(name).st_ino == os.fstat(lock.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        lock.close()  # removed by the holder before us: lock the file now at that path
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)
        lock.close()


def read_keyed(path: Path, key: str, missing=None):
    """The value kept in the JSON file `path` under exactly `key` (write_keyed), or `missing` where
    the file is missing, unreadable or kept for another key."""
    try:
        kept = json.loads(path.read_text())
        return kept["value"] if kept.get("key") == key else missing
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return missing


def write_keyed(path: Path, key: str, value) -> None:
    """Keep `value` (anything JSON holds) under `key` in the file `path`, replaced whole; a
    read-only cache keeps nothing."""
    try:
        atomic_replace(path, lambda tmp: tmp.write_text(json.dumps({"key": key, "value": value})))
    except OSError:
        pass


_MISSING = object()  # nothing kept (a kept figure may be None)


def remembered(key: str, measure: Callable[[], T]) -> T:
    """The figure measured earlier on this machine under `key` (everything it depends on: model,
    dtype, kernels, threads, the CPU or GPU), else `measure()`, kept for the next load under the
    cache's `calibration/`. A missing or unreadable file is measured again. The figure is anything
    JSON keeps (a number, a list of names). Copies starting together measure it once: the others
    wait, then read it (and no copy's measurement shares the device with another's)."""
    path = _calibration_path(key)
    kept = read_keyed(path, key, _MISSING)
    if kept is not _MISSING:
        return kept
    with one_at_a_time(path):
        kept = read_keyed(path, key, _MISSING)
        if kept is not _MISSING:
            return kept
        value = measure()
        write_keyed(path, key, value)
    return value


def recalled(key: str, default: object = None) -> object:
    """The figure `remembered` keeps under `key`, or `default` where none is kept yet."""
    return read_keyed(_calibration_path(key), key, default)


def _calibration_path(key: str) -> Path:
    return cache_root() / "calibration" / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.json"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def _umask() -> int:
    """The process's umask, read where Linux shows it: setting it to learn it would change it for
    every thread meanwhile."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def atomic_replace(dest: str | Path, fill: Callable[[Path], None], *, is_dir: bool = False) -> bool:
    """`fill(tmp)` writes a temporary sibling of `dest` (a file, or a directory when `is_dir`); once
    it returns, the result is synced and renamed over `dest`. On any error the temporary is removed
    and `dest` is untouched.

    A directory cannot be renamed over a non-empty one, so the old one is first renamed aside (a
    reader sees the old directory or none, never half of one). When several writers race, the
    first to put its directory in place wins and the others' are dropped: returns False for them."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # mkstemp and mkdtemp make 0600 and 0700, private to this user; what they become is an ordinary
    # file or directory, whose mode the umask decides as for any other
    if is_dir:
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
        tmp.chmod(0o777 & ~_umask())
    else:
        fd, name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
        os.fchmod(fd, 0o666 & ~_umask())
        os.close(fd)
        tmp = Path(name)
    placed = True
    try:
        fill(tmp)
        _fsync_tree(tmp)
        if not is_dir:
            os.replace(tmp, dest)
        else:
            old = dest.parent / f".{dest.name}.old-{os.getpid()}"
            try:
                os.rename(dest, old)
            except FileNotFoundError:
                old = None  # no entry yet, or another writer moved it a moment ago
            try:
                os.rename(tmp, dest)
            except OSError:  # another writer put its directory in place first: keep that one
                placed = False
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        fsync_dir(dest.parent)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    return placed
