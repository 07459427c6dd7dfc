"""Load a source's model and tokenizer with transformers, into this process's own memory.

A GGUF file is dequantized once and kept as float32 safetensors under the cache
(`write_gguf_cache`); later loads read that instead (seconds instead of a minute).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from workers.files import atomic_replace
from workers.weights import tiny
from workers.weights.held_tokenizers import from_directory
from workers.weights.sources import EMBEDDED, check_source, embedded_gguf, gguf_cache_dir, gguf_cache_path


def fast_gguf_reader_class(values: dict[int, tuple] | None = None):
    """gguf's GGUFReader, parsing metadata arrays in bulk. The stock reader builds a numpy memmap
    view per element (Gemma 3's 262k-token vocabulary: ~800k of them, 12 s); this one slices a
    plain array view of the same mapping and reads string lengths from a memoryview, giving the
    same fields, parts and tensors in under a second. `values`: where to put each array element's
    value as transformers' `_gguf_parse_value` gives it, keyed by id(part) as (part, value)."""
    import gguf
    import numpy as np
    from gguf import GGUFValueType

    class FastGGUFReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

        def _get(self, offset, dtype, count=1, override_order=None):
            count = int(count)
            arr = self._plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs, raw_type):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, n = GGUFValueType(raw_itype[0]), int(alen[0])
            nptype = self.gguf_scalar_to_np.get(itype)
            if n == 0 or (itype != GGUFValueType.STRING and nptype is None):
                return super()._get_field_parts(orig_offs, raw_type)
            offs, parts, types = orig_offs + 12, [raw_itype, alen], [GGUFValueType.ARRAY, itype]
            if itype == GGUFValueType.STRING:
                data, buf = self._plain, memoryview(self._plain)
                for _ in range(n):
                    slen = int.from_bytes(buf[offs:offs + 8], sys.byteorder)  # "I": the host's order
                    parts.append(data[offs:offs + 8].view(np.uint64))
                    parts.append(data[offs + 8:offs + 8 + slen])
                    if values is not None:
                        values[id(parts[-1])] = (parts[-1], bytes(buf[offs + 8:offs + 8 + slen]).decode())
                    offs += 8 + slen
                return offs - orig_offs, parts, list(range(3, 2 + 2 * n, 2)), types
            arr = self._get(offs, nptype, n)
            elements = list(arr.reshape(n, 1))
            if values is not None:  # tolist: Python ints, floats and bools, as int(), float() and bool() give
                values.update((id(p), (p, v)) for p, v in zip(elements, arr.tolist(), strict=True))
            parts += elements
            return offs + int(arr.nbytes) - orig_offs, parts, list(range(2, 2 + n)), types

    return FastGGUFReader


@contextlib.contextmanager
def gguf_parsed_once():
    """Within the block, a GGUF file is parsed once, and fast. transformers parses the file's
    metadata for the config, again for the tokenizer's config and again for the weights, and builds the
    tensor-name map again for every submodule (~20 ms each, hundreds of submodules); the reader,
    the maps and the parsed values (strings and numbers) are read-only, so every caller can share
    them."""
    import functools

    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    parsed: dict[int, tuple] = {}  # id(part) -> (part, its value): the parts live as long as their reader
    original, fast = gguf.GGUFReader, fast_gguf_reader_class(parsed)
    original_map, original_parse = gguf.get_tensor_name_map, hf_gguf._gguf_parse_value
    original_checkpoint = hf_gguf.load_gguf_checkpoint
    readers: dict = {}
    metadata: dict[str, dict] = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = fast(path, mode)
        return readers[key]

    def parse(part, types):
        # one reader per file, so a value's part is the same object for each caller; the reader
        # decoded the arrays' elements in bulk (the vocabulary's 262k strings, scores and types)
        hit = parsed.get(id(part))
        if hit is None or hit[0] is not part:
            hit = parsed[id(part)] = (part, original_parse(part, types))
        return hit[1]

    def checkpoint(path, return_tensors=False, *args, **kwargs):
        # the config is read twice (AutoConfig, and AutoTokenizer for the class): walking the
        # vocabulary's fields element by element takes seconds each time. Callers get their own
        # top-level dicts and share the values, which they do not change.
        if return_tensors:
            return original_checkpoint(path, return_tensors, *args, **kwargs)
        key = os.fspath(path)
        if key not in metadata:
            metadata[key] = original_checkpoint(path, False, *args, **kwargs)
        return {k: dict(v) if isinstance(v, dict) else v for k, v in metadata[key].items()}

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_map)
    hf_gguf._gguf_parse_value = parse
    hf_gguf.load_gguf_checkpoint = checkpoint
    try:
        yield
    finally:
        gguf.GGUFReader = original
        gguf.get_tensor_name_map = original_map
        hf_gguf._gguf_parse_value = original_parse
        hf_gguf.load_gguf_checkpoint = original_checkpoint


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
        check_source(source)
        path = Path(source).expanduser()
    kw = dict(dtype=dtype, local_files_only=True)
    if path.is_dir():  # check_source: one with a config.json, or else a .gguf file
        tok = from_directory(path)
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    else:
        for mod in ("gguf", "accelerate"):
            if importlib.util.find_spec(mod) is None:
                raise ValueError(f"loading GGUF needs {mod}: pip install {mod}")
        cached = gguf_cache_dir(path) if use_cache else None
        if cached is not None:
            tok = from_directory(cached)
            model = AutoModelForCausalLM.from_pretrained(str(cached), **kw)
        else:
            # Dense weights: the packed-GGUF kernels compute in float32 and are slower here.
            from transformers import GgufConfig

            with gguf_parsed_once():
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                model = AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, quantization_config=GgufConfig(dequantize=True), **kw)
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
