"""Copies of a model on one CPU share one set of weight-only quantized linears: the first copy to
build them (a GGUF file's own blocks, or weights quantized afresh, fused as the lean forward runs
them) writes them to `$MMFUSION_CACHE/quantized/<key>-<dtype>-<kind>.safetensors`, renamed into
place only when complete; every copy then maps that file read-only (workers.weights.shared's
mapping). The page cache holds the blocks once, a copy that starts later skips building them, and
the file lives on in the cache beside the shared weights, keyed by the source's size and time.

On a CPU with AMX tiles, the same linears' values packed in bfloat16 for the tiles (the layout
oneDNN's micro-kernel reads on this machine and torch) go to a file beside it, keyed also by the
machine, and are shared the same way (`shared_packed`); on one that computes in bfloat16 without
them, their values widened to float32 (the row kernels' `float32` way) do.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from workers.capability import machine_tag
from workers.files import atomic_replace, cache_root, one_at_a_time
from workers.quant.weight import QuantizedWeight, from_tensors, to_tensors
from workers.weights.cache_prune import adopt, recorded
from workers.weights.shared import map_tensors
from workers.weights.sources import source_key

log = logging.getLogger("mmfusion.quantized_cache")
FORMAT = "mmfusion-quantized-2"  # bump when the layout or a quantization rule changes
# the values as a many-rows way of workers.engine.cpu.row_kernels reads them: packed for the AMX
# tiles (kernels/amx_linear.cpp), or widened to float32
LAYOUTS = {"packed": ("tiles", "mmfusion-tiles-3"), "float32": ("float32", "mmfusion-float32-1")}


def cache_path(source: str, dtype: torch.dtype, kind: str) -> Path:
    return cache_root() / "quantized" / f"{source_key(source)}-{str(dtype).removeprefix('torch.')}-{kind}.safetensors"


def _write(path: Path, weights: dict[str, QuantizedWeight]) -> None:
    from safetensors.torch import save_file

    tensors, kinds = to_tensors(weights)
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    atomic_replace(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": FORMAT,
                                                                             "kinds": json.dumps(kinds)}))


def _read(path: Path) -> dict[str, QuantizedWeight]:
    tensors, meta = map_tensors(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return from_tensors(tensors, json.loads(meta["kinds"]))


def shared_quantized(source: str, dtype: torch.dtype, kind: str,
                     build: Callable[[], dict[str, QuantizedWeight]]) -> dict[str, QuantizedWeight]:
    """The quantized linears of (source, dtype, kind) as read-only views of the shared file;
    `build()` makes them when the file does not exist yet (one copy at a time: a file lock)."""
    path = cache_path(source, dtype, kind)
    with one_at_a_time(path):
        if path.exists():
            try:
                weights = _read(path)
                adopt(path, source)
                return weights
            except (ValueError, KeyError, OSError) as exc:
                log.warning("quantized linears %s unusable (%s): writing them again", path, exc)
        _write(path, build())
    recorded(path, source)
    return _read(path)


def packed_path(source: str, dtype: torch.dtype, kind: str, way: str = "packed") -> Path:
    machine = hashlib.sha1(machine_tag().encode()).hexdigest()[:12]
    return cache_path(source, dtype, kind).with_suffix(f".{LAYOUTS[way][0]}-{machine}.safetensors")


def shared_packed(source: str, dtype: torch.dtype, kind: str, keys: list[str],
                  build: Callable[[], dict[str, torch.Tensor]], way: str = "packed") -> dict[str, torch.Tensor]:
    """The quantized linears of (source, dtype, kind) laid out for the many-rows `way` (LAYOUTS:
    packed in bfloat16 pairs for AMX tiles or vdpbf16ps, or widened to float32), by key, as read-only views of a file shared by the
    copies on this machine; `build()` lays them out (all of `keys`) when the file does not hold them yet."""
    from safetensors.torch import save_file

    fmt = LAYOUTS[way][1]
    path = packed_path(source, dtype, kind, way)
    with one_at_a_time(path):
        if path.exists():
            try:
                tensors, meta = map_tensors(path)
                if meta.get("format") == fmt and set(keys) <= set(tensors):
                    adopt(path, source)
                    return {key: tensors[key] for key in keys}
            except (ValueError, KeyError, OSError) as exc:
                log.warning("packed linears %s unusable (%s): writing them again", path, exc)
        packed = {key: t.contiguous() for key, t in build().items()}
        atomic_replace(path, lambda tmp: save_file(packed, str(tmp), metadata={"format": fmt}))
    recorded(path, source)
    tensors, _ = map_tensors(path)
    return {key: tensors[key] for key in keys}
