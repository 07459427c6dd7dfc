"""Paged KV cache bookkeeping: which blocks of the pool each sequence holds. Never touches tensors.

The pool has `num_blocks` blocks of `block_size` positions, allocated once (workers.engine.kv_cache).
The model's layers are split into cache groups of one size (vLLM's hybrid allocator): the
full-attention layers, and the sliding-window layers of each window. A block belongs to one group
at a time and stores the K/V of that group's layers. A sequence holds one block table per group:
a full group holds every position; a sliding group only the blocks its window can still see
(earlier entries are NO_BLOCK), so a long Gemma 3 prompt costs its sliding layers a window.

Prefix caching: a block whose positions are all computed is keyed by a digest of every token from
position 0 to its end. A new sequence takes the longest run of cached blocks of its prefix, with
no copy (reference counts). Blocks that no sequence holds stay cached until the pool needs room,
then go least recently freed first.

A CPU pool is allocated without being touched, so its memory becomes resident as blocks are first
used. With `cache_reserve` set, a block is taken from memory already touched first: a free
uncached block, else the least recently freed cached one once more than `cache_reserve` blocks
are cached; a never-used block only after that. The resident pool then stays near what is in use
plus the reserve, instead of growing to the whole budget as freed prefixes pile up.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from math import gcd

NO_BLOCK = -1


def first_block(window: int | None, pos: int, block_size: int) -> int:
    """First block a query at position `pos` (or later) can see under `window` (None: all)."""
    return 0 if window is None else max(0, pos - window + 1) // block_size


@dataclass(slots=True, frozen=True)
class CacheGroups:
    """How a model's layers share the pool: the window of each group (None: full attention) and
    the layers each group stores, as many in every group."""

    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.layers or len({len(g) for g in self.layers}) != 1:
            raise ValueError(f"cache groups must hold one number of layers each, got {self.layers}")
        if len(self.windows) != len(self.layers):
            raise ValueError("cache groups: one window per group")

    @classmethod
    def from_windows(cls, layer_windows: list[int | None]) -> CacheGroups:
        """Group layers by window, in groups of the largest size that divides every window's count."""
        by_window: dict[int | None, list[int]] = {}
        for layer, w in enumerate(layer_windows):
            by_window.setdefault(w, []).append(layer)
        size = 0
        for layers in by_window.values():
            size = gcd(size, len(layers))
        windows, groups = [], []
        for w, layers in by_window.items():
            for i in range(0, len(layers), size):
                windows.append(w)
                groups.append(tuple(layers[i: i + size]))
        return cls(tuple(windows), tuple(groups))

    def as_one(self) -> CacheGroups:
        """Every layer in one group of full attention: each layer keeps the whole context (and may
        attend a window of it)."""
        return CacheGroups.from_windows([None] * sum(len(g) for g in self.layers))

    @property
    def layers_per_group(self) -> int:
        return len(self.layers[0])

    def position_of(self) -> dict[int, tuple[int, int]]:
        """layer -> (group, index of the layer inside its group's storage)."""
        return {layer: (g, i) for g, layers in enumerate(self.layers) for i, layer in enumerate(layers)}


def peak_blocks(groups: CacheGroups, block_size: int, max_chunk: int, length: int) -> int:
    """Most blocks one sequence of `length` tokens holds at once: a sliding group holds its window
    plus the largest chunk computed in one step."""
    n = -(-length // block_size)
    return sum(n if w is None else min(n, -(-(w - 1 + max_chunk) // block_size) + 1) for w in groups.windows)


@dataclass(slots=True)
class BlockStats:
    preemptions: int = 0
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found cached

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass(slots=True)
class SeqBlocks:
    """A sequence's share of the pool: its block table per group, and its prefix digests."""

    tables: list[list[int]]
    digests: list[bytes] = field(default_factory=list)  # of full blocks 0..k-1 of its tokens
    committed: int = 0  # leading full blocks offered to the prefix cache
    trimmed: list[int] = field(default_factory=list)  # per group: entries below are NO_BLOCK

    def held(self) -> int:
        return sum(1 for t in self.tables for b in t if b != NO_BLOCK)


def prefix_digests(sb: SeqBlocks, tokens: list[int], count: int, block_size: int) -> list[bytes]:
    """The chained digests of the first `count` full blocks of `tokens` (kept on the sequence): a
    block's digest covers every token before it, so equal digests mean equal prefixes."""
    while len(sb.digests) < count:
        i = len(sb.digests)
        h = hashlib.blake2b(sb.digests[-1] if sb.digests else b"", digest_size=16)
        h.update(array("q", tokens[i * block_size: (i + 1) * block_size]).tobytes())
        sb.digests.append(h.digest())
    return sb.digests[:count]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, groups: CacheGroups, max_chunk: int,
                 enable_prefix_caching: bool = True, cache_reserve: int | None = None):
        """`cache_reserve`: cached free blocks kept before a never-used block is touched (see the
        module); None keeps every cached block until no never-used block is left."""
        if num_blocks < len(groups.windows):
            raise ValueError(f"the KV cache holds {num_blocks} blocks, fewer than its {len(groups.windows)} cache "
                             "groups need to hold one token: raise kv_cache_memory")
        self.num_blocks, self.block_size, self.groups = num_blocks, block_size, groups
        self.max_chunk = max_chunk
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        # free and uncached, popped from the end: the never-used blocks lie below the freed ones
        self.plain: list[int] = list(range(num_blocks - 1, -1, -1))
        self.untouched = num_blocks  # the never-used blocks: plain[:untouched]
        self.cache_reserve = cache_reserve
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, least recently freed first
        self.key_of: list[tuple[int, bytes] | None] = [None] * num_blocks
        self.cached: list[dict[bytes, int]] = [{} for _ in groups.windows]
        self.stats = BlockStats()
        self.new_blocks: list[int] = []  # allocated since the runner last took them (it zeroes them)
        self._max_tokens: dict[int, int] = {}  # cap -> max_tokens(cap)

    # --- capacity ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.plain) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def peak_blocks(self, length: int) -> int:
        return peak_blocks(self.groups, self.block_size, self.max_chunk, length)

    def max_tokens(self, cap: int) -> int:
        """The longest sequence, of at most `cap` tokens (the model's context), the pool can ever
        hold alone. Sliding-window groups hold only their window: where every group slides, a pool
        of a few windows holds a sequence of any length."""
        if self._max_tokens.get(cap) is None:
            lo, hi = 0, cap
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.peak_blocks(mid) <= self.num_blocks:
                    lo = mid
                else:
                    hi = mid - 1
            self._max_tokens[cap] = lo
        return self._max_tokens[cap]

    def first_needed(self, g: int, start: int) -> int:
        """First block of group g that a query at position `start` (or later) can see."""
        return first_block(self.groups.windows[g], start, self.block_size)

    def blocks_needed(self, sb: SeqBlocks, start: int, end: int) -> int:
        """New blocks for positions [start, end) to be written and attended."""
        last = -(-end // self.block_size)
        return sum(max(0, last - max(len(t), self.first_needed(g, start))) for g, t in enumerate(sb.tables))

    # --- allocation ------------------------------------------------------------------------------
    def new_seq(self) -> SeqBlocks:
        return SeqBlocks([[] for _ in self.groups.windows], trimmed=[0] * len(self.groups.windows))

    def _pop(self) -> int:
        reuse = self.cache_reserve is not None and len(self.evictable) > self.cache_reserve
        if len(self.plain) > self.untouched or (self.plain and not reuse):
            b = self.plain.pop()
            self.untouched = min(self.untouched, len(self.plain))
        else:
            b, _ = self.evictable.popitem(last=False)
            g, digest = self.key_of[b]
            del self.cached[g][digest]
            self.key_of[b] = None
        self.ref[b] = 1
        self.new_blocks.append(b)
        return b

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if self.key_of[b] is not None:
                self.evictable[b] = None
            else:
                self.plain.append(b)

    def allocate(self, sb: SeqBlocks, start: int, end: int) -> bool:
        """Make the tables cover positions [start, end): True, or False (and nothing taken) when
        the pool lacks the blocks."""
        if self.blocks_needed(sb, start, end) > self.num_free:
            return False
        last = -(-end // self.block_size)
        for g, table in enumerate(sb.tables):
            first = self.first_needed(g, start)
            while len(table) < last:
                table.append(self._pop() if len(table) >= first else NO_BLOCK)
        return True

    def free(self, sb: SeqBlocks) -> None:
        for table in sb.tables:
            for b in table:
                if b != NO_BLOCK:
                    self._release(b)
            table.clear()
        sb.committed = 0
        sb.trimmed = [0] * len(sb.tables)

    def trim(self, sb: SeqBlocks, next_pos: int) -> None:
        """Drop the blocks of sliding groups that no query from `next_pos` on can see."""
        for g, table in enumerate(sb.tables):
            if self.groups.windows[g] is None:
                continue
            first = min(self.first_needed(g, next_pos), len(table))
            for j in range(sb.trimmed[g], first):
                if table[j] != NO_BLOCK:
                    self._release(table[j])
                    table[j] = NO_BLOCK
            sb.trimmed[g] = max(sb.trimmed[g], first)

    # --- prefix cache ------------------------------------------------------------------------------
    def commit(self, sb: SeqBlocks, tokens: list[int], num_computed: int) -> None:
        """Offer the sequence's newly completed blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = num_computed // self.block_size
        if full <= sb.committed:
            return
        digests = prefix_digests(sb, tokens, full, self.block_size)
        for g, table in enumerate(sb.tables):
            cache = self.cached[g]
            for j in range(sb.committed, min(full, len(table))):
                b = table[j]
                if b != NO_BLOCK and self.key_of[b] is None and digests[j] not in cache:
                    cache[digests[j]] = b
                    self.key_of[b] = (g, digests[j])
        sb.committed = full

    def match(self, sb: SeqBlocks, tokens: list[int]) -> int:
        """Blocks at the start of `tokens` that every group has cached (leaving one token to
        compute, whose logits are sampled). Takes nothing."""
        if not self.enable_prefix_caching:
            return 0
        limit = (len(tokens) - 1) // self.block_size
        digests = prefix_digests(sb, tokens, limit, self.block_size)
        top = limit
        for g, w in enumerate(self.groups.windows):
            if w is None:
                cache = self.cached[g]
                n = 0
                while n < top and digests[n] in cache:
                    n += 1
                top = n
        for hit in range(top, 0, -1):
            if all(all(digests[j] in self.cached[g] for j in range(self.first_needed(g, hit * self.block_size), hit))
                   for g, w in enumerate(self.groups.windows) if w is not None):
                return hit
        return 0

    def hit_blocks(self, hit: int) -> int:
        """Blocks that taking a prefix of `hit` blocks holds, over all groups."""
        return sum(hit - self.first_needed(g, hit * self.block_size) for g in range(len(self.groups.windows)))

    def evictable_among(self, sb: SeqBlocks, hit: int) -> int:
        """Of the blocks `take(sb, hit)` would take, those that count as free now."""
        n = 0
        for g in range(len(self.groups.windows)):
            for j in range(self.first_needed(g, hit * self.block_size), hit):
                if self.cached[g][sb.digests[j]] in self.evictable:
                    n += 1
        return n

    def take(self, sb: SeqBlocks, hit: int) -> None:
        """Hold the first `hit` cached blocks of the sequence's prefix (after match)."""
        for g, table in enumerate(sb.tables):
            first = self.first_needed(g, hit * self.block_size)
            for j in range(hit):
                if j < first:
                    table.append(NO_BLOCK)
                    continue
                b = self.cached[g][sb.digests[j]]
                if self.ref[b] == 0:
                    del self.evictable[b]
                self.ref[b] += 1
                table.append(b)
            sb.trimmed[g] = first
        sb.committed = hit

    def take_new_blocks(self) -> list[int]:
        out, self.new_blocks = self.new_blocks, []
        return out
