"""The paged KV cache's tensors: one pool of fixed-size blocks, allocated once at load.

Keys are one tensor [layers per group, num_blocks, kv_heads, block_size, head_dim], and so are
values: block b of group g holds positions of one sequence for the layers of g (which block
holds what is workers.engine.block_manager's business). Nothing here is reallocated while the
engine runs, so a long sequence costs its own blocks and never resizes the cache of the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.engine.block_manager import CacheGroups, peak_blocks

if TYPE_CHECKING:
    from workers.platform import Platform


def bytes_per_block(groups: CacheGroups, block_size: int, kv_heads: int, head_dim: int, v_head_dim: int,
                    dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return groups.layers_per_group * kv_heads * block_size * (head_dim + v_head_dim) * itemsize


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """A pool sized from its budget: what the scheduler's block manager counts and the runner allocates."""

    groups: CacheGroups
    num_blocks: int
    block_size: int
    bytes_per_block: int
    prefix_caching: bool  # the runner computes a sequence from cached blocks (the compat runner does not)
    reserve: int | None  # blocks the prefix cache keeps before a never-used one is touched (Platform.cache_reserve)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @classmethod
    def sized(cls, platform: Platform, groups: CacheGroups, dims: tuple[int, int, int], block_size: int,
              budget: int | None, max_batch_size: int, max_batch_tokens: int, max_model_len: int,
              prefix_caching: bool) -> CacheLayout:
        """The pool for `budget` bytes (None: the platform's default budget), in the compute dtype,
        never more blocks than max_batch_size sequences of max_model_len tokens can use."""
        per_block = bytes_per_block(groups, block_size, *dims, platform.precision.compute)
        useful = max_batch_size * peak_blocks(groups, block_size, max_batch_tokens, max_model_len)
        budget = budget or platform.kv_budget(useful * per_block)
        num_blocks = min(useful, budget // per_block)
        reserve = platform.cache_reserve(num_blocks, peak_blocks(groups, block_size, max_batch_tokens,
                                                                 max_batch_tokens))
        return cls(groups, num_blocks, block_size, per_block, prefix_caching, reserve)


class PagedKVCache:
    def __init__(self, layout: CacheLayout, kv_heads: int, head_dim: int, v_head_dim: int, dtype: torch.dtype,
                 device: torch.device, extra_blocks: int = 0):
        """`extra_blocks`: blocks past the layout's, which the scheduler never hands out (a runner's
        dummy block for padded rows)."""
        groups, num_blocks, block_size = layout.groups, layout.num_blocks + extra_blocks, layout.block_size
        self.groups, self.num_blocks, self.block_size = groups, num_blocks, block_size
        self.position = groups.position_of()  # layer -> (group, index in the group's storage)
        shape = (groups.layers_per_group, num_blocks, kv_heads, block_size)
        # never inside inference mode: a compiled forward guards on the kind of tensor it was built
        # for. torch.empty: pages are touched as blocks are first used, and each block is zeroed
        # when it is handed to a sequence (zero_blocks), so stale memory is never attended.
        with torch.inference_mode(False):
            self.keys = torch.empty(*shape, head_dim, dtype=dtype, device=device)
            self.values = torch.empty(*shape, v_head_dim, dtype=dtype, device=device)
        for t in (self.keys, self.values):
            # the number of blocks is a dynamic dimension of compiled graphs: artifacts compiled
            # for one budget serve workers of another without a recompile
            torch._dynamo.maybe_mark_dynamic(t, 1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def zero_blocks(self, blocks: list[int]) -> None:
        if blocks:
            idx = torch.tensor(blocks, device=self.keys.device)
            self.keys.index_fill_(1, idx, 0)
            self.values.index_fill_(1, idx, 0)
