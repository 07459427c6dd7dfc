"""Tokenizers the fork server builds once, so that a copy forked from it starts with its tokenizer
already in memory.

Building a tokenizer is most of a warm load for a large vocabulary: transformers parses Gemma 3's
262k-token `tokenizer.json` in Python and rebuilds it, about 3 s of CPU, for every copy started,
every reload after an eviction included. The serving command names the sources it may load in
`HOLD_ENV` (a JSON list) while it starts the fork server (fusion.launcher.start_server); the server
imports this module among its preloads and builds the tokenizer of each source whose shared
weights are in the cache already (workers.weights.shared). A forked copy inherits them, copy on
write, and `from_directory` hands it the one built from the same files.

Only the fork server reads `HOLD_ENV`, at its start; every other process (a worker started by
hand, on Ray, or before the server) holds nothing and builds its tokenizer as it always did. A
tokenizer that fails to build here is left out: the copy then builds it itself and reports the
error where a load error belongs.

Within one process, loads of directories whose tokenizer files are the same (a source's float16
and float32 directories, its converted GGUF cache, a model saved again) share one tokenizer while
any of them is in use (`from_directory`): the second load of Gemma 3 in a process costs a file
digest (tens of milliseconds) instead of a rebuild. Only weak references are kept: an evicted
model's tokenizer goes with it, as its memory is outside the weights' budget. Nothing here changes a
tokenizer after it is built, and the engine's tokenizer calls set no padding or truncation (the
calls that change a Rust tokenizer's state), so sharing one between engines changes no answer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import weakref
from pathlib import Path

from workers.gc_pause import collector_paused

HOLD_ENV = "MMFUSION_HOLD_TOKENIZERS"
log = logging.getLogger("mmfusion.tokenizers")
# the weights and configs beside a tokenizer: not what it is built from (config.json's fields that
# choose the tokenizer's class are read on their own)
NOT_TOKENIZER = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".lock")
NOT_TOKENIZER_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
# tokenizers built in this process by what they are built from, while something uses them
_BUILT: weakref.WeakValueDictionary[bytes, object] = weakref.WeakValueDictionary()
# the directory each tokenizer from_directory handed out was built from, while it is in use
_DIRS: weakref.WeakKeyDictionary[object, str] = weakref.WeakKeyDictionary()


def from_directory(path_dir: Path | str):
    """The tokenizer of a Hugging Face directory: the one this process built (or was forked holding)
    from the same files, while it is in use, else built now."""
    from transformers import AutoTokenizer

    try:
        key = _files_digest(Path(path_dir))
    except (OSError, ValueError):  # unreadable files or config: transformers says what is wrong
        key = None
    tok = _BUILT.get(key) if key is not None else None
    if tok is None:
        with collector_paused():  # a large vocabulary is a burst of Python objects (workers.gc_pause)
            tok = AutoTokenizer.from_pretrained(str(path_dir), local_files_only=True)
        if key is not None:
            _BUILT[key] = tok
    _DIRS.setdefault(tok, str(path_dir))
    return tok


def directory_of(tokenizer) -> str | None:
    """The directory `from_directory` built `tokenizer` from (another process gets the same
    tokenizer from it), or None for one built otherwise."""
    try:
        return _DIRS.get(tokenizer)
    except TypeError:  # not weakly referable
        return None


def build(sources: list[str]) -> dict[str, object]:
    """Tokenizer by shared directory, for each source whose shared weights are in the cache."""
    from workers.weights.sources import shared_dirs

    built: dict[str, object] = {}  # one tokenizer for the dtypes' directories of one source (from_directory)
    for source in sources:
        try:
            dirs = shared_dirs(source)
        except (OSError, ValueError):  # a source that does not exist: its load will say so
            continue
        for d in dirs:
            if not (d / "tokenizer_config.json").exists():
                continue
            try:
                built[str(d.resolve())] = from_directory(d)
            except Exception as exc:  # noqa: BLE001 - the copy builds it itself and reports the error
                log.warning("tokenizer of %s not held: %s", d, exc)
    return built


def _files_digest(d: Path) -> bytes:
    """What a directory's tokenizer is built from, by content: every file but the weights and
    configs (tokenizer.json, its config, a sentencepiece model, vocab and merges, chat templates),
    and the config's fields that choose the tokenizer's class."""
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(d.iterdir()):
        if not f.is_file() or f.name in NOT_TOKENIZER_FILES or f.name.endswith(NOT_TOKENIZER):
            continue
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    config = d / "config.json"
    if config.is_file():
        fields = json.loads(config.read_text())
        h.update(json.dumps([fields.get("model_type"), fields.get("tokenizer_class")]).encode())
    return h.digest()


def _from_env() -> dict[str, object]:
    raw = os.environ.get(HOLD_ENV)
    if not raw:
        return {}
    try:
        sources = [s for s in json.loads(raw) if isinstance(s, str)]
    except (ValueError, TypeError):
        return {}
    return build(sources)


# built once, at import, in the fork server only (the only process started with HOLD_ENV set),
# and kept alive here: from_directory finds them by their files
_HELD = _from_env()


def held_count() -> int:
    """For how many shared directories this process holds a tokenizer (for tests)."""
    return len(_HELD)
