"""The model loader: turn a source string into an engine-ready model, offline, with its weights
private, shared through a read-only mapping (CPU), or attached from the device's owner (CUDA).
What a source can be is in workers.weights.sources."""

from __future__ import annotations

import os

import torch

from workers.devices import device_kind
from workers.engine import Engine, EngineConfig
from workers.platform import load_dtype
from workers.weights import shared as shared_weights
from workers.weights.gguf_stream import gguf_writer
from workers.weights.hf_loader import load_private
from workers.weights.loaded_model import LoadedModel
from workers.weights.owner import attach_remote
from workers.weights.owner_ipc import KEY_ENV
from workers.weights.sources import context_len, source_gguf


def load_model(source: str, dtype: str | torch.dtype = "auto", device: str = "cpu",
               max_model_len: int | None = None, use_cache: bool = True, share_weights: bool = False,
               owner: str | None = None, prepack: bool = True, one_engine: bool = False) -> LoadedModel:
    """Load `source` with its tokenizer; never touches the network.

    A GGUF source loads from its safetensors cache when one exists and `use_cache` is true. With
    `share_weights` on CPU, the weights are a read-only mapping that every copy of this (source,
    dtype) shares (workers.weights.shared); on CUDA they are the device's owner process's memory,
    reached through CUDA IPC at `owner` (workers.weights.owner). `prepack`: the engine will run
    the lean forward where it applies (prepack_weights), which decides `auto`'s dtype on a CPU
    without bf16 arithmetic (workers.precision). `one_engine`: only one engine will run it, which may
    then let go of the weights it does not read (LoadedModel.one_engine)."""
    dev = torch.device(device)
    if not isinstance(source, str) or not source:
        raise ValueError(f"model source must be a non-empty string, got {source!r}")
    dt = load_dtype(dtype, dev, prepack, source)
    link = quantized = None
    if share_weights and owner:  # CUDA: attach to the weights the device's owner process holds
        got = attach_remote(owner, os.environ.get(KEY_ENV, "").encode())
        model, tok, weights, link, quantized = got.model, got.tokenizer, got.info, got.link, got.quantized
    elif share_weights and not device_kind(dev).owner_shares_weights:  # one read-only mapping, on the host
        model, tok, weights = shared_weights.load_shared(source, dt, lambda: load_private(source, dt, use_cache),
                                                         gguf_writer(source, dt, use_cache))
    else:  # own weights: sharing off, or a device with no owner (a worker started by hand)
        writer = gguf_writer(source, dt, use_cache) if use_cache else None
        if writer is not None:  # a GGUF file: copied from the shared file, written a tensor at a time
            model, tok, _ = shared_weights.load_copied(source, dt, lambda: load_private(source, dt, use_cache), writer)
        else:
            model, tok = load_private(source, dt, use_cache)
            if source_gguf(source) is not None:  # transformers' GGUF load leaves its float32 arrays in cycles
                shared_weights.release_heap()
        model.to(dev)
        weights = shared_weights.private_info(model)
    ctx = context_len(model.config, source, max_model_len)
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    if eos is None:
        eos = tok.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return LoadedModel(model=model, tokenizer=tok, source=source, dtype=dt, device=dev,
                       max_model_len=ctx, eos_token_ids=eos_ids, weights=weights, owner_link=link,
                       quantized=quantized, one_engine=one_engine)


def load_engine(source: str, dtype: str | torch.dtype = "auto", device: str = "cpu",
                max_model_len: int | None = None, share_weights: bool = False, **config) -> Engine:
    """An engine on `source`: load_model's arguments, then EngineConfig's (max_batch_size, ...)."""
    cfg = EngineConfig(**config)
    return Engine(load_model(source, dtype=dtype, device=device, max_model_len=max_model_len,
                             share_weights=share_weights, prepack=cfg.prepack_weights, one_engine=True), cfg)
