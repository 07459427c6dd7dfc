"""Batch jobs lose nothing: a transient failure costs neither the lines after it nor a batch's
finished rows, eval resumes, a retried request samples the same tokens, and every mode exits cleanly."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from dataclasses import replace

import h5py
import numpy as np
import pytest
from support.batch import hdf5_reference, hdf5_setup, run_mm, tiny_variant, write_params
from support.cluster import ANY_PORT, ROOT, TINY, start_worker, wait_for

from fusion.jobs import Transient, complete
from routing.client import Client, RouterError
from routing.entrypoints import CLI, DEMO, command
from routing.router import ModelEntry, Router, RouterConfig
from wire import protocol as P


def _router(models: list[ModelEntry], **cfg) -> tuple[Router, threading.Thread]:
    box: list = []

    def serve():
        r = Router(models, RouterConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*",
                                        heartbeat_interval=0.2, **cfg))
        box.append(r)
        r.run()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    wait_for(lambda: box, 10)
    return box[0], t


def _predict_against(router_addr: str, params, variants, md):
    return subprocess.run([*command(CLI), "--mode", "predict", "--params", str(params), "--variants",
                           *variants, "--model_dir", str(md), "--router", router_addr],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_transient_jsonl_failure_neither_blocks_nor_loses_the_lines_after_it(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    lines = [{"prompt": [5, 6, 7 + i], "max_tokens": 4, "ignore_eos": True, **({"model": "gpt2"} if i % 3 == 1 else {})}
             for i in range(9)]
    (data / "req.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    # two short resends (the default waits 0.5, 2 and 8 s): still resent, and still failing
    params = write_params(tmp_path, {"llama": tiny_variant("llama", "JsonlCompletions", data),
                                     "gpt2": tiny_variant("gpt2", "JsonlCompletions", data)},
                          retry_delays=[0.2, 0.2])
    gpt2 = replace(TINY, name="gpt2", source="tiny:gpt2")
    # gpt2 has no worker yet: its lines fail with no_worker after restart_wait, then after predict's retries
    router, thread = _router([ModelEntry(0, "llama", TINY), ModelEntry(1, "gpt2", gpt2)], restart_wait=0.3)
    workers = [start_worker(router.backend_addr)]
    out_path = tmp_path / "md" / "predictions" / "output_req.jsonl"
    try:
        with Client(router.frontend_addr, timeout=30) as c:
            wait_for(lambda: any(w["loaded"] for w in c.status()["workers"]), 60)
            first = _predict_against(router.frontend_addr, params, ["llama,1", "gpt2,1"], tmp_path / "md")
            assert first.returncode == 1 and "rerun" in first.stderr
            recs = [json.loads(x) for x in out_path.read_text().splitlines()]
            assert [r["request"] for r in recs] == lines  # every line, in input order
            for line, rec in zip(lines, recs):
                if line.get("model") == "gpt2":
                    assert rec["error"]["code"] == P.NO_WORKER and rec["error"]["retry"] is True
                else:
                    assert rec["result"]["choices"][0]["finish_reason"] == "length"
            workers.append(start_worker(router.backend_addr))  # takes the model without a worker: gpt2
            wait_for(lambda: sum(w["loaded"] for w in c.status()["workers"]) == 2, 60)
            served_before = c.status()["workers"][0]["served"]
            second = _predict_against(router.frontend_addr, params, ["llama,1", "gpt2,1"], tmp_path / "md")
            assert second.returncode == 0, second.stderr
            again = [json.loads(x) for x in out_path.read_text().splitlines()]
            assert [r["request"] for r in again] == lines
            for line, old, new in zip(lines, recs, again):
                if line.get("model") == "gpt2":
                    assert new["result"]["model"] == "gpt2" and len(new["result"]["choices"][0]["text"]) >= 0
                else:
                    assert new == old  # served once, kept as written
            assert c.status()["workers"][0]["served"] == served_before  # llama served nothing again
            assert not out_path.with_name(out_path.name + ".partial").exists()
    finally:
        router.stop()
        thread.join(10)
        for w in workers:
            w.wait(10)


def test_a_failed_hdf5_row_keeps_the_finished_rows_of_its_batch(tmp_path):
    rows = [[3, 4, 5], [7, 9999, 8], [10, 11]]  # 9999 is outside tiny Llama's vocabulary: that row fails
    hdf5_setup(tmp_path, rows, end=99998)
    out = subprocess.run([*command(CLI), "--mode", "predict", "--params", str(tmp_path / "p.yaml"),
                          "--variants", "llama,1", "--model_dir", str(tmp_path / "md"), "--devices", "cpu",
                          "--frontend", ANY_PORT, "--backend", ANY_PORT],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    pred = tmp_path / "md" / "predictions" / "llama"
    # the row is the data's fault: named, and not called transient (a rerun alone would not finish it)
    assert out.returncode == 1 and "row 1 refused (bad_request: prompt token ID 9999" in out.stderr
    assert "its 2 finished rows are kept" in out.stderr and "transient" not in out.stderr, out.stderr
    assert not (pred / "predictions_1.npz").exists()
    kept = {r["row"]: r["tokens"] for r in map(json.loads, (pred / ".predictions_1.rows.jsonl").read_text().splitlines())}
    assert kept == {0: hdf5_reference(rows[0], 99998), 2: hdf5_reference(rows[2], 99998)}
    # mend the row, rerun: only it is computed, and the batch is whole
    with h5py.File(tmp_path / "data" / "prompts.h5", "r+") as f:
        f["data"][1, 1] = 99
    (pred / ".predictions_1.rows.jsonl").write_text(
        "".join(json.dumps({"row": r, "tokens": t}) + "\n" for r, t in kept.items()) + '{"row": 0, "tok')  # torn tail
    out = subprocess.run(out.args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    with np.load(pred / "predictions_1.npz") as z:
        got = z["predictions"]
    for r, prompt in enumerate([rows[0], [7, 99, 8], rows[2]]):
        want = prompt + hdf5_reference(prompt, 99998)
        assert got[r, : len(want)].tolist() == want
    assert not (pred / ".predictions_1.rows.jsonl").exists()


def test_eval_resumes_from_what_it_wrote(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"prompt": [4, 5, 6 + i]}) + "\n" for i in range(5)))
    params = write_params(tmp_path, {"llama": tiny_variant("llama", "JsonlCompletions", data)})
    log = tmp_path / "md" / "eval" / "llama.partial.jsonl"
    log.parent.mkdir(parents=True)
    # an earlier run had scored sample 0 (marked, to see it is kept, not scored again) and had a
    # transient failure on sample 3 (scored again now); its last line was torn by a kill
    log.write_text(json.dumps({"sample": 0, "where": "earlier run", "tokens": ["a", "b"],
                               "token_logprobs": [None, -1.5], "mean_logprob": -1.5, "perplexity": 4.48}) + "\n"
                   + json.dumps({"sample": 3, "where": "a.jsonl line 4", "error": "worker_lost", "retry": True})
                   + "\n" + '{"sample": 1, "whe')
    out = run_mm(params, "eval", ["llama,1"], tmp_path / "md")
    assert out.returncode == 0, out.stderr
    rep = json.loads((tmp_path / "md" / "eval" / "llama.json").read_text())
    assert [s["sample"] for s in rep["per_sample"]] == [0, 1, 2, 3, 4] and rep["errors"] == 0
    assert rep["per_sample"][0]["where"] == "earlier run"
    assert all(s["where"] == f"a.jsonl line {s['sample'] + 1}" and len(s["token_logprobs"]) == 3
               for s in rep["per_sample"][1:])
    assert not log.exists()


def test_a_retried_request_samples_the_same_tokens():
    """fusion.jobs.complete fixes the seed before its first attempt. The client here is a stand-in
    that fails once, the way a lost worker does, and records what each attempt asked for."""
    class FlakyClient:
        def __init__(self):
            self.calls = []

        async def complete(self, model, prompt, **params):
            self.calls.append(dict(params))
            if len(self.calls) == 1:
                raise RouterError(P.WORKER_LOST, "worker 0 was lost")
            return {"ok": True}

    sampled, greedy = FlakyClient(), FlakyClient()
    assert asyncio.run(complete(sampled, "m", [1], (0.01,), temperature=0.9, max_tokens=3)) == {"ok": True}
    asyncio.run(complete(greedy, "m", [1], (0.01,), temperature=0.0))
    assert sampled.calls[0]["seed"] == sampled.calls[1]["seed"] is not None
    assert "seed" not in greedy.calls[0] and len(greedy.calls) == 2
    with pytest.raises(Transient) as info:
        asyncio.run(complete(FlakyClient(), "m", [1], ()))
    assert info.value.code == P.WORKER_LOST


ABORT = "terminate called"


@pytest.mark.slow
def test_the_demo_exits_cleanly(tmp_path, embedded_models):
    # one batch per model: every part runs (both models, HDF5 and JSONL, one router), and exits
    out = subprocess.run([*command(DEMO), "--model_dir", str(tmp_path / "demo"), "--inference_steps", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    assert ABORT not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "demo finished" in out.stdout
