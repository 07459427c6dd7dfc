"""Token choice and log-probabilities from logits rows.

Randomness is one uniform number per sampled token, a counter-based hash of (seed, sample
index, token index), applied through the inverse CDF of the filtered distribution. No RNG
state is shared between rows, so a token never depends on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, sample_index: int, token_index: int) -> float:
    """A number in [0, 1) that depends only on the three keys."""
    h = _splitmix64(_splitmix64(_splitmix64(seed) ^ sample_index) ^ token_index)
    return (h >> 11) * (1.0 / (1 << 53))


@dataclass(slots=True)
class SampleSpec:
    """How to pick the next token of one sequence from one logits row."""

    row: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    sample_index: int
    token_index: int
    num_top: int | None  # top-k alternatives to report, None for none


def _sample_row(logits: torch.Tensor, spec: SampleSpec) -> int:
    x = logits.float() / spec.temperature
    if 0 < spec.top_k < x.shape[-1]:
        kth = torch.topk(x, spec.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs, order = torch.sort(torch.softmax(x, dim=-1), descending=True, stable=True)
    if spec.top_p < 1.0:
        cum = torch.cumsum(probs, dim=-1)
        # keep the smallest head whose mass reaches top_p (the token crossing it included)
        keep = (cum - probs) < spec.top_p
        probs = probs * keep
    cum = torch.cumsum(probs, dim=-1)
    u = uniform(spec.seed, spec.sample_index, spec.token_index) * float(cum[-1])
    idx = int(torch.searchsorted(cum, torch.tensor([u], dtype=cum.dtype, device=cum.device), right=True)[0])
    idx = min(idx, int((probs > 0).sum()) - 1)
    return int(order[idx])


def sample(logits: torch.Tensor, specs: list[SampleSpec]):
    """Pick a token per spec. Returns (tokens, chosen logprobs, top alternatives per spec)."""
    if not specs:
        return [], [], []
    row_ids = [s.row for s in specs]
    if row_ids == list(range(logits.shape[0])):
        sel = logits.float()  # the usual case: every row is sampled once, in order - no gather
    else:
        sel = logits.index_select(0, torch.tensor(row_ids, device=logits.device)).float()
    greedy = sel.argmax(dim=-1).tolist()
    tokens = [greedy[i] if s.temperature == 0 else _sample_row(sel[i], s) for i, s in enumerate(specs)]
    picked = sel.gather(1, torch.tensor(tokens, device=sel.device)[:, None])[:, 0]
    chosen = (picked - torch.logsumexp(sel, dim=-1)).tolist()
    ks = [s.num_top for s in specs]
    tops = top_alternatives(torch.log_softmax(sel, dim=-1), ks) if any(k is not None for k in ks) else [None] * len(ks)
    return tokens, chosen, tops


def top_alternatives(logp: torch.Tensor, ks: list[int | None]) -> list[dict[int, float] | None]:
    """Top-k {token: logprob} per row of a log-softmax matrix; None where k is None."""
    out: list[dict[int, float] | None] = [None] * len(ks)
    kmax = max((k for k in ks if k), default=0)
    if kmax:
        vals, idx = torch.topk(logp, min(kmax, logp.shape[-1]), dim=-1)
        vals, idx = vals.tolist(), idx.tolist()
    for i, k in enumerate(ks):
        if k is not None:
            out[i] = {idx[i][j]: vals[i][j] for j in range(k)} if k else {}
    return out
