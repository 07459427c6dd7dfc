"""Load a source's model and tokenizer with transformers, into this process's own memory.

A GGUF file is dequantized once and kept as float32 safetensors under the cache
(`write_gguf_cache`); later loads read that instead (seconds instead of a minute).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

import torch

from workers.files import atomic_replace
from workers.weights import tiny
from workers.weights.sources import EMBEDDED, embedded_gguf, gguf_cache_dir, gguf_cache_path


@contextlib.contextmanager
def gguf_parsed_once():
    """Within the block, a GGUF file is parsed once. transformers parses the file's metadata for the
    config, again for the tokenizer and again for the weights, and parsing a large vocabulary
    (Gemma 3's 262k tokens) takes tens of seconds each time; the parsed reader is read-only, so
    every caller can share it."""
    import gguf

    original = gguf.GGUFReader
    readers: dict = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def load_private(source: str, dtype: torch.dtype, use_cache: bool = True):
    """(model, tokenizer) with weights of this process's own, on CPU. A GGUF source loads from its
    converted cache when one exists and `use_cache` is true."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.startswith("tiny:"):
        parts = source.split(":")
        seed = int(parts[2]) if len(parts) > 2 else 0
        return tiny.build_tiny(parts[1], seed=seed, dtype=dtype)
    if source in EMBEDDED:
        path = embedded_gguf(source)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise ValueError(
                f"unknown model source {source!r}: not an embedded model ({', '.join(EMBEDDED)}), "
                "not tiny:<arch>, and no such file or directory; give a Hugging Face directory or "
                "a .gguf file")
    kw = dict(dtype=dtype, local_files_only=True)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} has no config.json: not a Hugging Face model directory")
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    elif path.suffix == ".gguf":
        for mod in ("gguf", "accelerate"):
            if importlib.util.find_spec(mod) is None:
                raise ValueError(f"loading GGUF needs {mod}: pip install {mod}")
        cached = gguf_cache_dir(path) if use_cache else None
        if cached is not None:
            tok = AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(str(cached), **kw)
        else:
            # Dense weights: the packed-GGUF kernels compute in float32 and are slower here.
            from transformers import GgufConfig

            with gguf_parsed_once():
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                model = AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, quantization_config=GgufConfig(dequantize=True), **kw)
    else:
        raise ValueError(f"model source {source!r} is a file but not .gguf")
    return model.eval(), tok


def write_gguf_cache(model, tokenizer, gguf: Path) -> Path:
    """Save a model loaded from `gguf` as float32 safetensors (+ tokenizer) so later loads skip the
    dequantization. float32 keeps the dequantized values exactly, whatever dtype loads it later."""

    def fill(tmp: Path) -> None:
        orig = model.dtype
        model.to(torch.float32)
        try:
            model.save_pretrained(str(tmp), safe_serialization=True)
        finally:
            model.to(orig)
        tokenizer.save_pretrained(str(tmp))

    dest = gguf_cache_path(gguf)
    atomic_replace(dest, fill, is_dir=True)
    return dest
