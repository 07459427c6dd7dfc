"""Stop conditions the engine checks after each new token: stop tokens, the model's end tokens,
lengths. Stop strings need the text, so they are checked off the compute thread (text_output)."""

from __future__ import annotations

from workers.engine.params import SamplingParams
from workers.engine.sequence import Sequence


def stop_token_ids(params: SamplingParams, eos_ids: list[int]) -> frozenset[int]:
    """The tokens that end a sample: its stop_token_ids, and the model's end tokens unless
    ignore_eos. (The engine stops on them; text_output keeps their text whole.)"""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))


def finish_reason(seq: Sequence, token: int, max_model_len: int) -> str | None:
    """Why `seq` ends after `token` was appended, or None."""
    params = seq.group.params
    if token in seq.group.stop_ids:
        return "stop"
    if len(seq.output) >= params.max_tokens or seq.length >= max_model_len:
        return "length"
    return None
