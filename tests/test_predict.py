"""run_mm.py --mode predict over HDF5, end to end: router, worker processes, files on disk."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time

import h5py
import numpy as np
import psutil
from support.batch import MAX_TOKENS, SEQ, START
from support.batch import hdf5_command as predict_command
from support.batch import hdf5_predict as predict
from support.batch import hdf5_reference as reference
from support.batch import hdf5_setup as setup
from support.cluster import ROOT


def test_predict_hdf5_end_to_end_and_resume(tmp_path):
    rng = random.Random(4)
    rows = [[rng.randrange(1, 256) for _ in range(n)] for n in (5, 9, 3, 20, 7, 12, 1)]
    probe = reference(rows[0], end=99998)
    end = probe[2]  # row 0 will emit this as its 3rd token: generation stops there, token kept
    setup(tmp_path, rows, end)
    out = predict(tmp_path)
    assert out.returncode == 0, out.stderr
    # every process of the run exits cleanly: no C++ abort ("terminate called ..."), no traceback
    assert "terminate called" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    pred_dir = tmp_path / "md" / "predictions" / "llama"
    files = sorted(p.name for p in pred_dir.iterdir())
    assert files == ["predictions_1.npz", "predictions_2.npz", "predictions_3.npz"]
    got = {}
    for x in (1, 2, 3):
        with np.load(pred_dir / f"predictions_{x}.npz") as z:
            assert int(z["global_step"]) == x and z["predictions"].shape == (3, SEQ)
            got[x] = z["predictions"].copy()
    expect_rows = []
    for r in rows:
        gen = reference(r, end)
        expect_rows.append((r + gen + [START] * SEQ)[:SEQ])
    assert expect_rows[0][len(rows[0]): len(rows[0]) + 3][-1] == end  # the end token is in the output
    all_rows = np.concatenate([got[1], got[2], got[3]])
    assert all_rows[:7].tolist() == expect_rows
    assert all_rows[7:].tolist() == [[START] * SEQ] * 2  # dummy rows
    # resume: a rerun writes only what is missing and gives the same files
    mtimes = {x: (pred_dir / f"predictions_{x}.npz").stat().st_mtime_ns for x in (1, 3)}
    (pred_dir / "predictions_2.npz").unlink()
    assert predict(tmp_path).returncode == 0
    assert {x: (pred_dir / f"predictions_{x}.npz").stat().st_mtime_ns for x in (1, 3)} == mtimes
    with np.load(pred_dir / "predictions_2.npz") as z:
        assert z["predictions"].tolist() == got[2].tolist()


def test_ctrl_c_stops_predict_cleanly_and_the_same_command_goes_on(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the whole process group) mid-run: status 130 and a line
    saying so (no traceback, from any process), nothing left running, the finished batches kept;
    the same command then writes the rest, equal to an uninterrupted run's."""
    rows = [[(i % 250) + 1, 3, 5] for i in range(300)]
    setup(tmp_path, rows, end=99998)
    proc = subprocess.Popen(predict_command(tmp_path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pred_dir = tmp_path / "md" / "predictions" / "llama"
    deadline = time.monotonic() + 240
    while not (pred_dir.is_dir() and len(list(pred_dir.glob("*.npz"))) >= 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    group = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted; what finished is kept" in err and "Traceback" not in err, err[-3000:]
    kept = len(list(pred_dir.glob("*.npz")))
    assert 3 <= kept < 100
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in group):
        assert time.monotonic() < deadline, "a process of the run outlived it"
        time.sleep(0.1)
    assert predict(tmp_path).returncode == 0
    assert len(list(pred_dir.glob("*.npz"))) == 100
    with np.load(pred_dir / "predictions_100.npz") as z:
        assert z["predictions"][2].tolist()[:3 + MAX_TOKENS] == rows[299] + reference(rows[299], 99998)


def test_outputs_that_cannot_be_written_end_the_run_with_a_line_not_a_traceback(tmp_path):
    """The outputs' directory replaced by a file mid-run (as a full disk, a write fails): the run
    stops with status 1 and one line naming the failure, and the batches written before stay."""
    rows = [[(i % 250) + 1, 3, 5] for i in range(900)]
    setup(tmp_path, rows, end=99998)
    proc = subprocess.Popen(predict_command(tmp_path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    pred_dir = tmp_path / "md" / "predictions" / "llama"
    deadline = time.monotonic() + 240
    while not (pred_dir.is_dir() and len(list(pred_dir.glob("*.npz"))) >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    aside, blocker = tmp_path / "written", tmp_path / "blocker"
    blocker.write_text("")
    pred_dir.rename(aside)
    while True:
        try:
            blocker.rename(pred_dir)
            break
        except IsADirectoryError:  # the run made the directory again meanwhile: what it wrote joins the rest
            for f in pred_dir.iterdir():
                f.rename(aside / f.name)
            pred_dir.rmdir()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    # the write that meets the file first says which: a row log's open, or a directory made
    assert re.search(r"error: (Not a directory|File exists).*; what finished is kept", err), err[-1000:]
    assert len(list(aside.glob("*.npz"))) >= 2


def test_predict_names_bad_row(tmp_path):
    setup(tmp_path, [[1, 2]], end=3)
    with h5py.File(tmp_path / "data" / "prompts.h5", "r+") as f:
        f["data"][0, :] = 7  # no start token left in row 0
    out = predict(tmp_path)
    assert out.returncode == 2 and "prompts.h5: row 0 has no start token" in out.stderr
    with h5py.File(tmp_path / "data" / "prompts.h5", "r+") as f:
        f["data"][0, :] = [4, -3, 9] + [START] * (SEQ - 3)
    out = predict(tmp_path)  # negative IDs are found before any load
    assert out.returncode == 2 and "prompts.h5: row 0 has a negative token ID (-3) at position 1" in out.stderr

