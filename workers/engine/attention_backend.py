"""The attention kernels an engine runs, chosen once when it loads (select_attention) into one object, which
attention.attend calls through the model's ContextHolder. A device's own paged kernels (on CUDA,
e.g. FlashInfer's or vLLM's) would be chosen here; until then CUDA runs the PyTorch path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from workers.engine import attention, cpu_kernels


@dataclass(slots=True, frozen=True)
class AttentionBackend:
    name: str
    decode: Callable  # attention.decode_attention's contract
    # every prefill chunk of a step for one layer: (out, query, key cache, value cache, GroupStep,
    # window, scaling) -> whether it wrote out's prefill rows (else the PyTorch path runs); None: none
    prefill: Callable | None = None
    # both kernels read only the positions a row holds, never a whole block under a mask: new
    # blocks need no zeroing while they serve (the PyTorch paths would let stale memory through)
    own_positions_only: bool = False


TORCH = AttentionBackend("torch", attention.decode_attention)


def select_attention(device: torch.device, compute: torch.dtype, head_dim: int) -> AttentionBackend:
    """The kernels for a model computing in `compute` with heads of `head_dim` on `device`."""
    if device.type == "cpu":
        decode = cpu_kernels.decode_kernel()
        if decode is not None:
            prefill = cpu_kernels.prefill_kernel(compute, head_dim)
            return AttentionBackend("cpu", decode, prefill, own_positions_only=prefill is not None)
    return TORCH
