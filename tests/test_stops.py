"""Every stop condition and its finish_reason."""

from __future__ import annotations

import dataclasses

import pytest
from support.models import hf_greedy, tiny

from workers.engine import Engine, EngineConfig
from workers.engine.params import SamplingParams
from workers.models import load_model

PROMPT = [10, 20, 30, 40, 50]


@pytest.fixture(scope="module")
def lm():
    return tiny("llama")


@pytest.fixture(scope="module")
def reference(lm):
    return hf_greedy(lm.model, PROMPT, 40)


def _run(lm, **kw):
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64))
    return eng.generate([PROMPT], SamplingParams(temperature=0, **kw))[0].outputs[0]


def test_max_tokens_gives_length(lm, reference):
    out = _run(lm, max_tokens=7, ignore_eos=True)
    assert out.token_ids == reference[:7] and out.finish_reason == "length"


@pytest.mark.parametrize("as_list", [False, True])
def test_end_token_is_kept_and_stops(lm, reference, as_list):
    end = reference[5]
    first = reference.index(end)
    stop_ids = [999_999, end] if as_list else end
    out = _run(lm, max_tokens=40, stop_token_ids=stop_ids, ignore_eos=True)
    assert out.token_ids == reference[: first + 1] and out.finish_reason == "stop"


def test_model_eos_stops_unless_ignored(lm, reference):
    eos = lm.eos_token_ids[0]
    if eos not in reference:
        # the reference's 4th token as this model's EOS, on a copy: the module's fixture stays as it is
        lm = dataclasses.replace(lm, eos_token_ids=[reference[3]])
        eos = reference[3]
    first = reference.index(eos)
    stopped = _run(lm, max_tokens=40)
    assert stopped.token_ids == reference[: first + 1] and stopped.finish_reason == "stop"
    ignored = _run(lm, max_tokens=40, ignore_eos=True)
    assert ignored.token_ids == reference[:40] and ignored.finish_reason == "length"


def test_stop_string_is_cut_from_text(lm, reference):
    full = lm.tokenizer.decode(reference[:20], skip_special_tokens=True)
    stop = full[8:11]
    out = _run(lm, max_tokens=20, stop=[stop, "never-there"], ignore_eos=True)
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    assert stop not in out.text
    assert len(out.token_ids) < 20


def test_context_length_bounds_the_request():
    lm = load_model("tiny:llama", dtype="float64", max_model_len=12)
    eng = Engine(lm, EngineConfig(max_batch_size=2, max_batch_tokens=16))
    with pytest.raises(ValueError, match=r"context \(max_model_len\) is 12 tokens"):
        eng.add_request("x", PROMPT, SamplingParams(max_tokens=100))  # can never fit: refused at once
    assert not eng.has_unfinished()
    out = eng.generate([PROMPT], SamplingParams(max_tokens=12 - len(PROMPT), temperature=0, ignore_eos=True))[0]
    assert len(PROMPT) + len(out.outputs[0].token_ids) == 12
    assert out.outputs[0].finish_reason == "length"


def test_max_model_len_past_the_models_context_is_refused():
    assert load_model("tiny:llama", dtype="float32", max_model_len=512).max_model_len == 512  # its own context
    with pytest.raises(ValueError, match=r"max_model_len 513 is above the context of model 'tiny:llama', "
                                         r"512 tokens \(max_position_embeddings in its config\)"):
        load_model("tiny:llama", dtype="float32", max_model_len=513)


def test_abort_frees_the_blocks(lm):
    eng = Engine(lm, EngineConfig(max_batch_size=2, max_batch_tokens=16))
    eng.add_request("a", PROMPT, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    eng.add_request("b", PROMPT, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    eng.add_request("c", PROMPT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    sched = eng.scheduler
    assert len(sched.running) == 2 and [g.request_id for g in sched.waiting] == ["c"]
    held = sched.blocks.num_used
    assert held == sum(s.blocks.held() for s in sched.running) > 0
    assert eng.abort("a") is True
    assert len(sched.running) == 1 and sched.blocks.num_used < held
    assert eng.abort("a") is False  # already gone
    eng.step()
    assert "c" not in [g.request_id for g in sched.waiting]  # took the freed place
    assert len(sched.running) == 2
    eng.abort("b")
    eng.abort("c")
    assert not sched.running and not eng.has_unfinished()
    assert sched.blocks.num_free == sched.blocks.num_blocks  # every block back (some still cached)
