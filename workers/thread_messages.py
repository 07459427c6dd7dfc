"""What a worker's threads hand each other through their queues (workers/worker.py,
workers/output_thread.py). The wire messages to the router are wire/protocol.py's."""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.outputs import RequestOutput
from workers.engine.params import SamplingParams

# --- to the engine thread (its inbox) ----------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Assign:
    """The router's ASSIGN: load (or keep) this model, dropping what the last assignment held. The
    spec is still in its wire form: the engine thread reads it, and answers a bad one with
    LOAD_FAILED."""

    model_id: int
    worker_id: int
    spec: dict


@dataclass(slots=True, frozen=True)
class Submit:
    """A COMPLETE request under the router's key."""

    key: str
    msg: dict


@dataclass(slots=True, frozen=True)
class Cancel:
    """Run nothing more for this request and free its batch slots. Either the client cancelled
    (send nothing more for it), or stop strings ended every sample and it is `answered`."""

    key: str
    answered: bool = False


@dataclass(slots=True, frozen=True)
class FinishSample:
    """A stop string matched this sample's text: stop computing it."""

    key: str
    index: int


EngineMessage = Assign | Submit | Cancel | FinishSample

# --- to the output thread ------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ModelReady:
    """The model the next requests run on, as the output thread needs it."""

    name: str
    tokenizer: object
    eos_token_ids: list[int]


@dataclass(slots=True, frozen=True)
class Control:
    """A packed control message (LOADED, LOAD_FAILED), sent after the data before it."""

    frame: bytes


@dataclass(slots=True, frozen=True)
class Registered:
    """A request the engine accepted: its outputs follow."""

    key: str
    msg: dict
    params: SamplingParams
    echo: bool


@dataclass(slots=True, frozen=True)
class Failed:
    """A request failed; `cid` None: the id it was registered with (none: it was answered)."""

    key: str
    cid: str | None
    code: str
    message: str
    param: str | None = None  # the request parameter refused, by name


@dataclass(slots=True, frozen=True)
class Answer:
    """A tokenizer task's answer (tokenize, detokenize, tokenizer_info), sent as the request's
    RESULT. The engine thread computes it: it holds the tokenizer and the model's length."""

    key: str
    body: dict


@dataclass(slots=True, frozen=True)
class Forget:
    """Send nothing more for these requests; None: for any (a new assignment)."""

    keys: list[str] | None


@dataclass(slots=True, frozen=True)
class StepOutputs:
    """A step's outputs, with each sample's length at the step: a running request's lists are the
    engine's own and grow on the next step."""

    results: list[RequestOutput]
    lengths: list[list[int]]


OutputMessage = ModelReady | Control | Registered | Failed | Answer | Forget | StepOutputs
