"""A worker's output work in its own process: the steps' additions rebuild what the engine had, a
lagging output side merges steps into fewer chunks without losing or reordering a token, and the
output process lives and dies with its worker."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq
from support.cluster import ROOT, loaded_deployment, wait_for
from support.models import tiny

from routing.client import Client
from routing.entrypoints import WORKER, command
from wire import protocol as P
from workers.engine import Engine, EngineConfig
from workers.engine.params import SamplingParams
from workers.output_process import supported
from workers.output_work import OutputWork
from workers.step_deltas import StepEncoder, StepMirror
from workers.thread_messages import ModelReady, Registered, StepOutputs

pytestmark = pytest.mark.skipif(not supported(), reason="the output process needs Linux")


@pytest.fixture(scope="module")
def lm():
    return tiny("llama", "float32")


def _requests(eng: Engine) -> None:
    eng.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=2))
    eng.add_request("b", list(range(3, 40)), SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=3,
                                                            ignore_eos=True, prompt_logprobs=1))
    eng.add_request("c", [9, 9, 9], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))


def test_the_steps_additions_rebuild_each_output_as_the_engine_had_it(lm):
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=16))  # the long prompt takes chunks
    _requests(eng)
    enc, mirror, steps, aborted = StepEncoder(), StepMirror(), 0, False
    while eng.has_unfinished():
        results = eng.step()
        want = [(r.request_id, [(c.index, list(c.token_ids), c.finish_reason, c.logprobs and list(c.logprobs),
                                 c.top_logprobs and list(c.top_logprobs)) for c in r.outputs], r.finished,
                 r.prompt_logprobs and list(r.prompt_logprobs)) for r in results]
        got = mirror.apply(pickle.loads(pickle.dumps(enc.encode(results))))
        by_key = {r.request_id: (r, n) for r, n in zip(got.results, got.lengths)}
        for key, samples, finished, prompt_lp in want:
            if not any(s[1] for s in samples) and not finished:
                assert key not in by_key  # nothing to say while its prompt is prefilled
                continue
            r, lengths = by_key[key]
            assert r.finished == finished and lengths == [len(s[1]) for s in samples]
            assert [(c.index, c.token_ids, c.finish_reason, c.logprobs, c.top_logprobs) for c in r.outputs] == samples
            if finished:
                assert r.prompt_logprobs == prompt_lp
        steps += 1
        if steps == 3 and not aborted:  # a request dropped while it runs leaves nothing behind
            aborted = eng.abort("c")
            enc.forget(["c"])
            mirror.forget(["c"])
    assert steps > 7 and aborted and not enc.sent and not mirror.outputs


def _turn(frames: list[list[bytes]]) -> list[dict]:
    (bundle,) = frames
    parts = P.unbundle(bundle[0])
    return [msgpack.unpackb(b) for b in parts[1::2]]


def test_steps_that_waited_go_as_one_chunk_per_request_in_order(lm):
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eng.add_request("a", [5, 6, 7], params)
    steps = []
    while eng.has_unfinished():
        results = eng.step()
        steps.append(StepOutputs(results, [[len(c.token_ids) for c in r.outputs] for r in results]))
    final = steps[-1].results[0].outputs[0]
    model = ModelReady("m", lm.tokenizer, [])
    reg = Registered("a", {"id": "c1", "stream": True}, params, False)

    def run(batches):
        work, sent = OutputWork(lambda note: None), []
        work.handle([model, reg], sent.append)
        for items in batches:
            work.handle(items, sent.append)
        return [m for frames in sent for m in _turn([frames])]

    one_by_one, merged = run([[s] for s in steps]), run([steps])
    assert [m["type"] for m in one_by_one] == [P.CHUNK] * len(steps) + [P.RESULT]
    assert [m["type"] for m in merged] == [P.CHUNK, P.RESULT]  # every step waited: one chunk
    for msgs in (one_by_one, merged):
        chunks = [o for m in msgs if m["type"] == P.CHUNK for o in m["outputs"]]
        assert [t for o in chunks for t in o["token_ids"]] == final.token_ids
        assert "".join(o["text"] for o in chunks) == msgs[-1]["response"]["choices"][0]["text"]
        assert chunks[-1]["finish_reason"] == "length"


def _output_process(worker_pid: int) -> psutil.Process:
    kids = psutil.Process(worker_pid).children()
    assert len(kids) == 1, kids
    return kids[0]


def _cpu_ns(pid: int) -> int:
    """The process's CPU time in nanoseconds, over its threads (the scheduler's own count: the
    clock ticks psutil reads are 10 ms, longer than detokenizing a few tokens takes)."""
    task = Path(f"/proc/{pid}/task")
    return sum(int((t / "schedstat").read_text().split()[0]) for t in task.iterdir())


def test_a_deployment_makes_text_in_the_output_process_and_stops_the_engine_from_there(lm):
    full = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64)).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].outputs[0].text
    stop = full[8:11]
    params = {"variants": {"m": {"model": {"source": "tiny:llama", "dtype": "float32", "max_batch_size": 8,
                                           "max_batch_tokens": 64}}}, "runconfig": {}, "_path": "test"}
    d = loaded_deployment(params, ["m,1"])
    try:
        with Client(d.frontend, timeout=60) as c:
            (w,) = c.status()["workers"]
            out = _output_process(w["pid"])
            cpu_before = _cpu_ns(out.pid)
            chunks = list(c.stream(0, [5, 6, 7], max_tokens=400, stop=[stop], temperature=0.0, ignore_eos=True))
            assert "".join(o["text"] for o in chunks) == full[: full.index(stop)]
            assert chunks[-1]["finish_reason"] == "stop"
            # the output process matched the stop string and told the engine, which stopped long before 400
            def engine() -> dict:
                return c.status()["workers"][0]["engine"]

            wait_for(lambda: engine().get("running") == 0 and "tokens_generated" in engine(), 10)
            # the stop lies about 10 tokens in; the engine runs on while the word travels (44 tokens
            # once with the whole suite on 2 cores: this model makes a token in 50 us)
            assert engine()["tokens_generated"] < 200
            assert _cpu_ns(out.pid) > cpu_before  # the text was made there
            os.kill(w["pid"], signal.SIGKILL)
            out.wait(10)  # the kernel's parent-death signal: it does not outlive its worker
    finally:
        d.__exit__(None, None, None)


def test_a_worker_whose_output_process_died_exits():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    worker = subprocess.Popen([*command(WORKER), "--backend", f"tcp://127.0.0.1:{port}", "--threads", "1",
                               "--parent-pid", str(os.getpid())], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert sock.poll(60_000)  # it registered
        out = _output_process(worker.pid)
        out.kill()
        worker.wait(10)  # it exits on its own
        assert "the output process exited" in worker.stderr.read()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
        sock.close(0)
        ctx.term()
