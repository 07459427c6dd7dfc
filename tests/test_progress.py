"""Progress: tqdm bars per model on a terminal, plain periodic lines otherwise, and the summary."""

from __future__ import annotations

import io

from fusion.progress import Progress


def test_plain_lines_when_not_a_terminal_and_summary():
    out = io.StringIO()
    p = Progress({"a": 3, "b": 1}, stream=out, interval=3600)
    p.start("a")
    p.advance("a", samples=2, tokens=10)
    assert out.getvalue() == ""  # not yet: at most one line per interval...
    p.advance("a", samples=1, tokens=5)
    p.advance("b", skipped=1)
    lines = out.getvalue().splitlines()  # ...but always when everything is done
    assert lines == ["[a] 3/3 samples (15 tokens)", "[b] 1/1 samples (0 tokens)"]
    summary = p.close()
    assert summary[0].startswith("a: 3 samples, 15 tokens generated, ") and "tokens/s" in summary[0]
    assert summary[1] == "b: 0 samples, 0 tokens generated, 0.0 tokens/s, 0.0s wall, 1 already written"


def test_one_bar_per_model_on_a_terminal():
    out = io.StringIO()
    p = Progress({"smollm2": 4, "gemma3": 2}, stream=out, bars=True)
    p.start("smollm2")
    p.advance("smollm2", samples=4, tokens=40)
    p.advance("gemma3", samples=1, errors=1, tokens=3)
    p.close()
    text = out.getvalue()
    assert "smollm2: 100%" in text and "4/4" in text and "gemma3: 100%" in text and "2/2" in text
    assert "[smollm2]" not in text  # bars instead of plain lines
