"""Text off the compute thread: stop strings matched after the engine ran on, the worker's output
thread, and no tokenizer call on the engine thread."""

from __future__ import annotations

import threading

import msgpack
import pytest
from support.cluster import TINY, wait_for, worker_threads
from support.models import tiny

from wire import protocol as P
from workers.engine import Engine, EngineConfig, detok
from workers.engine.params import SamplingParams
from workers.engine.text_output import RequestText
from workers.thread_messages import Submit

PROMPT = [10, 20, 30, 40, 50]


@pytest.fixture(scope="module")
def lm():
    return tiny("llama", "float32")  # as the worker loads TINY


def _engine(lm) -> Engine:
    return Engine(lm, EngineConfig(max_batch_size=8, max_batch_tokens=64))


def _stop_in(lm, params: SamplingParams) -> str:
    """A stop string from the middle of what `params` generates for PROMPT."""
    full = _engine(lm).generate([PROMPT], params)[0].outputs[0].text
    assert len(full) > 12
    return full[8:11]


def test_a_stop_matched_steps_late_gives_what_matching_at_once_gives(lm):
    base = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    stop = _stop_in(lm, base)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    want = _engine(lm).generate([PROMPT], params)[0].outputs[0]
    assert want.finish_reason == "stop" and stop not in want.text and len(want.token_ids) < 24

    eng = _engine(lm)
    eng.add_request("r", PROMPT, params)
    text = RequestText(lm.tokenizer, params, lm.eos_token_ids)
    late, ran_on = None, 0
    while eng.has_unfinished():
        for out in eng.step():
            if text.update(out) and late is None:
                late = out  # matched here; the engine is told only three steps later
            if late is not None:
                ran_on += 1
                if ran_on == 3:
                    assert eng.finish_sample("r", 0) is True
                    assert not eng.has_unfinished() and eng.scheduler.blocks.num_used == 0
    assert late is not None and len(late.outputs[0].token_ids) > len(want.token_ids)  # it ran past the match
    got = text.final(late).outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")
    assert eng.finish_sample("r", 0) is False  # gone


def test_best_of_ranks_samples_on_the_tokens_a_stop_string_kept(lm):
    params = dict(n=2, best_of=4, max_tokens=20, temperature=1.3, seed=5, ignore_eos=True)
    everyone = _engine(lm).generate([PROMPT], SamplingParams(**{**params, "n": 4, "best_of": None, "logprobs": 0}))[0]
    stop = everyone.outputs[0].text[4:6]
    cut = _engine(lm).generate([PROMPT], SamplingParams(**{**params, "n": 4, "best_of": None, "logprobs": 0,
                                                             "stop": [stop]}))[0]
    assert any(c.finish_reason == "stop" for c in cut.outputs)
    best = sorted(cut.outputs, key=lambda c: -c.mean_logprob)[:2]
    out = _engine(lm).generate([PROMPT], SamplingParams(**params, stop=[stop]))[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert [(c.token_ids, c.text) for c in out.outputs] == [(c.token_ids, c.text) for c in best]


def _recv_until_result(pair, key: str) -> tuple[list[dict], dict]:
    chunks = []
    while True:
        frames = P.unbundle(pair.recv())  # a turn's messages: (header, body) pairs
        for head, body in zip(frames[::2], frames[1::2]):
            mtype, k, _ = msgpack.unpackb(head)
            msg = msgpack.unpackb(body)
            assert k == key and mtype in (P.CHUNK, P.RESULT), msg
            if mtype == P.RESULT:
                return chunks, msg
            chunks.append(msg)


def test_the_worker_makes_text_on_its_output_thread_and_stops_the_engine_there(lm, monkeypatch):
    with worker_threads(TINY, "inproc://text-test") as (th, pair):
        greedy = {"temperature": 0.0, "ignore_eos": True}
        full = _engine(lm).generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
        stop = full.outputs[0].text[8:11]
        decoders: set[str] = set()
        real_text_of = detok.text_of

        def text_of(tokenizer):  # every decoder a stream makes, recording the thread it runs on
            decode = real_text_of(tokenizer)

            def recorded(ids):
                decoders.add(threading.current_thread().name)
                return decode(ids)

            return recorded

        monkeypatch.setattr(detok, "text_of", text_of)
        th.inbox.put(Submit("k", {"id": "c1", "prompt": PROMPT, "stream": True,
                                   "params": {"max_tokens": 400, "stop": [stop], **greedy}}))
        chunks, result = _recv_until_result(pair, "k")
        choice = result["response"]["choices"][0]
        want = full.outputs[0].text
        assert choice["text"] == want[: want.index(stop)] and choice["finish_reason"] == "stop"
        assert "".join(o["text"] for m in chunks for o in m["outputs"]) == choice["text"]
        assert [o["finish_reason"] for m in chunks for o in m["outputs"]][-1] == "stop"
        streamed = [t for m in chunks for o in m["outputs"] for t in o["token_ids"]]
        assert streamed == full.outputs[0].token_ids[: len(streamed)]
        # the output thread told the engine: it stopped long before max_tokens
        wait_for(lambda: not th.engine.has_unfinished(), 10)
        assert th.engine.tokens_generated < 40
        assert decoders == {"output"}  # detokenization never ran on the engine thread
