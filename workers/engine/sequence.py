"""Request and sequence state. Plain Python: the scheduler and engine bookkeeping live here."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from workers.engine.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample of a request: its tokens, how many have K/V in the cache, and the blocks holding them."""

    seq_id: int
    group: SequenceGroup
    sample_index: int
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    blocks: Any = None  # block_manager.SeqBlocks, given when the scheduler takes the request
    status: Status = Status.WAITING
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    def token_at(self, i: int) -> int:
        p = len(self.prompt)
        return self.prompt[i] if i < p else self.output[i - p]

    def all_tokens(self) -> list[int]:
        return self.prompt + self.output if self.output else self.prompt

    @property
    def num_uncomputed(self) -> int:
        return self.length - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """More than the last sampled token to compute: a prompt, or a preempted sequence's tokens."""
        return self.num_uncomputed > 1 or not self.output

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """A request: one prompt, `params.num_samples` sequences. Sample 0 prefills; the rest start from its blocks."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_text: str | None = None
    stop_ids: frozenset[int] = frozenset()  # tokens that end a sample (stops.stop_token_ids)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
