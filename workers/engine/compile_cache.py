"""Compiled artifacts on disk, under `$MMFUSION_CACHE/compiled/<key>/`.

`compile_only` (and any engine that compiles) saves torch's portable cache artifacts
(`torch.compiler.save_cache_artifacts`: inductor's FX graph and AOTAutograd entries and their
kernels) keyed on the model, dtype, device, bucket set and torch version. A later process loads
them before compiling: dynamo still traces the layer once per bucket, but inductor finds every
graph already built, so a warm start costs seconds. A file that cannot be read or loaded is
reported in one log line and the engine compiles from scratch; it never stops the engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from workers.capability import cpu_capability
from workers.files import atomic_replace, cache_root, inductor_default
from workers.weights.sources import source_key

log = logging.getLogger("mmfusion.compile")

ARTIFACTS = "artifacts.bin"
META = "meta.json"
FORMAT = 3  # bump when what a cache entry holds changes


@dataclass(slots=True, frozen=True)
class CompileKey:
    """What a compiled graph depends on; a change in any field is a different cache entry."""

    source: str
    model: str  # sources.source_key: the source and its files' size and mtime
    dtype: str
    device: str  # device type: graphs are built for a kind of device, not an index
    buckets: str
    torch_version: str
    cpu_isa: str = ""  # workers.capability's level: graphs built for one ISA are not another's
    format: int = FORMAT

    @classmethod
    def for_model(cls, source: str, dtype: torch.dtype, device: torch.device, buckets: str, isa: str) -> CompileKey:
        """`isa`: what else the graphs depend on on this device (Platform.compile_isa)."""
        return cls(source, source_key(source), str(dtype).removeprefix("torch."), torch.device(device).type, buckets,
                   torch.__version__, isa)

    def directory(self) -> Path:
        # Named by what the graphs are for, not by versions: a model file or torch that changed
        # finds the old entry, reports it stale, and compiles over it.
        name = self.model.rsplit("-", 1)[0]
        digest = hashlib.sha256(f"{self.source}|{self.buckets}|{self.cpu_isa}".encode()).hexdigest()[:12]
        return cache_root() / "compiled" / f"{name}-{self.dtype}-{self.device}-{digest}"


def use_cache_dir() -> None:
    """Keep inductor's own on-disk cache under $MMFUSION_CACHE too, in the CPU level's directory,
    unless the user chose one (torch writes its default into the environment once inductor has
    looked, and the workers package names one before, so those two count as not chosen)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) in (os.path.abspath(default_cache_dir()),
                                                       os.path.abspath(inductor_default())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir(cache_root()))
    keep_headers_in(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def keep_headers_in(directory: str) -> None:
    """Inductor's precompiled C++ headers (150 MB; a CPU compile takes 17 s with them, 40 without)
    go to /tmp/torchinductor_<user> whatever its cache directory is: torch fixes that place when it
    imports its code cache. They go beside the rest of its cache instead, so that nothing is left
    in /tmp. Where a torch keeps them elsewhere (no such setting), nothing is changed."""
    from torch._inductor import codecache

    if hasattr(codecache, "_HEADER_DIR") and hasattr(codecache, "_HEADER_LOCK_DIR"):
        headers = os.path.join(directory, "precompiled_headers")
        codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = headers, os.path.join(headers, "locks")


def inductor_dir(root: Path) -> Path:
    """Inductor's cache under `root`, one per CPU level: its entries do not record the ISA that
    torch ran at (ATEN_CPU_CAPABILITY), and graphs from one level gave wrong tokens at another."""
    return root / f"inductor-{cpu_capability().level}"


def has_artifacts(key: CompileKey) -> bool:
    return (key.directory() / ARTIFACTS).is_file()


def load(key: CompileKey) -> bool:
    """Hand the saved artifacts to torch's caches. False (and one log line) when there are none
    usable: missing, unreadable, written for another key, or rejected by torch."""
    d = key.directory()
    path = d / ARTIFACTS
    if not path.is_file():
        return False
    try:
        meta = json.loads((d / META).read_text())
        if meta.get("key") != asdict(key):
            raise ValueError("it is stale: written for another model file, dtype, device, bucket set or torch "
                             f"version ({meta.get('key')} != {asdict(key)})")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            raise ValueError("its checksum does not match (a partial or corrupt write)")
        torch.compiler.load_cache_artifacts(data)
    except Exception as exc:  # any failure here only costs a compile from scratch
        log.warning("compiled cache %s is unusable (%s: %s); compiling again", d, type(exc).__name__, exc)
        return False
    return True


def save(key: CompileKey) -> Path | None:
    """Write everything this process has compiled so far as the entry for `key`. Copies of a
    model compile at the same time and each saves: an entry appears whole and, when two race, one
    of them wins; a failed save only logs."""
    d = key.directory()
    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return None
        data, _info = saved
        meta = {"key": asdict(key), "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}

        def fill(tmp: Path) -> None:
            (tmp / ARTIFACTS).write_bytes(data)
            (tmp / META).write_text(json.dumps(meta, indent=1))

        atomic_replace(d, fill, is_dir=True)
    except OSError as exc:
        log.warning("could not save the compiled cache %s (%s: %s); the next start compiles again",
                    d, type(exc).__name__, exc)
        return None
    return d
