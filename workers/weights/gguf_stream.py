"""A GGUF file's weights written straight into a shared weights directory, a tensor at a time.

transformers' GGUF path dequantizes every tensor to float32 and keeps them all, then builds the
model on them and copies them in: for Gemma 3 270M (a 0.5 GB float16 copy) about 3 GB at the peak
and 15 s, which a first load pays inside its worker, beyond the memory budget. This writes the same
values with a tensor in memory at a time:
- the config and tokenizer come from transformers (the GGUF's metadata parsed once);
- the model is laid out on `meta`, which gives each tensor's name, shape and dtype, and which
  names are tied (stored once, as `workers.weights.shared.publish` does);
- each of the file's tensors goes through transformers' own per-tensor steps (its
  TensorProcessor: Llama's q/k row order, Gemma's norm offsets; its GGUF-to-model name map), is
  cast as transformers casts it (to the load dtype, then to the parameter's) and is written at its
  place in the safetensors file. The embedding and LM head, the big ones, go a slab of rows at a
  time where the processor leaves their rows alone.

A file whose tensors do not cover the model exactly raises `NotStreamable`, and the caller loads it
through transformers instead.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from workers.weights.hf_loader import gguf_parsed_once
from workers.weights.shared import DTYPE_NAMES, WEIGHTS_FILE, file_metadata

SLAB_BYTES = 64 << 20  # float32 bytes of rows dequantized at once for the big row-wise tensors
ROW_WISE = ("token_embd.weight", "output.weight")  # tensors whose rows no processor below mixes


class NotStreamable(ValueError):
    """This file's tensors do not map one to one onto the model's; the message says which."""


def gguf_writer(source: str, dtype: torch.dtype, use_cache: bool = True) -> Callable[[Path], object] | None:
    """What writes `source`'s shared directory tensor by tensor (write_gguf_shared), where the
    source is a GGUF file; None where transformers' load is the way (not GGUF, its converted
    float32 cache exists, or gguf/accelerate is missing, which that load names)."""
    from workers.weights.sources import gguf_cache_dir, source_gguf

    path = source_gguf(source)
    if path is None or (use_cache and gguf_cache_dir(path) is not None):
        return None
    if any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate")):
        return None
    return lambda dest: write_gguf_shared(path, dtype, dest)


def write_gguf_shared(gguf_path: Path, dtype: torch.dtype, dest: Path):
    """Write `gguf_path`'s model in `dtype` into the (empty) directory `dest`: the weights file, the
    config, the generation config and the tokenizer. Returns the tokenizer."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    parent, name = str(gguf_path.parent), gguf_path.name
    with gguf_parsed_once():
        config = AutoConfig.from_pretrained(parent, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(parent, gguf_file=name)
        parsed = hf_gguf.load_gguf_checkpoint(str(gguf_path), return_tensors=False)
        reader = gguf.GGUFReader(str(gguf_path))
        architecture = hf_gguf.read_field(reader, "general.architecture")[0]
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.tie_weights()  # as from_pretrained does once the weights are in: tied names share one tensor
        processor_class = hf_gguf.TENSOR_PROCESSORS.get(architecture, hf_gguf.TensorProcessor)
        processor = processor_class(config=parsed["config"])
        names = hf_gguf.get_gguf_hf_weights_map(model, processor)  # its name map built once, not per module

    owners, aliases = _unique(model)
    layout, data_start, header = _layout(owners, type(model).__name__, aliases)
    path = dest / WEIGHTS_FILE
    written: set[str] = set()
    parsed["tensors"] = {}  # where a processor may leave a tensor of its own (GPT-2's LM head)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(data_start + sum(b - a for a, b in layout.values()))

        def put(hf_name: str, values: torch.Tensor, row: int | None = None, cast: bool = True) -> None:
            """Write `values` as `hf_name` (`row`: the rows from there on, of a tensor written in slabs)."""
            hf_name = aliases.get(hf_name, hf_name)
            if hf_name not in owners:
                raise NotStreamable(f"the GGUF tensor for {hf_name!r} has no place in {type(model).__name__}")
            target = owners[hf_name]
            t = (values.to(dtype) if cast else values).to(target.dtype)
            fits = (tuple(t.shape) == tuple(target.shape) if row is None else
                    t.dim() == target.dim() > 0 and t.shape[1:] == target.shape[1:] and row + len(t) <= len(target))
            if not fits:
                raise NotStreamable(f"{hf_name}: the GGUF file gives {tuple(t.shape)}"
                                    f"{'' if row is None else f' at row {row}'}, the model wants {tuple(target.shape)}")
            offset = 0 if row is None else row * target[0].numel() * target.element_size()
            f.seek(data_start + layout[hf_name][0] + offset)
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)  # 0-d too
            if row is None or row + len(t) == len(target):
                written.add(hf_name)

        row_wise = processor_class in (hf_gguf.TensorProcessor, hf_gguf.LlamaTensorProcessor,
                                       hf_gguf.Gemma2TensorProcessor)
        for tensor in reader.tensors:
            if row_wise and tensor.name in ROW_WISE and tensor.name in names:
                _slabs(tensor, put, names[tensor.name])
                continue
            values = gguf.dequantize(tensor.data, tensor.tensor_type)
            result = processor.process(weights=values, name=tensor.name, tensor_key_mapping=names,
                                       parsed_parameters=parsed)
            for hf_name, t in parsed["tensors"].items():
                put(hf_name, t)
            parsed["tensors"].clear()
            if result.name in names:
                put(names[result.name], _tensor(result.weights))
        for hf_name, t in owners.items():
            if hf_name not in written and not t.is_meta:  # a persistent buffer the model computes
                put(hf_name, t, cast=False)
    missing = sorted(set(owners) - written)
    if missing:
        raise NotStreamable(f"the GGUF file has no tensor for {len(missing)} of the model's, such as {missing[:3]}")
    config.save_pretrained(str(dest))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    return tokenizer


def _tensor(values: np.ndarray) -> torch.Tensor:
    """A read-only view of dequantized values (only read: cast, then written out)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(values))


def _unique(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict's tensors by name, each object once, and the names tied to another (by
    object: shared.unique_tensors tells ties by storage, which tensors on `meta` do not have)."""
    owners: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for hf_name, t in model.state_dict(keep_vars=True).items():
        if id(t) in first:
            aliases[hf_name] = first[id(t)]
        else:
            first[id(t)] = hf_name
            owners[hf_name] = t
    return owners, aliases


def _layout(owners: dict[str, torch.Tensor], cls: str, aliases: dict[str, str]):
    """({name: (start, end)} in the data, where the data starts, the header's bytes). Widest elements
    first, so that every tensor starts aligned to its element size."""
    order = sorted(owners, key=lambda n: (-owners[n].element_size(), n))
    table: dict = {"__metadata__": file_metadata(cls, aliases)}
    layout, at = {}, 0
    for n in order:
        t = owners[n]
        size = t.numel() * t.element_size()
        layout[n] = (at, at + size)
        table[n] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + size]}
        at += size
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    header = len(raw).to_bytes(8, "little") + raw
    return layout, len(header), header


def _slabs(tensor, put, hf_name: str) -> None:
    """Dequantize a row-wise tensor a slab of rows at a time (its rows are the file's first axis)."""
    import gguf

    rows = tensor.data.shape[0]
    cols = int(np.prod(tensor.shape)) // rows
    step = max(1, SLAB_BYTES // (4 * cols))
    for r in range(0, rows, step):
        values = gguf.dequantize(tensor.data[r:r + step], tensor.tensor_type)
        put(hf_name, _tensor(values).reshape(-1, cols), row=r)
