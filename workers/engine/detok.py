"""Incremental detokenization for streams: the text of a growing token list, decoding a few tokens
per new token instead of the whole list (which made a stream's cost quadratic in its length).

As in vLLM's detokenizer: decode the window from `prefix_offset` with and without the new tokens
and keep the difference. Both decodes start at the same token, so tokenizers that drop a leading
space at the start of a decode treat them alike. Text is only taken once it does not end in an
incomplete UTF-8 sequence, so it never changes after it is taken.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable


def text_of(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, as one call into the tokenizers library
    where that is what transformers' decode comes to (a fast tokenizer that cleans up no spaces):
    its checks of the ids' types cost a stream more than the decode itself, once per new token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True) and hasattr(backend, "decode"):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalText:
    def __init__(self, tokenizer, token_ids: list[int] | tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self._text_of = text_of(tokenizer)
        self.ids: list[int] = []
        self.text = ""  # the stable text so far
        self.ends: list[int] = []  # per token, len(self.text) once it was added (non-decreasing)
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text is in self.text
        self.extend(token_ids)

    def extend(self, new_ids) -> str:
        """Add tokens one at a time (so the result never depends on how they were grouped); return
        the text that became stable."""
        before = len(self.text)
        for t in new_ids:
            self.ids.append(t)
            prefix = self._decode(self._prefix, self._read)
            full = self._decode(self._prefix, len(self.ids))
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix):]
                self._prefix, self._read = self._read, len(self.ids)
            self.ends.append(len(self.text))
        return self.text[before:]

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._text_of(self.ids[start:end])


def tokens_within(tokenizer, token_ids: list[int], chars: int) -> int:
    """How many of `token_ids` have their text inside its first `chars` characters (a stop string
    cut the rest): one incremental pass, not a decode of every prefix."""
    return bisect.bisect_right(IncrementalText(tokenizer, token_ids).ends, chars)
