"""Token choice and log-probabilities from logits rows.

Randomness is one uniform number per sampled token, a counter-based hash of (seed, sample
index, token index), applied through the inverse CDF of the filtered distribution. No RNG
state is shared between rows, so a token never depends on what else is in the batch. The rows
of a step are sampled together, with tensor operations over all of them, not one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    want_logprob: bool = True  # the chosen token's log-probability (a full-vocabulary logsumexp)
    adjust: LogitsAdjust | None = None  # what changes the row before its token is picked


@dataclass(slots=True, frozen=True)
class PromptTokens:
    """A prompt's distinct tokens for the repetition penalty, built once per sequence and not each
    step (an 8,000-token prompt's set, sorted and made a tensor, cost 5-11 ms a row a step)."""

    ids: torch.Tensor  # sorted, on the logits' device
    known: frozenset[int]

    @classmethod
    def of(cls, prompt: list[int], device: torch.device | str) -> PromptTokens:
        known = frozenset(prompt)
        return cls(torch.tensor(sorted(known), dtype=torch.long, device=device), known)


@dataclass(slots=True, frozen=True)
class LogitsAdjust:
    """A row's logits changed before its token is picked, in vLLM's order: the bias of each token
    in `bias`, the `banned` tokens (an end that min_tokens holds back) out, then the repetition
    penalty over the prompt's and the output's tokens (a positive logit divided, a negative one
    multiplied, as transformers' RepetitionPenaltyLogitsProcessor does), then `frequency` times
    each output token's count and `presence` once for each token the output holds, subtracted.
    The log-probabilities reported stay the model's own (vLLM's default)."""

    bias: dict[int, float]
    banned: frozenset[int]
    repetition: float
    frequency: float
    presence: float
    prompt: PromptTokens | None  # given whenever repetition is not 1.0
    output: list[int]

    def apply(self, row: torch.Tensor) -> None:
        """Change one float32 row of logits in place."""
        dev, vocab = row.device, row.shape[0]
        if self.bias:
            ids = torch.tensor(list(self.bias), device=dev)
            row.index_add_(0, ids, torch.tensor(list(self.bias.values()), dtype=row.dtype, device=dev))
        banned = [t for t in self.banned if t < vocab]
        if banned:
            row[torch.tensor(banned, device=dev)] = float("-inf")
        if self.repetition != 1.0:
            fresh = sorted(set(self.output) - self.prompt.known)  # each token once: its logit scaled once
            ids = torch.cat([self.prompt.ids, torch.tensor(fresh, dtype=torch.long, device=dev)]) if fresh \
                else self.prompt.ids
            v = row.index_select(0, ids)  # a fraction of indexing's cost at thousands of IDs
            row.index_copy_(0, ids, torch.where(v < 0, v * self.repetition, v / self.repetition))
        if (self.frequency or self.presence) and self.output:
            ids, counts = torch.unique(torch.tensor(self.output, device=dev), return_counts=True)
            row.index_add_(0, ids, -(self.frequency * counts.to(row.dtype) + self.presence))


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass passes u x the row's total mass."""
    cum = torch.cumsum(probs, dim=-1)
    idx = torch.searchsorted(cum, (u * cum[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    over = idx >= probs.shape[-1]  # u x total rounded up to the total: the last token with mass
    if bool(over.any()):
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.uint8).argmax(-1)
        idx = torch.where(over, last, idx)
    return idx


def _sample_rows(logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """Sampled tokens for rows with a temperature, all rows at once. Only rows with top_k sort
    (k values), only rows with top_p sort their whole distribution; the others invert the CDF in
    vocabulary order. Every step is row by row, so a row's token never depends on the others."""
    dev = logits.device
    x = logits.float() / torch.tensor([s.temperature for s in specs], device=dev)[:, None]
    vocab = x.shape[-1]
    with_k = [i for i, s in enumerate(specs) if 0 < s.top_k < vocab]
    if with_k:
        ks = [specs[i].top_k for i in with_k]
        vals = torch.topk(x[with_k], max(ks), dim=-1).values
        kth = vals.gather(1, torch.tensor(ks, device=dev)[:, None] - 1)
        rows = torch.tensor(with_k, device=dev)
        x.index_copy_(0, rows, x[with_k].masked_fill(x[with_k] < kth, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    u = torch.tensor([uniform(s.seed, s.sample_index, s.token_index) for s in specs], dtype=probs.dtype, device=dev)
    tokens = [0] * len(specs)
    with_p = [i for i, s in enumerate(specs) if s.top_p < 1.0]
    plain = [i for i in range(len(specs)) if specs[i].top_p >= 1.0]
    if plain:
        sel = plain if len(plain) < len(specs) else slice(None)
        for i, t in zip(plain, _inverse_cdf(probs[sel], u[sel]).tolist()):
            tokens[i] = t
    if with_p:
        sorted_p, order = torch.sort(probs[with_p], dim=-1, descending=True, stable=True)
        top_p = torch.tensor([specs[i].top_p for i in with_p], dtype=probs.dtype, device=dev)[:, None]
        # keep the smallest head whose mass reaches top_p (the token crossing it included)
        sorted_p = sorted_p * ((torch.cumsum(sorted_p, dim=-1) - sorted_p) < top_p)
        picked = order.gather(1, _inverse_cdf(sorted_p, u[with_p])[:, None])[:, 0]
        for i, t in zip(with_p, picked.tolist()):
            tokens[i] = t
    return tokens


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if rows == list(range(x.shape[0])):
        return x  # the usual case: every row, in order - no gather
    return x.index_select(0, torch.tensor(rows, device=x.device))


def _greedy(rows: torch.Tensor) -> list[int]:
    """Each row's first maximal index (a NaN's, where a row has one), as argmax gives it. float32 rows
    on the CPU go to numpy's argmax, which is vectorized where torch's reduction with indices is not
    (12.5 against 72 us over SmolLM2's 49,152 logits on a Zen 3, a step's largest cost after the
    model's); other rows take max(dim), which runs some 4x faster than argmax on bfloat16 rows
    (which has no vectorized path), with no float copy of every row."""
    if rows.dtype == torch.float32 and rows.is_cpu:
        return np.argmax(rows.numpy(), axis=-1).tolist()
    return rows.max(dim=-1).indices.tolist()


def sample(logits: torch.Tensor, specs: list[SampleSpec], row_by_row: bool = False):
    """Pick a token per spec. Returns (tokens, chosen logprobs, top alternatives per spec); a
    chosen logprob is None where its spec does not want it.

    `row_by_row` (`deterministic`): each row on its own, so that every reduction over the
    vocabulary has one shape. torch splits a reduction differently for one row and for several (a
    lone row's sum goes to two threads in halves), and a row's logsumexp then moved by 2e-6 in
    float32 when another row was sampled beside it."""
    if row_by_row and len(specs) > 1:
        alone = [sample(logits, [s]) for s in specs]
        return [a[0][0] for a in alone], [a[1][0] for a in alone], [a[2][0] for a in alone]
    if not specs:
        return [], [], []
    sel = _rows(logits, [s.row for s in specs])
    picks = sel  # what tokens are picked from: the rows with their adjustments
    adjusted = [i for i, s in enumerate(specs) if s.adjust is not None]
    if adjusted:
        picks = sel.clone() if sel.dtype == torch.float32 else sel.float()
        for i in adjusted:
            specs[i].adjust.apply(picks[i])
    tokens = _greedy(picks)
    hot = [i for i, s in enumerate(specs) if s.temperature != 0]
    if hot:
        for i, t in zip(hot, _sample_rows(_rows(picks, hot), [specs[i] for i in hot])):
            tokens[i] = t
    chosen: list[float | None] = [None] * len(specs)
    want = [i for i, s in enumerate(specs) if s.want_logprob]
    if want:
        rows = _rows(sel, want).float()
        picked = rows.gather(1, torch.tensor([tokens[i] for i in want], device=rows.device)[:, None])[:, 0]
        for i, v in zip(want, (picked - torch.logsumexp(rows, dim=-1)).tolist()):
            chosen[i] = v
    ks = [s.num_top for s in specs]
    tops: list = [None] * len(ks)
    asked = [i for i, k in enumerate(ks) if k is not None]
    if asked:
        found = top_alternatives(torch.log_softmax(_rows(sel, asked).float(), dim=-1), [ks[i] for i in asked])
        for i, t in zip(asked, found):
            tops[i] = t
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
