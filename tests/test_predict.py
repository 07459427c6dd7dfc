"""run_mm.py --mode predict over HDF5, end to end: router, worker processes, files on disk."""

from __future__ import annotations

import random

import h5py
import numpy as np
from support.batch import SEQ, START
from support.batch import hdf5_predict as predict
from support.batch import hdf5_reference as reference
from support.batch import hdf5_setup as setup


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


def test_predict_names_bad_row(tmp_path):
    setup(tmp_path, [[1, 2]], end=3)
    with h5py.File(tmp_path / "data" / "prompts.h5", "r+") as f:
        f["data"][0, :] = 7  # no start token left in row 0
    out = predict(tmp_path)
    assert out.returncode == 2 and "prompts.h5: row 0 has no start token" in out.stderr
