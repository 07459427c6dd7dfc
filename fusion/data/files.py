"""What the batch jobs' files share: the input error, atomic durable writes, an append-only record log.

Writes go through workers.files.atomic_replace: after a crash the target is either the old file
or the whole new one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

from workers.files import atomic_replace


class DataError(ValueError):
    """Bad input data or settings; the message names the file and the row, line or key."""


# Valid unescaped inside JSON strings, but line breaks to str.splitlines() and many JSONL readers:
# a generated text holding one would tear its record in two there.
_LINE_BREAKS_IN_STRINGS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def json_line(record) -> str:
    """One JSON Lines record, newline included: UTF-8 text kept as is (ensure_ascii=False), except
    the characters other than \\n that some readers split lines on (json.dumps escapes the ASCII
    ones), so that the record is one line to any reader."""
    return json.dumps(record, ensure_ascii=False).translate(_LINE_BREAKS_IN_STRINGS) + "\n"


def split_json_lines(data: bytes) -> list[str | UnicodeDecodeError]:
    """JSON Lines split as the format defines them: on \\n (a \\r before it dropped), never on the
    other characters str.splitlines() breaks at, which may stand unescaped inside strings. Each
    line decoded as UTF-8 alone (a byte order mark before the first dropped), so a line that is not
    UTF-8 is that line's error (the decoding's), not the file's."""
    lines = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    out: list[str | UnicodeDecodeError] = []
    for ln in lines:
        try:
            out.append((ln[:-1] if ln.endswith(b"\r") else ln).decode("utf-8"))
        except UnicodeDecodeError as exc:
            out.append(exc)
    return out


def writable_dir(path: str | Path) -> Path:
    """`path` made (with its parents) and checked to take new files, before any model loads: the
    outputs would otherwise fail to open only after the loads and the first batches."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-check-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise DataError(f"model_dir {path}: cannot write there ({exc.strerror or exc}): give --model_dir "
                        "another directory") from None
    return path


def durable_replace(src: str | Path, dst: str | Path) -> None:
    """Rename src over dst once src's bytes are on disk, then make the rename itself durable."""
    atomic_replace(dst, lambda tmp: os.replace(src, tmp))


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """write(f) fills a temp file beside `path`, which then replaces `path` durably."""

    def fill(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            write(f)

    atomic_replace(path, fill)


def write_json_atomic(path: str | Path, obj) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(obj, ensure_ascii=False).encode("utf-8")))


def read_whole_lines(path: Path) -> list[dict]:
    """The JSON records of a log written line by line; a torn or unreadable last line (a run killed
    mid-write) is cut off the file, so appending goes on after the last whole record."""
    if not path.exists():
        return []
    data = path.read_bytes()
    keep, records = 0, []
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            records.append(json.loads(line))
        except ValueError:
            break
        keep += len(line)
    if keep != len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    return records


class RecordLog:
    """Append-only JSON lines, each fsynced as written: what a killed run had finished survives."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.records = read_whole_lines(path)
        self._fh = None

    def append(self, record: dict) -> None:
        if self._fh is None:
            self._fh = open(self.path, "a", encoding="utf-8")
        self._fh.write(json_line(record))
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.records.append(record)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
