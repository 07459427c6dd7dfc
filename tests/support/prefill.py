"""A step of prompt chunks laid out over a paged cache for the prefill kernels' tests, and their
float64 reference."""

from __future__ import annotations

import random

import torch

# (first position, tokens): whole prompts and later chunks, one of a single token
CHUNKS = [(0, 1), (0, 17), (33, 16), (0, 70), (100, 5), (250, 40)]


def scattered_pool(chunks: list[tuple[int, int]], block: int, seed: int = 0) -> list[int]:
    """Block ids for the chunks' positions, shuffled over a pool with three to spare (pop() takes the
    next): a sequence's blocks lie anywhere in it."""
    free = list(range(sum(-(-(s + c) // block) for s, c in chunks) + 3))
    random.Random(seed).shuffle(free)
    return free


def reference_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None,
                    scaling: float) -> torch.Tensor:
    """Causal (windowed) attention of a chunk's queries q [c, H, d] at positions start.. over the
    sequence's keys k, v [start + c, kvh, d], in float64."""
    c, heads, kvh = q.shape[0], q.shape[1], k.shape[1]
    out = torch.empty(c, heads, v.shape[-1], dtype=torch.float64)
    for i in range(c):
        p = start + i
        lo = max(0, p - window + 1) if window else 0
        kk = k[lo: p + 1].double().repeat_interleave(heads // kvh, 1)  # [n, H, d]
        vv = v[lo: p + 1].double().repeat_interleave(heads // kvh, 1)
        s = torch.einsum("hd,nhd->hn", q[i].double(), kk) * scaling
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vv)
    return out
