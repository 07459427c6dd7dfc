"""Slot KV cache: one row per running sequence, written in place at each sequence's own positions.

transformers' DynamicCache appends by concatenation (a full copy per step) and forces every
row to the same length. Here each layer owns a buffer [slots, kv_heads, capacity, head_dim];
a step writes its new keys/values at (slot, position) pairs and attention reads views of the
buffer. All layers' keys are one tensor [layers, slots, kv_heads, capacity, head_dim], and so
are the values: the attention op takes them as arguments it declares it mutates. Capacity tracks the longest live sequence in blocks of `block` positions, growing and
shrinking, so that decode attention can read whole rows [:rows] - contiguous memory, which CPU
bf16 matmul kernels need to run fast - without reading much padding.
"""

from __future__ import annotations

import torch

CAPACITY_DIM = 3  # of keys/values: [layers, slots, kv_heads, capacity, head_dim]


class SlotKVCache:
    """Per-layer K/V buffers indexed by (slot, position), written by the attention op (workers.engine.attention)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, max_capacity: int = 2048, block: int = 64,
                 v_head_dim: int | None = None):
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype, self.device = dtype, device
        self.max_capacity = max_capacity
        self.block = block
        self.capacity = min(block, max_capacity)
        self.keys = self._alloc(self.capacity, head_dim)
        self.values = self._alloc(self.capacity, self.v_head_dim)
        # Set by the runner before each forward: where each packed token's K/V goes.
        self.write_slots: torch.Tensor | None = None
        self.write_pos: torch.Tensor | None = None

    def _alloc(self, cap: int, dim: int) -> torch.Tensor:
        # always a normal tensor, even when a step inside inference mode grows the cache: a compiled
        # forward guards on the kind of tensor it was built for, and would recompile on the other
        with torch.inference_mode(False):
            buf = torch.zeros(self.num_layers, self.num_slots, self.num_kv_heads, cap, dim, dtype=self.dtype,
                              device=self.device)
        # its capacity is a dynamic dimension of compiled graphs: a cache that grows does not recompile
        torch._dynamo.mark_dynamic(buf, CAPACITY_DIM)
        return buf

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def fit(self, length: int) -> None:
        """Make positions [0, length) fit, with little slack: grow, or shrink when far too big."""
        if length > self.max_capacity:
            raise ValueError(f"sequence length {length} exceeds the KV cache limit {self.max_capacity}")
        want = min(-(-max(length, 1) // self.block) * self.block, self.max_capacity)
        if want > self.capacity or want + 2 * self.block <= self.capacity:
            self._resize(want)

    def _resize(self, new_cap: int) -> None:
        keep = min(new_cap, self.capacity)
        keys, values = self._alloc(new_cap, self.head_dim), self._alloc(new_cap, self.v_head_dim)
        keys[..., :keep, :] = self.keys[..., :keep, :]
        values[..., :keep, :] = self.values[..., :keep, :]
        self.keys, self.values = keys, values
        self.capacity = new_cap

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Share a computed prefix: copy positions [0, length) of one slot into another."""
        for buf in (self.keys, self.values):
            buf[:, dst_slot, :, :length] = buf[:, src_slot, :, :length]

    def write(self, k_buf: torch.Tensor, v_buf: torch.Tensor, key_states: torch.Tensor,
              value_states: torch.Tensor) -> None:
        """Store this step's keys/values ([1, kv_heads, N, dim] for the N packed tokens) at their
        (slot, position) pairs of one layer's buffers (views of `keys` and `values`)."""
        k_buf[self.write_slots, :, self.write_pos] = key_states[0].transpose(0, 1).to(k_buf.dtype)
        v_buf[self.write_slots, :, self.write_pos] = value_states[0].transpose(0, 1).to(v_buf.dtype)
