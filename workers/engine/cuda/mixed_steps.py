"""The CUDA runner's steps with prompt chunks (a prompt's prefill, and mixed steps: chunks beside
decode rows) as CUDA graphs of the lean forward, one graph a bucket of tokens.

Eagerly, such a step launched every kernel of every layer from Python (hundreds a step, each a
custom op's dispatch), and a workload's prompts made a few dozen of them. As in the decode graphs,
the step's layout goes in as one int64 buffer, copied from a pinned host twin: each token's ID,
position, KV slot, block-table row and attended length, the rows whose logits are kept, and the
block tables. Tokens past the step's pad its bucket: token 0 at position 0 of table row 0, writing
to the dummy block and attending nothing (length 0), so no real row's result changes. The kept
rows are padded with row 0 up to one a sequence. The graph computes the kept rows' logits into a
buffer of its own; the host sampler then reads them as it reads the eager forward's.

A step the buffers cannot hold (more kept rows than sequences, as a prompt's scores need, or more
tokens than the largest bucket) runs eagerly, as before.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from workers.devices import device_kind
from workers.engine.block_manager import NO_BLOCK
from workers.engine.cuda.lean import DeviceStep
from workers.engine.runners.base import chunk_tokens, kept_rows
from workers.engine.scheduler import Chunk
from workers.engine.sequence import Sequence

_FIELDS = ("ids", "positions", "slots", "rows", "lengths")
SMALLEST = 16  # tokens of the smallest bucket


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts with a graph each: powers of two from SMALLEST up to max_tokens, and it."""
    sizes, b = [], SMALLEST
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    return [*sizes, max_tokens]


def step_layout(decode: Seq[Sequence], chunks: Seq[Chunk]) -> tuple[list[int], list[int], list[int], list[int]]:
    """A step's tokens in order, decode rows first: (IDs, positions, block-table rows, the kept
    rows: a decode row's one, each chunk's kept_rows)."""
    ids = [s.token_at(s.num_computed) for s in decode]
    pos = [s.num_computed for s in decode]
    rows = list(range(len(decode)))
    keep = list(range(len(decode)))
    for i, c in enumerate(chunks):
        keep.extend(len(ids) + r for r in kept_rows(c))
        ids.extend(chunk_tokens(c))
        pos.extend(range(c.start, c.start + c.length))
        rows.extend([len(decode) + i] * c.length)
    return ids, pos, rows, keep


def fill_tables(tab: np.ndarray, seqs: Seq[Sequence], dummy: int) -> None:
    """Row r of `tab`: sequence r's blocks, the dummy block past them, in the blocks a window dropped
    (never read) and in the rows past the sequences."""
    tab[:] = dummy
    for r, s in enumerate(seqs):
        t = s.blocks.tables[0]
        tab[r, : len(t)] = t
    real = tab[: len(seqs)]
    real[real == NO_BLOCK] = dummy


class StepBuffers:
    """The graphs' inputs (one int64 buffer, viewed as fields) and their logits, allocated once:
    their addresses never change."""

    def __init__(self, tokens: int, seqs: int, table_width: int, vocab: int, logits_dtype: torch.dtype,
                 device: torch.device):
        self.seqs = seqs  # sequences, and kept rows, a step holds
        size = len(_FIELDS) * tokens + seqs + seqs * table_width
        self.device_inputs = torch.zeros(size, dtype=torch.long, device=device)
        pinned = not device_kind(device).host and torch.cuda.is_available()
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=pinned)
        self.fields = {name: self.device_inputs[i * tokens:(i + 1) * tokens] for i, name in enumerate(_FIELDS)}
        at = len(_FIELDS) * tokens
        self.keep = self.device_inputs[at: at + seqs]
        self.tables = self.device_inputs[at + seqs:].view(seqs, table_width)
        host = self.host.numpy()
        self._host_fields = {name: host[i * tokens:(i + 1) * tokens] for i, name in enumerate(_FIELDS)}
        self._host_keep = host[at: at + seqs]
        self._host_tables = host[at + seqs:].reshape(seqs, table_width)
        self.logits = torch.zeros(seqs, vocab, dtype=logits_dtype, device=device)

    def step(self, n: int) -> DeviceStep:
        f = self.fields
        return DeviceStep(f["ids"][:n], f["positions"][:n], f["slots"][:n], f["rows"][:n], f["lengths"][:n],
                          self.tables)

    def fill(self, decode: Seq[Sequence], chunks: Seq[Chunk], n: int, dummy: int, block_size: int) -> int | None:
        """Lay the step out in the host twin, padded to `n` tokens: the number of kept rows, or None
        where the step does not fit (its tokens past n, its sequences or kept rows past one a row of
        the tables)."""
        seqs = [*decode, *(c.seq for c in chunks)]
        total = len(decode) + sum(c.length for c in chunks)
        if total > n or len(seqs) > self.seqs:
            return None
        ids, pos, rows, keep = step_layout(decode, chunks)
        if len(keep) > self.seqs:
            return None
        tab = self._host_tables
        fill_tables(tab, seqs, dummy)
        f = self._host_fields
        f["ids"][:total] = ids
        f["positions"][:total] = pos
        f["rows"][:total] = rows
        f["slots"][:total] = [int(tab[r, p // block_size]) * block_size + p % block_size for r, p in zip(rows, pos)]
        f["lengths"][:total] = [p + 1 for p in pos]
        for name in ("ids", "positions", "rows", "lengths"):
            f[name][total:n] = 0
        f["slots"][total:n] = dummy * block_size
        self._host_keep[: len(keep)] = keep
        self._host_keep[len(keep):] = 0
        return len(keep)

    def copy_in(self) -> None:
        self.device_inputs.copy_(self.host, non_blocking=True)
