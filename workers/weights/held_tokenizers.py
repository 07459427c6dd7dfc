"""Tokenizers the fork server builds once, so that a copy forked from it starts with its tokenizer
already in memory.

Building a tokenizer is most of a warm load for a large vocabulary: transformers parses Gemma 3's
262k-token `tokenizer.json` in Python and rebuilds it, about 3 s of CPU, for every copy started,
every reload after an eviction included. The serving command names the sources it may load in
`HOLD_ENV` (a JSON list) while it starts the fork server (fusion.launcher.start_server); the server
imports this module among its preloads and builds the tokenizer of each source whose shared
weights are in the cache already (workers.weights.shared). A forked copy inherits them, copy on
write, and `held(path)` hands it the one built from its own shared directory.

Only the fork server reads `HOLD_ENV`, at its start; every other process (a worker started by
hand, on Ray, or before the server) holds nothing and builds its tokenizer as it always did. A
tokenizer that fails to build here is left out: the copy then builds it itself and reports the
error where a load error belongs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

HOLD_ENV = "MMFUSION_HOLD_TOKENIZERS"
log = logging.getLogger("mmfusion.tokenizers")


def build(sources: list[str]) -> dict[str, object]:
    """Tokenizer by shared directory, for each source whose shared weights are in the cache."""
    from transformers import AutoTokenizer

    from workers.files import cache_root
    from workers.weights.sources import source_key

    built: dict[str, object] = {}
    by_files: dict[bytes, object] = {}  # one tokenizer for the dtypes' directories of one source
    for source in sources:
        try:
            dirs = sorted((cache_root() / "shared").glob(f"{source_key(source)}-*"))
        except (OSError, ValueError):  # a source that does not exist: its load will say so
            continue
        for d in dirs:
            if not (d / "tokenizer_config.json").exists():
                continue
            try:
                files = _files_digest(d)
                if files not in by_files:
                    by_files[files] = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
                built[str(d.resolve())] = by_files[files]
            except Exception as exc:  # noqa: BLE001 - the copy builds it itself and reports the error
                log.warning("tokenizer of %s not held: %s", d, exc)
    return built


def _files_digest(d: Path) -> bytes:
    """What a directory's tokenizer is built from: its tokenizer files, by content."""
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(d.iterdir()):
        if f.name.startswith(("tokenizer", "special_tokens", "added_tokens", "chat_template")) or f.suffix == ".model":
            h.update(f.name.encode() + b"\0" + f.read_bytes())
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


# built once, at import, in the fork server only (the only process started with HOLD_ENV set);
# read-only afterwards
_HELD = _from_env()


def held(path_dir: Path):
    """The tokenizer this process was forked holding for shared directory `path_dir`, or None."""
    return _HELD.get(str(Path(path_dir).resolve()))


def held_count() -> int:
    """For how many shared directories this process holds a tokenizer (for tests)."""
    return len(_HELD)
