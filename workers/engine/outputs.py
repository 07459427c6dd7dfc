"""What the engine hands back: per request, per sample. Plain data, safe to serialise."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float] | None  # log-probability of each chosen token; None unless asked (logprobs, best_of)
    top_logprobs: list[dict[int, float]] | None  # per token, when SamplingParams.logprobs is set
    finish_reason: str | None  # "stop", "length", "abort", or None while running
    new_token_ids: list[int] = field(default_factory=list)  # tokens added by the last step (streaming)

    @property
    def cumulative_logprob(self) -> float | None:
        return float(sum(self.logprobs)) if self.logprobs is not None else None

    @property
    def mean_logprob(self) -> float:
        return float(sum(self.logprobs)) / len(self.logprobs) if self.logprobs else float("-inf")


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[float | None] | None = None  # first token None (nothing predicts it)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
