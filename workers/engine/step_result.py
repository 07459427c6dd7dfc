"""What one step's model call produced, as plain data: the runner makes it, the scheduler applies it
(Scheduler.update_from_output), and neither side needs the other's internals."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.engine.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class PromptScores:
    group: SequenceGroup
    first_target: int  # prompt index of the token scored by logprobs[0]
    logprobs: list[float]
    top: list[dict[int, float] | None]


@dataclass(slots=True)
class StepResult:
    samples: list[tuple[Sequence, int, float, dict | None]] = field(default_factory=list)  # seq, token, logprob, top
    prompt_scores: list[PromptScores] = field(default_factory=list)
    # the step's model call, measured by the runner around it (its launch and its finish where the
    # device runs ahead): what the scheduler's pace of a long prompt's chunks compares
    forward_seconds: float = 0.0


@dataclass(slots=True)
class StepUpdate:
    """What applying a step changed, for the engine's outputs."""

    touched: dict[str, SequenceGroup] = field(default_factory=dict)  # requests with news, in the step's order
    new_tokens: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> the tokens this step added
    finished: list[Sequence] = field(default_factory=list)  # sequences this step ended (their runner state goes)
    tokens: int = 0  # tokens generated
