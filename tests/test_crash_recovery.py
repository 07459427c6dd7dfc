"""A predict run killed mid-way (the whole run with SIGKILL, or its workers) ends with the outputs
of an undisturbed run: nothing lost, nothing written twice, and nothing left running."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.batch import START, run_mm, same_choices, tiny_variant, write_params

from fusion.launcher import forked_workers


def _kill_setup(tmp_path: Path) -> Path:
    hdir, jdir = tmp_path / "h5", tmp_path / "jsonl"
    hdir.mkdir()
    jdir.mkdir()
    rng = np.random.default_rng(0)
    # enough work that a kill after CRASH_AFTER lands mid-run, and no more
    arr = np.full((2 * CRASH_BATCHES, 16), START, dtype=np.int32)
    for i in range(2 * CRASH_BATCHES):
        n = int(rng.integers(2, 8))
        arr[i, :n] = rng.integers(1, 256, n)
    with h5py.File(hdir / "p.h5", "w") as f:
        f["data"] = arr
    with open(jdir / "q.jsonl", "w") as f:
        for i in range(CRASH_LINES):
            f.write(json.dumps({"prompt": f"request number {i}", "max_tokens": 8, "logprobs": 1}) + "\n")
    return write_params(tmp_path, {
        "llama": tiny_variant("llama", "GptHDF5MapDataProcessor", hdir, batch_size=2, start_token=START,
                              max_tokens=8),
        "gpt2": tiny_variant("gpt2", "JsonlCompletions", jdir, batch_size=4)})


def _strip_volatile(line: str) -> dict:
    rec = json.loads(line)
    for k in ("id", "created", "request_time"):
        rec["result"].pop(k)
    return rec


@pytest.fixture(scope="module")
def crash_case(tmp_path_factory):
    """Inputs for the crash tests and the outputs of an undisturbed run over them."""
    root = tmp_path_factory.mktemp("crash")
    params = _kill_setup(root)
    clean = run_mm(params, "predict", CRASH_VARIANTS, root / "clean")
    assert clean.returncode == 0, clean.stderr
    return params, root / "clean" / "predictions"


CRASH_VARIANTS = ["llama,1", "gpt2,1"]
CRASH_BATCHES, CRASH_LINES = 20, 200  # HDF5 batches of 2 rows, JSONL lines
CRASH_AFTER = (5, 20)  # the batches and lines written before the tests kill something


def _wait_mid_run(proc, pred: Path) -> None:
    import time

    partial = pred / "output_q.jsonl.partial"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        npz = list((pred / "llama").glob("predictions_*.npz")) if (pred / "llama").exists() else []
        if len(npz) >= CRASH_AFTER[0] and partial.exists() and partial.read_text().count("\n") >= CRASH_AFTER[1]:
            return
        time.sleep(0.01)


def _same_outputs(pred: Path, clean: Path) -> None:
    for x in range(1, CRASH_BATCHES + 1):
        with np.load(pred / "llama" / f"predictions_{x}.npz") as a, \
                np.load(clean / "llama" / f"predictions_{x}.npz") as b:
            assert int(a["global_step"]) == x and a["predictions"].tolist() == b["predictions"].tolist()
    got = (pred / "output_q.jsonl").read_text().splitlines()
    want = (clean / "output_q.jsonl").read_text().splitlines()
    assert len(got) == CRASH_LINES
    for g, w in zip(got, want):
        g, w = _strip_volatile(g), _strip_volatile(w)
        # same tokens and text; logprobs equal up to float rounding (batches were packed differently)
        same_choices(g["result"].pop("choices"), w["result"].pop("choices"))
        assert g == w


def test_kill_9_mid_run_then_rerun_gives_identical_outputs(tmp_path, crash_case, request):
    import os
    import signal

    params, clean = crash_case
    md = tmp_path / "killed"
    pred = md / "predictions"
    # a process killed with SIGKILL cannot remove its temporary files (multiprocessing's directory
    # for the fork server's socket): the run keeps them in a directory of this test's, removed at
    # the end. A short path: the socket's must fit in 107 bytes
    scratch = tempfile.mkdtemp(prefix="kill9-", dir="/tmp")
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    proc = run_mm(params, "predict", CRASH_VARIANTS, md, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                  env={**os.environ, "TMPDIR": scratch})
    _wait_mid_run(proc, pred)
    import psutil

    from fusion.launcher import forked_workers

    left = [*forked_workers(proc.pid), *psutil.Process(proc.pid).children()]  # the workers and the fork server
    assert len(left) >= 3
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # the kill landed mid-run: some outputs exist, not all, and no final file is half-written
    done = sorted((pred / "llama").glob("predictions_*.npz"))
    assert CRASH_AFTER[0] <= len(done) < CRASH_BATCHES and not (pred / "output_q.jsonl").exists()
    for f in done:
        with np.load(f) as z:
            assert z["predictions"].shape == (2, 16)
    # orphaned workers notice their starter is gone and exit, and the fork server after them
    gone, alive = psutil.wait_procs(left, timeout=30)
    assert not alive, [p.cmdline()[:3] for p in alive]
    rerun = run_mm(params, "predict", CRASH_VARIANTS, md)
    assert rerun.returncode == 0, rerun.stderr
    assert "already written" in rerun.stdout
    _same_outputs(pred, clean)


def test_predict_finishes_correctly_when_a_worker_crashes(tmp_path, crash_case):

    params, clean = crash_case
    md = tmp_path / "crashed"
    pred = md / "predictions"
    proc = run_mm(params, "predict", CRASH_VARIANTS, md, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                  text=True)
    _wait_mid_run(proc, pred)
    workers = forked_workers(proc.pid)
    assert len(workers) == 2 and proc.poll() is None
    for w in workers:  # both: neither model has a replica, so their requests fail and predict resends them
        w.kill()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert err.count("killed by SIGKILL") == 2 and err.count("started again") == 2
    _same_outputs(pred, clean)


def test_a_zombie_child_is_no_fork_server_and_breaks_nothing():
    """A child that exited and is not reaped yet has no command line: looking for the fork server
    (the CLI's stop_server at exit) passes over it instead of failing."""
    import os
    import time

    import psutil

    from fusion.launcher import fork_servers, stop_server

    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
        assert all(s.pid != child.pid for s in fork_servers(os.getpid()))
        stop_server()
    finally:
        child.wait()
