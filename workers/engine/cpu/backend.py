"""The CPU's kernel chooser: the attention kernels a CPU runner runs, decided once at load from
what the C++ extension built here has (workers.engine.cpu.extension) for the model's compute dtype
and head size. The linears' kernels follow the platform's precision (workers.engine.cpu.linears)."""

from __future__ import annotations

import torch

from workers.engine.attention_backend import TORCH, AttentionBackend
from workers.engine.cpu import extension

CPU_KERNELS = "cpu"  # the backend's name while the C++ kernels serve


def attention_kernels(compute: torch.dtype, head_dim: int) -> AttentionBackend:
    """The C++ kernels for a model computing in `compute` with heads of `head_dim`; the PyTorch
    paths where they could not be built."""
    decode = extension.decode_kernel()
    if decode is None:
        return TORCH
    prefill = extension.prefill_kernel(compute, head_dim)
    return AttentionBackend(CPU_KERNELS, decode, prefill, own_positions_only=prefill is not None)
