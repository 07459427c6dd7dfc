"""Copies of a model on one CPU hold one set of weights: a read-only file mapping they all share.

The first copy to load a (model source, dtype) writes its weights, exactly as loaded and already in
the serving dtype, to `$MMFUSION_CACHE/shared/<key>-<dtype>/` (safetensors, with the model's
config, generation config and tokenizer beside them), renamed into place only when complete.
Every copy then builds the model on the `meta` device and binds each parameter and buffer to a
view of that file mapped read-only: the page cache holds the bytes once, however many processes
map them, and a copy that tried to write its weights would fault instead of corrupting the others.

What would quietly turn the views into private copies is kept out: the file is written in the
serving dtype (no cast), tensors are bound as views (no `.contiguous()`), and tied weights (an
embedding shared with the LM head) are stored once and bound to one Parameter.

The file lives on in the cache like the GGUF conversion does, so a restarted copy (or the next
run) attaches without loading; its pages are ordinary page cache, which the kernel reclaims once
no process maps them. Nothing goes to /dev/shm, so nothing is left there after any exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import json
import logging
import mmap
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.files import atomic_replace, one_at_a_time
from workers.weights.cache_prune import adopt, recorded
from workers.weights.held_tokenizers import from_directory
from workers.weights.sources import shared_path

log = logging.getLogger("mmfusion.shared_weights")
WEIGHTS_FILE = "model.safetensors"
FORMAT = "mmfusion-shared-1"  # bump when the layout changes: older directories are then rebuilt
ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}
DTYPE_NAMES = {v: k for k, v in ST_DTYPES.items()}


class SharedWeightsError(RuntimeError):
    """The shared file does not fit the model (stale, or written by another version)."""


@dataclass(slots=True)
class WeightsInfo:
    """What status shows per worker: how many bytes of weights, and whether they are shared."""

    bytes: int
    shared: bool
    path: str | None = None

    def as_dict(self) -> dict:
        return {"bytes": self.bytes, "shared": self.shared, "path": self.path}


def shared_dir(source: str, dtype: torch.dtype) -> Path:
    return shared_path(source, str(dtype).removeprefix("torch."))


# --- writing ---------------------------------------------------------------------------------------------

def unique_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict with each storage once; aliases (tied weights) name the tensor they share."""
    tensors, aliases, seen = {}, {}, {}
    for name, t in model.state_dict(keep_vars=False).items():
        if t.is_meta:  # no storage to share (workers.weights.blocks_only): nobody's alias
            tensors[name] = t.detach()
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = t.detach()
    return tensors, aliases


def file_metadata(cls: str, aliases: dict[str, str]) -> dict[str, str]:
    """A shared weights file's own metadata: its layout's version, the model class, the tied names."""
    return {"format": FORMAT, "class": cls, "aliases": json.dumps(aliases)}


def publish(model: torch.nn.Module, tokenizer, dest: Path) -> None:
    """Write model + tokenizer to `dest` through a temporary directory renamed into place."""
    from safetensors.torch import save_file

    tensors, aliases = unique_tensors(model)
    tensors = {k: t.to("cpu").contiguous() for k, t in tensors.items()}

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata=file_metadata(type(model).__name__, aliases))
        model.config.save_pretrained(str(tmp))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))

    atomic_replace(dest, fill, is_dir=True)


# --- mapping -----------------------------------------------------------------------------------------------

def read_header(path: Path) -> tuple[dict, dict, int]:
    """(tensor table, metadata, data start) of a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {}) or {}
    return header, meta, 8 + n


def map_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of the file as a read-only view of one shared mapping (no copy). The mapping
    holds a shared lock on the file for as long as it lives: the mmap object keeps a duplicate of
    the descriptor locked here, closed once no view is left, so the cache's pruning
    (workers.weights.cache_prune) never removes a file some process maps."""
    header, meta, start = read_header(path)
    with open(path, "rb") as f:
        with contextlib.suppress(OSError):  # a file system without locks: nothing is pruned under it then
            fcntl.flock(f, fcntl.LOCK_SH)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    out = {}
    with warnings.catch_warnings():  # "non-writable buffer": read-only is the point
        warnings.simplefilter("ignore", UserWarning)
        for name, info in header.items():
            dtype = ST_DTYPES[info["dtype"]]
            a, b = info["data_offsets"]
            numel = (b - a) // dtype.itemsize
            t = torch.frombuffer(mm, dtype=dtype, count=numel, offset=start + a) if numel else torch.empty(0, dtype=dtype)
            out[name] = t.view(info["shape"])
    return out, meta


def bind(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make `tensor` (a view of shared memory) the model's parameter or buffer `name`, as is."""
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if attr in mod._parameters:
        old = mod._parameters[attr]
        if old is not None and (tuple(old.shape) != tuple(tensor.shape) or old.dtype != tensor.dtype):
            raise SharedWeightsError(f"{name}: shared {tuple(tensor.shape)} {tensor.dtype}, model wants "
                                     f"{tuple(old.shape)} {old.dtype}")
        mod._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
    elif attr in mod._buffers:
        mod._buffers[attr] = tensor
    else:
        raise SharedWeightsError(f"{name}: the model has no such parameter or buffer")


def bind_aliases(model: torch.nn.Module, aliases: dict[str, str]) -> None:
    """Tied names get the very object their target has (one Parameter: tied stays tied)."""
    for name, target in aliases.items():
        mod_name, _, attr = target.rpartition(".")
        src = model.get_submodule(mod_name) if mod_name else model
        value = src._parameters.get(attr, src._buffers.get(attr))
        a_mod, _, a_attr = name.rpartition(".")
        dst = model.get_submodule(a_mod) if a_mod else model
        (dst._parameters if a_attr in dst._parameters else dst._buffers)[a_attr] = value


def attach(model: torch.nn.Module, path: Path, copy: bool = False) -> int:
    """Bind every parameter and persistent buffer of `model` to the mapped file (`copy`: to a copy
    of it in this process's own memory); returns its bytes. Fails (SharedWeightsError) unless the
    file covers the model exactly."""
    tensors, meta = map_tensors(path)
    if meta.get("format") != FORMAT:
        raise SharedWeightsError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    aliases = json.loads(meta.get("aliases", "{}"))
    wanted = set(model.state_dict(keep_vars=True))
    have = set(tensors) | set(aliases)
    if wanted != have:
        missing, extra = sorted(wanted - have), sorted(have - wanted)
        raise SharedWeightsError(f"{path} does not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    if copy:
        tensors = {name: t.clone() for name, t in tensors.items()}
    return bind_all(model, tensors, aliases, path)


def bind_all(model: torch.nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str], where,
             unbound: frozenset[str] = frozenset()) -> int:
    """Bind every shared tensor and tied alias; fail if a parameter is left on `meta`, but for those
    named in `unbound` (weights nobody holds: workers.weights.blocks_only). Returns the bytes bound."""
    for name, t in tensors.items():
        bind(model, name, t)
    bind_aliases(model, aliases)
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta and name not in unbound:
            raise SharedWeightsError(f"{where}: parameter {name} was left unbound")
    return sum(t.numel() * t.element_size() for t in tensors.values())


def drop_pages(tensors: list[torch.Tensor]) -> int:
    """Let this process's view of mapped weights it will not read again go (madvise DONTNEED on the
    pages wholly inside them): the pages stay in the page cache for the other copies and come back
    on a read, but no longer count in this process's resident memory. Returns the bytes let go."""
    page = mmap.PAGESIZE
    try:
        madvise = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    except OSError:
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for t in tensors:
        start = -(-t.data_ptr() // page) * page
        end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
        if end > start and madvise(start, end - start, 4) == 0:  # 4: MADV_DONTNEED
            dropped += end - start
    return dropped


def release_heap() -> None:
    """Give the memory of a whole load back to the OS: transformers' loading leaves cycles that
    hold its float32 arrays until a collection (about 0.7 GB for Gemma 3 270M), and glibc keeps
    freed blocks otherwise."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def build_meta(path_dir: Path, dtype: torch.dtype, tokenizer=None):
    """(model on `meta`, tokenizer) from a shared directory: nothing allocated for the weights.
    `tokenizer`: the one the directory was just written with (read again otherwise)."""
    import transformers
    from accelerate import init_empty_weights
    from transformers import AutoConfig, GenerationConfig

    _, meta, _ = read_header(path_dir / WEIGHTS_FILE)
    cls = getattr(transformers, meta.get("class", ""), None)
    if cls is None:
        raise SharedWeightsError(f"{path_dir}: unknown model class {meta.get('class')!r}")
    config = AutoConfig.from_pretrained(str(path_dir), local_files_only=True)
    with init_empty_weights(include_buffers=False):  # buffers (rotary tables) are computed as usual
        model = cls._from_config(config, dtype=dtype)
    if (path_dir / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(str(path_dir), local_files_only=True)
    tok = tokenizer or from_directory(path_dir)
    return model, tok


def build_attached(path_dir: Path, dtype: torch.dtype, tokenizer=None, copy: bool = False):
    """(model, tokenizer, weight bytes) from a shared directory, bound to its mapped file (`copy`:
    to a copy of it of this process's own)."""
    model, tok = build_meta(path_dir, dtype, tokenizer)
    nbytes = attach(model, path_dir / WEIGHTS_FILE, copy)
    return model.eval(), tok, nbytes


def load_shared(source: str, dtype: torch.dtype, load_private, write=None):
    """(model, tokenizer, WeightsInfo) for a CPU copy that shares its weights.

    When no shared file exists yet, one copy at a time (a file lock, so that several copies
    starting together write it once) writes it: `write(directory)` where given (it fills the
    directory and returns the tokenizer, or raises ValueError, KeyError or NotImplementedError
    when it cannot), else from `load_private()`, which loads the model the usual way."""
    return _load(source, dtype, load_private, write, copy=False)


def load_copied(source: str, dtype: torch.dtype, load_private, write=None):
    """(model, tokenizer, WeightsInfo) with weights of this process's own, copied from the shared
    file (written first where there is none, as load_shared writes it). A private copy of a GGUF
    source so costs a read of the file instead of transformers' whole load (seconds, and its
    float32 arrays) every time."""
    return _load(source, dtype, load_private, write, copy=True)


def _load(source: str, dtype: torch.dtype, load_private, write, copy: bool):
    dest = shared_dir(source, dtype)
    tok = None
    with one_at_a_time(dest):
        if (dest / WEIGHTS_FILE).exists():
            try:
                model, tok, nbytes = build_attached(dest, dtype, copy=copy)
                adopt(dest, source)
                return model, tok, _info(nbytes, copy, dest)
            except (SharedWeightsError, OSError, ValueError) as exc:
                log.warning("shared weights %s unusable (%s): writing them again", dest, exc)
                tok = None
        if write is not None:
            made = []
            try:
                atomic_replace(dest, lambda tmp: made.append(write(tmp)), is_dir=True)
                tok = made[0]
            except (ValueError, KeyError, NotImplementedError) as exc:  # a layout it does not know
                log.warning("writing %s tensor by tensor failed (%s): loading it whole", dest, exc)
                tok = None
        private = None
        if tok is None:
            model, tok = load_private()
            publish(model, tok, dest)
            if copy:  # the whole load is a copy of this process's own already
                private = model
            del model
    recorded(dest, source)  # outside the entry's lock: pruning takes the locks of others
    release_heap()
    if private is not None:
        return private, tok, private_info(private)
    model, tok, nbytes = build_attached(dest, dtype, tok, copy)
    return model, tok, _info(nbytes, copy, dest)


def _info(nbytes: int, copy: bool, dest: Path) -> WeightsInfo:
    return WeightsInfo(nbytes, False) if copy else WeightsInfo(nbytes, True, str(dest / WEIGHTS_FILE))


def private_info(model: torch.nn.Module) -> WeightsInfo:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return WeightsInfo(total, False)
