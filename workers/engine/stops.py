"""Stop conditions the engine checks after each new token: stop tokens, the model's end tokens,
lengths. Stop strings need the text, so they are checked off the compute thread (text_output)."""

from __future__ import annotations

from workers.engine.sequence import Sequence


def finish_reason(seq: Sequence, token: int, eos_ids: list[int], max_model_len: int) -> str | None:
    """Why `seq` ends after `token` was appended, or None."""
    params = seq.group.params
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
        return "stop"
    if len(seq.output) >= params.max_tokens or seq.length >= max_model_len:
        return "length"
    return None
