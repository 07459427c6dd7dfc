"""Sampling as tensor operations of fixed shape, on the logits' device: what a captured decode graph
runs (workers.engine.cuda.runner). Every row's settings are tensors, so one graph serves every
mix of greedy and random rows, with no `.item()` or `.tolist()` inside.

The tokens are workers.engine.sampler's, by the same rule: greedy rows take the first maximal
logit; a random row's uniform number is the same counter-based hash of (seed, sample index, token
index), computed here in 64-bit integer tensor arithmetic, and goes through the same inverse CDF
of the same filtered distribution (temperature, top_k, top_p). Log-probabilities are left to the
host sampler, on the step's logits, for the rows that ask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A 64-bit constant as the int64 whose bits it is."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _signed(_GOLDEN)  # int64 arithmetic wraps modulo 2^64, as the hash wants
    x = (x ^ _shr(x, 30)) * _signed(_MIX1)
    x = (x ^ _shr(x, 27)) * _signed(_MIX2)
    return x ^ _shr(x, 31)


def uniforms(seed: torch.Tensor, sample_index: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """sampler.uniform for each row, as float64: [0, 1)."""
    h = _splitmix64(_splitmix64(_splitmix64(seed) ^ sample_index) ^ token_index)
    return _shr(h, 11).double() * (1.0 / (1 << 53))


@dataclass(slots=True)
class SamplingRows:
    """Each row's settings as tensors on the device (a graph's persistent inputs, or a step's)."""

    temperature: torch.Tensor  # float32 [B]; 0: greedy
    top_k: torch.Tensor  # int64 [B]; 0 or >= vocab: no top-k
    top_p: torch.Tensor  # float32 [B]; 1: no top-p
    seed: torch.Tensor  # int64 [B]
    sample_index: torch.Tensor  # int64 [B]
    token_index: torch.Tensor  # int64 [B]

    @classmethod
    def empty(cls, rows: int, device: torch.device) -> SamplingRows:
        def zeros(dtype):
            return torch.zeros(rows, dtype=dtype, device=device)

        return cls(zeros(torch.float32), zeros(torch.long), torch.ones(rows, device=device), zeros(torch.long),
                   zeros(torch.long), zeros(torch.long))

    def head(self, n: int) -> SamplingRows:
        """The first n rows, as views."""
        return SamplingRows(*(getattr(self, f)[:n] for f in self.__slots__))

    def fill(self, values: dict[str, list]) -> None:
        """Write the first rows of each field from host lists (the eager path; a graph's inputs are
        copied in at once)."""
        for name, vals in values.items():
            t = getattr(self, name)
            t[: len(vals)].copy_(torch.tensor(vals, dtype=t.dtype))


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sampler._inverse_cdf without its branch: the last token with mass where u x total rounds up
    to the total."""
    cum = torch.cumsum(probs, dim=-1)
    idx = torch.searchsorted(cum, (u * cum[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.uint8).argmax(-1)
    return torch.where(idx >= probs.shape[-1], last, idx)


def sample_tokens(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """One token per logits row [B, vocab], by its row's settings. Returns int64 [B]."""
    greedy = logits.max(dim=-1).indices
    vocab = logits.shape[-1]
    hot = rows.temperature != 0
    x = logits.float() / torch.where(hot, rows.temperature, torch.ones_like(rows.temperature))[:, None]
    ranked = torch.sort(x, dim=-1, descending=True).values
    k = rows.top_k
    with_k = (k > 0) & (k < vocab)
    kth = ranked.gather(1, (k.clamp(1, vocab) - 1)[:, None])
    x = torch.where(with_k[:, None] & (x < kth), torch.full_like(x, float("-inf")), x)
    probs = torch.softmax(x, dim=-1)
    u = uniforms(rows.seed, rows.sample_index, rows.token_index).to(probs.dtype)
    plain = _inverse_cdf(probs, u)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    sorted_p = sorted_p * ((torch.cumsum(sorted_p, dim=-1) - sorted_p) < rows.top_p[:, None])
    nucleus = order.gather(1, _inverse_cdf(sorted_p, u)[:, None])[:, 0]
    random = torch.where(rows.top_p < 1.0, nucleus, plain)
    return torch.where(hot, random, greedy)
