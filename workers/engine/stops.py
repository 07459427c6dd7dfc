"""Stop conditions checked after each new token (end tokens, stop strings, lengths)."""

from __future__ import annotations

from workers.engine.detok import IncrementalText
from workers.engine.sequence import Sequence


def finish_reason(seq: Sequence, token: int, eos_ids: list[int], max_model_len: int, tokenizer) -> str | None:
    """Why `seq` ends after `token` was appended, or None. Cuts a matched stop string from seq.text."""
    params = seq.group.params
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids):
        return "stop"
    if params.stop and _match_stop(seq, tokenizer):
        return "stop"
    if len(seq.output) >= params.max_tokens or seq.length >= max_model_len:
        return "length"
    return None


def _match_stop(seq: Sequence, tokenizer) -> bool:
    if seq.detok is None:
        seq.detok = IncrementalText(tokenizer)
    seq.detok.extend(seq.output[len(seq.detok.ids):])  # a few tokens decoded, not the whole output
    seq.text = seq.detok.text
    longest = max(len(s) for s in seq.group.params.stop)
    # Only text not yet scanned (plus the overlap a stop string could straddle) can hold a new match.
    begin = max(0, seq.stop_checked_len - longest + 1)
    hits = [i for i in (seq.text.find(s, begin) for s in seq.group.params.stop) if i >= 0]
    seq.stop_checked_len = len(seq.text)
    if hits:
        seq.text = seq.text[: min(hits)]
        seq.text_cut = True
        return True
    return False
