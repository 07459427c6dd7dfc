"""The attention kernels a runner uses, chosen once at load by its device's room into one object
(the CPU's: workers.engine.cpu.backend), and the step metadata they read, which the backend builds.

A backend is its decode kernel, its prefill kernel (or none: the PyTorch paths of
workers.engine.attention serve), and `metadata`: each step's block tables, write slots and
segments as its kernels want them, on the runner's device. The runner hands that StepContext to
attention as an argument. A device's own paged kernels are one more backend here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.engine import attention
from workers.engine.block_manager import first_block

if TYPE_CHECKING:
    from workers.engine.block_manager import SeqBlocks
    from workers.engine.scheduler import Chunk
    from workers.engine.sequence import Sequence


@dataclass(slots=True, frozen=True)
class TokenRow:
    """One token attended as a decode row is: its sequence's blocks, at position `num_computed`
    (the field a decode Sequence has), so that `metadata` takes it where it takes a Sequence."""

    blocks: SeqBlocks
    num_computed: int


def token_rows(decode: list[Sequence], chunks: list[Chunk]) -> list[TokenRow]:
    """A step's every token as a decode row, in the step's order (decode rows, then each chunk's
    tokens): with `deterministic`, every token's attention runs the decode kernel, whose order over
    a row's context depends on that row alone: not on the rows beside it, where its chunk starts,
    or whether the keys before it were computed in this step or came from the prefix cache."""
    rows = [TokenRow(s.blocks, s.num_computed) for s in decode]
    for c in chunks:
        rows.extend(TokenRow(c.seq.blocks, p) for p in range(c.start, c.start + c.length))
    return rows


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
    # (a chunk's tokens, the keys it sees) -> whether the library's attention (PyTorch's SDPA over
    # the chunk's keys gathered from their blocks, attention._segment_attention) serves that chunk
    # instead of `prefill`, as measured on the machine (the CPU's: workers.engine.cpu.prefill_route);
    # None: `prefill` serves every chunk
    library_prefill: Callable[[int, int], bool] | None = None

    def metadata(self, holder: attention.ContextHolder, decode: list[Sequence], chunks: list[Chunk],
                 positions: list[int], block_size: int, device: torch.device, unzeroed: bool) -> attention.StepContext:
        """The step's layout for attention: decode rows first, then the chunks' tokens at `positions`."""
        groups = _group_steps(holder.windows, decode, chunks, positions, block_size, device)
        if chunks and self.prefill is not None:
            _prefill_tables(holder.windows, groups, chunks, len(decode), block_size, self.library_prefill)
        return attention.StepContext(num_decode=len(decode), num_tokens=len(positions), groups=groups,
                                     segments=_segments(holder.windows, chunks, len(decode), block_size),
                                     position=holder.position, windows=holder.windows, backend=self,
                                     unzeroed=unzeroed)

    def empty(self, holder: attention.ContextHolder, device: torch.device) -> attention.StepContext:
        """A step of no real tokens (a compiled bucket's warm-up: attention writes and reads nothing)."""
        none = torch.zeros(0, dtype=torch.long, device=device)
        return attention.StepContext(num_decode=0, num_tokens=0,
                                     groups=[attention.GroupStep(none, none) for _ in holder.windows], segments=[],
                                     position=holder.position, windows=holder.windows, backend=self)


# the PyTorch paths of workers.engine.attention: every device's fallback, and the CUDA runner's for
# transformers' modules; a device's own kernels are its room's backend (workers.engine.cpu.backend)
TORCH = AttentionBackend("torch", attention.decode_attention)


def _group_steps(windows: list, decode: list[Sequence], chunks: list[Chunk], pos: list[int], bs: int,
                 dev: torch.device) -> list[attention.GroupStep]:
    offsets = torch.tensor([p % bs for p in pos], device=dev)
    steps = []
    for g, window in enumerate(windows):
        writes = [s.blocks.tables[g][s.num_computed // bs] for s in decode]
        for c in chunks:
            t = c.seq.blocks.tables[g]
            writes.extend(t[p // bs] for p in range(c.start, c.start + c.length))
        gs = attention.GroupStep(torch.tensor(writes, dtype=torch.long, device=dev), offsets)
        if decode:
            blocks, per_row, spans = [], set(), []
            for s in decode:
                t = s.blocks.tables[g]
                first, last = first_block(window, s.num_computed, bs), s.num_computed // bs
                n = s.num_computed + 1
                lo = max(0, n - window) if window is not None else 0
                spans.append((len(blocks), last + 1 - first, lo - first * bs, n - first * bs))
                per_row.add(last + 1 - first)
                blocks.extend(t[first: last + 1])
            gs.pair_blocks = torch.tensor(blocks, device=dev)
            gs.single = len(blocks) == len(decode)
            gs.per_row = per_row.pop() if len(per_row) == 1 else 0
            gs.spans = spans
        steps.append(gs)
    return steps


def _segments(windows: list, chunks: list[Chunk], first_token: int, bs: int) -> list[attention.Segment]:
    segments, t0 = [], first_token
    for c in chunks:
        seg = attention.Segment(t0, c.length, c.start)
        for g, window in enumerate(windows):
            if c.start == 0:
                seg.blocks.append(None)
                seg.first_pos.append(0)
                continue
            first = first_block(window, c.start, bs)
            seg.blocks.append(c.seq.blocks.tables[g][first: -(-(c.start + c.length) // bs)])
            seg.first_pos.append(first * bs)
        segments.append(seg)
        t0 += c.length
    return segments


def _prefill_tables(windows: list, steps: list[attention.GroupStep], chunks: list[Chunk], first_token: int,
                    bs: int, library: Callable[[int, int], bool] | None = None) -> None:
    """The prefill kernel's view of the chunks (GroupStep.prefill_table), per cache group; the
    chunks `library` takes by their tokens and the keys they see there go to
    GroupStep.library_segments instead."""
    for g, (gs, window) in enumerate(zip(steps, windows)):
        blocks, rows, t0 = [], [], first_token
        for i, c in enumerate(chunks):
            first = first_block(window, c.start, bs)
            if library is not None and library(c.length, c.start + c.length - first * bs):
                gs.library_segments.append(i)
            else:
                rows.append((t0, c.length, c.start, len(blocks), first * bs))
                blocks.extend(c.seq.blocks.tables[g][first: -(-(c.start + c.length) // bs)])
            t0 += c.length
        gs.prefill_blocks = torch.tensor(blocks, dtype=torch.long)
        gs.prefill_table = torch.tensor(rows, dtype=torch.long).view(-1, 5)
