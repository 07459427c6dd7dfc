"""Incremental detokenization: pieces add up to the full decode, whatever the tokenizer."""

from __future__ import annotations

import pytest
from support.models import tiny

from workers.engine.detok import IncrementalText

TEXTS = ["Hello, wörld! 🌍 — naïve café\n  indented:\n\tdef f(x):\n\t\treturn x**2  # ✓",
         "日本語のテキストと emoji 👩‍👩‍👧 mixed with   multiple   spaces and a trailing space ",
         "\"quotes\" 'single' ... ellipsis… done."]


def check(tok, text: str) -> None:
    ids = tok(text).input_ids
    inc = IncrementalText(tok)
    pieces = [inc.extend([i]) for i in ids]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == inc.text
    assert all("\ufffd" not in p for p in pieces)  # never half a character
    # grouping does not matter: built at once from a prefix, it holds the same text as step by step
    for k in range(len(ids)):
        step = IncrementalText(tok)
        for i in ids[:k]:
            step.extend([i])
        assert IncrementalText(tok, ids[:k]).text == step.text


def test_byte_level_tiny_tokenizer_splits_characters_across_tokens():
    tok = tiny("llama").tokenizer
    for text in TEXTS:
        check(tok, text)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["smollm2-135m", "gemma3-270m"])
def test_real_tokenizers(source, embedded_models):
    from fusion.data.prepare import tokenize_only

    tok = tokenize_only(source)
    for text in TEXTS:
        check(tok, text)
