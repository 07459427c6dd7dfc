"""The HDF5 contract on hand-made files: prompts, batching, dummy rows, loop_dim, errors, atomic npz."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from fusion.data.hdf5 import DataError, GptHDF5MapDataProcessor, write_npz_atomic
from routing.entrypoints import PREPARE, command

S = 500  # start token, outside a tiny vocabulary


def make(tmp_path, rows, name="in.h5", transpose=False, dtype=np.int32, key="data"):
    arr = np.array(rows, dtype=dtype)
    with h5py.File(tmp_path / name, "w") as f:
        f[key] = arr.T if transpose else arr
    return tmp_path


def test_prompts_batches_and_dummy_rows(tmp_path):
    rows = [[i + 1, i + 2, S, S, S, S] for i in range(7)]
    p = GptHDF5MapDataProcessor(make(tmp_path, rows), batch_size=3, start_token=[S, 501])
    batches = list(p.batches())
    assert [b.number for b in batches] == [1, 2, 3]
    assert batches[2].prompts == [[7, 8], None, None]  # 1 real + 2 dummy rows
    pred = p.predictions(batches[2], [[9, 10, 11], None, None])
    assert pred.tolist() == [[7, 8, 9, 10, 11, S], [S] * 6, [S] * 6]


def test_first_start_token_of_any_listed_and_row_full(tmp_path):
    p = GptHDF5MapDataProcessor(make(tmp_path, [[1, 2, 3, 501, 5, S]]), batch_size=1, start_token=[S, 501])
    assert p.prompts == [[1, 2, 3]]
    assert p.max_new_tokens([1, 2, 3], 64) == 3  # the row is full after 3 new tokens
    assert p.max_new_tokens([1, 2, 3], 2) == 2


def test_loop_dim_0_reads_and_writes_transposed(tmp_path):
    rows = [[1, 2, S, S], [3, S, S, S]]
    p = GptHDF5MapDataProcessor(make(tmp_path, rows, transpose=True), batch_size=2, start_token=S, loop_dim=0)
    assert p.prompts == [[1, 2], [3]]
    b = next(p.batches())
    pred = p.predictions(b, [[7], [8, 9]])
    assert pred.shape == (4, 2) and pred.T.tolist() == [[1, 2, 7, S], [3, 8, 9, S]]


def test_inference_steps(tmp_path):
    rows = [[i + 1, S, S] for i in range(10)]
    p = GptHDF5MapDataProcessor(make(tmp_path, rows), batch_size=3, start_token=S, inference_steps=2)
    assert [b.number for b in p.batches()] == [1, 2]


def test_row_without_start_token_names_file_and_row(tmp_path):
    with pytest.raises(DataError, match=r"in\.h5: row 1 has no start token"):
        GptHDF5MapDataProcessor(make(tmp_path, [[1, S], [2, 3]]), batch_size=2, start_token=S)


@pytest.mark.parametrize("kwargs,match", [
    (dict(key="tokens"), "no dataset named 'data'"),
    (dict(dtype=np.float32), "integer token IDs"),
])
def test_bad_files(tmp_path, kwargs, match):
    with pytest.raises(DataError, match=match):
        GptHDF5MapDataProcessor(make(tmp_path, [[1, S]], **kwargs), batch_size=1, start_token=S)


def test_wrong_rank_and_missing_file(tmp_path):
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f["data"] = np.arange(5)
    with pytest.raises(DataError, match="rank 2"):
        GptHDF5MapDataProcessor(tmp_path, batch_size=1, start_token=S)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="exactly one .h5"):
        GptHDF5MapDataProcessor(empty, batch_size=1, start_token=S)


def test_npz_written_atomically(tmp_path):
    out = tmp_path / "predictions" / "v" / "predictions_3.npz"
    write_npz_atomic(out, 3, np.ones((2, 4), dtype=np.int32))
    with np.load(out) as z:
        assert int(z["global_step"]) == 3 and z["predictions"].shape == (2, 4)
    assert [p.name for p in out.parent.iterdir()] == ["predictions_3.npz"]  # no temp file left behind


def test_prepare_helper_round_trip(tmp_path):
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "prompts.txt").write_text("hello world\n\nab\n")
    (tmp_path / "data").mkdir()
    out = subprocess.run([*command(PREPARE), "--model", "tiny:llama", "--start-token", "500",
                          str(tmp_path / "prompts.txt"), str(tmp_path / "data" / "in.h5")], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    p = GptHDF5MapDataProcessor(tmp_path / "data", batch_size=2, start_token=500)
    from workers.weights.tiny_tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    assert [tok.decode(x) for x in p.prompts] == ["hello world", "ab"]
    assert p.max_seq_len == len("hello world") + 1
    h = tok("h").input_ids[0]  # a token the prompts use cannot be the start token
    bad = subprocess.run([*command(PREPARE), "--model", "tiny:llama", "--start-token", str(h),
                          str(tmp_path / "prompts.txt"), str(tmp_path / "x.h5")], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and f"contains the start token {h}" in bad.stderr
