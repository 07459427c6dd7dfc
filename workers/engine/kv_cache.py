"""The paged KV cache's tensors: one pool of fixed-size blocks, allocated once at load.

Keys are one tensor [layers per group, num_blocks, kv_heads, block_size, head_dim], and so are
values: block b of group g holds positions of one sequence for the layers of g (which block
holds what is workers.engine.block_manager's business). Nothing here is reallocated while the
engine runs, so a long sequence costs its own blocks and never resizes the cache of the others.
"""

from __future__ import annotations

import torch

from workers.config_keys import KV_AUTO_SHARE
from workers.engine.block_manager import CacheGroups


def default_budget(useful_bytes: int, device: torch.device) -> int:
    """The pool when no kv_cache_memory is given: what the engine's limits can use, up to a share of
    the memory available now (a deployment's plan gives each worker its budget instead)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    return max(1, min(useful_bytes, int(free * KV_AUTO_SHARE)))


def bytes_per_block(groups: CacheGroups, block_size: int, kv_heads: int, head_dim: int, v_head_dim: int,
                    dtype: torch.dtype) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return groups.layers_per_group * kv_heads * block_size * (head_dim + v_head_dim) * itemsize


class PagedKVCache:
    def __init__(self, groups: CacheGroups, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 v_head_dim: int, dtype: torch.dtype, device: torch.device):
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
