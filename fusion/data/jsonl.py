"""JsonlCompletions: OpenAI completions requests, one per line, in every *.jsonl of data_dir (a line
may also be in OpenAI's Batch API form, its request in `body`).

Output for `<name>.jsonl` is `<model_dir>/predictions/output_<name>.jsonl`, one line per input line
in input order: {"request": ..., "result": <completion object> + "request_time"} or
{"request": ..., "error": {"code", "message"}}. Lines are appended to a `.partial` file as soon as
they and every line before them are done, and the file is renamed when complete: a rerun resumes
after the last whole line, and a half-written output file never appears under its final name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from fusion.data.files import (
    DataError,
    atomic_write,
    durable_replace,
    json_line,
    read_whole_lines,
    split_json_lines,
)
from wire.protocol import text_error, unencodable

ROUTE_KEYS = ("model", "engine")


@dataclass(slots=True)
class JsonlLine:
    number: int  # 1-based line number in its file
    request: dict | str  # the parsed line (echoed in its output record), or the raw text when it is not a JSON object
    variant: str | None = None  # where it goes; None when error is set
    error: str | None = None  # why it can't be served, naming the file and line
    body: dict | None = None  # the completion request served: the line, or its `body` in OpenAI's Batch API form


BATCH_URL = "/v1/completions"  # the one endpoint of OpenAI's Batch API form these lines may name


def completion_body(req: dict) -> dict:
    """The completion request of a line: the line itself, or the `body` of a line in OpenAI's Batch
    API form ({"custom_id", "method", "url", "body"}). ValueError names what is wrong."""
    if "body" not in req and "url" not in req:
        if "messages" in req and "prompt" not in req:
            raise ValueError("this is a chat request (messages): JsonlCompletions takes completion requests "
                             "(prompt); the HTTP gateway's /v1/chat/completions serves chats")
        return req
    url, body = req.get("url"), req.get("body")
    if url != BATCH_URL:
        raise ValueError(f"url must be {BATCH_URL} (OpenAI's Batch API form; JsonlCompletions takes completion "
                         f"requests), got {url!r}")
    if req.get("method", "POST") != "POST":
        raise ValueError(f"method must be POST, got {req.get('method')!r}")
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object, the completion request, got {type(body).__name__}")
    return body


@dataclass(slots=True)
class JsonlFile:
    path: Path
    default_variant: str
    lines: list[JsonlLine] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.stem


def find_files(data_dir: str | Path) -> list[Path]:
    d = Path(data_dir)
    if not d.is_dir():
        raise DataError(f"data_dir {d} is not a directory")
    files = sorted(d.glob("*.jsonl"))
    if not files:
        raise DataError(f"data_dir {d} holds no .jsonl file")
    return files


def route(request: dict, default: str, names: set[str], sources: dict[str, str]) -> str:
    """The variant a request goes to: its `model` or `engine` field (a variant name, or the source
    of exactly one variant), else the variant whose input this is."""
    want = next((request[k] for k in ROUTE_KEYS if request.get(k) is not None), None)
    if want is None:
        return default
    if not isinstance(want, str):
        raise ValueError(f"model must be a variant name (a string), got {want!r}")
    if want in names:
        return want
    if want in sources:
        return sources[want]
    raise ValueError(f"unknown model {want!r}: this deployment serves {', '.join(sorted(names))}")


def parse_file(path: Path, default_variant: str, names: set[str], sources: dict[str, str],
               routed: bool = True) -> JsonlFile:
    """Parse every line; a bad line becomes an error line, never an exception (the others still run).
    routed=False sends every line to default_variant, whatever its `model` says (eval)."""
    out = JsonlFile(path, default_variant)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None
    for i, raw in enumerate(split_json_lines(data), start=1):
        where = f"{path.name} line {i}"
        if isinstance(raw, UnicodeDecodeError):
            out.lines.append(JsonlLine(i, raw.object.decode("utf-8", "replace"),
                                       error=f"{where}: not UTF-8 text (byte 0x{raw.object[raw.start]:02x} at "
                                             f"column {raw.start + 1})"))
            continue
        if not raw.strip():
            continue  # blank lines (e.g. a trailing newline) are not requests
        try:
            req = json.loads(raw)
        except json.JSONDecodeError as exc:
            out.lines.append(JsonlLine(i, raw, error=f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"))
            continue
        except RecursionError:  # arrays or objects nested past the parser's depth
            out.lines.append(JsonlLine(i, raw, error=f"{where}: not valid JSON (nested too deeply)"))
            continue
        if not isinstance(req, dict):
            out.lines.append(JsonlLine(i, req, error=f"{where}: a request must be a JSON object, got "
                                                       f"{type(req).__name__}"))
            continue
        found = unencodable(req)
        if found is not None:  # an escape spelling half of a UTF-16 pair: the line as read is its record
            out.lines.append(JsonlLine(i, raw, error=f"{where}: {text_error(*found)}"))
            continue
        try:
            body = completion_body(req)
            prompt = body.get("prompt")
            if isinstance(prompt, list):
                if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                    raise ValueError("prompt must be text or a non-empty list of token IDs")
            elif not isinstance(prompt, str) or not prompt:
                raise ValueError("prompt is missing or empty" if not prompt else
                                 f"prompt must be text or a list of token IDs, got {type(prompt).__name__}")
            variant = route(body, default_variant, names, sources) if routed else default_variant
        except ValueError as exc:
            out.lines.append(JsonlLine(i, req, error=f"{where}: {exc}"))
            continue
        out.lines.append(JsonlLine(i, req, variant=variant, body=body))
    return out


def output_path(predictions_dir: Path, input_path: Path) -> Path:
    return predictions_dir / f"output_{input_path.stem}.jsonl"


RETRY = "retry"  # set in an error record for a transient failure: a rerun serves that line again


def is_retry(record: dict) -> bool:
    err = record.get("error")
    return isinstance(err, dict) and bool(err.get(RETRY))


class ResumableWriter:
    """Output lines in input order, appended to `<final>.partial` and renamed to `final` when all are
    written. A rerun resumes after the last whole line and serves again the lines whose record is a
    transient error (`retry`); their new records replace the old ones in place."""

    def __init__(self, final: Path):
        self.final = final
        self.partial = final.with_name(final.name + ".partial")
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists() and not self.partial.exists():
            os.replace(final, self.partial)  # finished output: a rerun only retries its transient errors
        records = read_whole_lines(self.partial)
        self.done = len(records)
        self.retry = [i for i, r in enumerate(records) if is_retry(r)]  # positions to serve again
        self._replaced: dict[int, dict] = {}
        self._fh = None

    def write(self, record: dict) -> None:
        if self._fh is None:
            self._fh = open(self.partial, "a", encoding="utf-8")
        self._fh.write(json_line(record))
        self.done += 1

    def replace(self, position: int, record: dict) -> None:
        """The new record of a line written earlier (a retried transient error); applied by finish()."""
        self._replaced[position] = record

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def finish(self) -> None:
        self.close()
        if not self.partial.exists():
            self.partial.touch()  # an input with no lines still gets its (empty) output
        if not self._replaced:
            durable_replace(self.partial, self.final)
            return

        def merged(f):
            with open(self.partial, "rb") as src:
                for pos, line in enumerate(src):
                    rec = self._replaced.get(pos)
                    f.write(line if rec is None else json_line(rec).encode("utf-8"))

        atomic_write(self.final, merged)
        self.partial.unlink()

    def close(self) -> None:
        if self._fh is not None:
            self.flush()
            self._fh.close()
            self._fh = None
