"""Params files and run_mm.py runs for the batch-mode tests (predict, eval, compile_only)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import h5py
import numpy as np
import yaml

from routing.entrypoints import CLI, command
from support.cluster import ANY_PORT, ROOT
from support.models import tiny
from workers.engine import Engine, EngineConfig
from workers.engine.params import SamplingParams

# the HDF5 layout of the predict tests: rows of SEQ tokens, prompts end at START
START, SEQ, MAX_TOKENS = 500, 24, 6


def write_params(tmp_path: Path, variants: dict, **runconfig) -> Path:
    params = {"variants": variants, "runconfig": {"threads_per_worker": 1, "devices": "cpu", **runconfig}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def tiny_variant(arch: str, processor: str, data_dir: Path, batch_size: int = 3, **model) -> dict:
    return {"model": {"source": f"tiny:{arch}", "dtype": "float32", "max_batch_size": 8, "max_batch_tokens": 64,
                      "temperature": 0.0, **model},
            "inference_input": {"data_processor": processor, "data_dir": str(data_dir), "batch_size": batch_size}}


def run_mm(params: Path, mode: str, variants: list[str], model_dir: Path, timeout: float = 300, **popen):
    """run_mm.py in a subprocess on ports the OS picks; subprocess.run, or Popen when given Popen's arguments."""
    cmd = [*command(CLI), "--mode", mode, "--params", str(params), "--variants", *variants,
           "--model_dir", str(model_dir), "--frontend", ANY_PORT, "--backend", ANY_PORT]
    if popen.keys() - {"env"}:
        return subprocess.Popen(cmd, cwd=ROOT, **popen)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **popen)


def hdf5_reference(prompt, end):
    """What predict must write after `prompt` in a row of the HDF5 layout above."""
    eng = Engine(tiny("llama", "float32"), EngineConfig(max_batch_size=2, max_batch_tokens=64))
    n = min(MAX_TOKENS, SEQ - len(prompt))
    return eng.generate([prompt], SamplingParams(max_tokens=n, temperature=0, stop_token_ids=[end],
                                                 ignore_eos=True))[0].outputs[0].token_ids


def hdf5_setup(tmp_path, rows, end):
    """An HDF5 input of `rows` and a params file predicting it with tiny Llama, batches of 3."""
    data = tmp_path / "data"
    data.mkdir()
    arr = np.full((len(rows), SEQ), START, dtype=np.int32)
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    with h5py.File(data / "prompts.h5", "w") as f:
        f["data"] = arr
    params = {"variants": {"llama": {
        "model": {"source": "tiny:llama", "dtype": "float32", "start_token": [START, 501], "end_token": [end, 99999],
                  "max_tokens": MAX_TOKENS, "temperature": 0.0, "max_batch_size": 8, "max_batch_tokens": 64},
        "inference_input": {"data_processor": "GptHDF5MapDataProcessor", "data_dir": str(data), "batch_size": 3}}},
        "runconfig": {"threads_per_worker": 1}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))


def hdf5_command(tmp_path) -> list[str]:
    """run_mm.py predicting hdf5_setup's input with two copies."""
    return [*command(CLI), "--mode", "predict", "--params", str(tmp_path / "p.yaml"), "--variants", "llama,2",
            "--model_dir", str(tmp_path / "md"), "--devices", "cpu", "--frontend", ANY_PORT, "--backend", ANY_PORT]


def hdf5_predict(tmp_path):
    return subprocess.run(hdf5_command(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=300)


def same_choices(got: list[dict], want: list[dict]) -> None:
    for g, w in zip(got, want, strict=True):
        assert (g["text"], g["index"], g["finish_reason"]) == (w["text"], w["index"], w["finish_reason"])
        if w["logprobs"] is None:
            assert g["logprobs"] is None
            continue
        gl, wl = g["logprobs"], w["logprobs"]
        assert gl["tokens"] == wl["tokens"] and gl["text_offset"] == wl["text_offset"]
        assert [x is None for x in gl["token_logprobs"]] == [x is None for x in wl["token_logprobs"]]
        assert np.allclose([x for x in gl["token_logprobs"] if x is not None],
                           [x for x in wl["token_logprobs"] if x is not None], atol=1e-4)
        for gt, wt in zip(gl["top_logprobs"], wl["top_logprobs"], strict=True):
            assert (gt is None) == (wt is None)
            if wt is not None:
                assert gt.keys() == wt.keys() and np.allclose([gt[k] for k in wt], list(wt.values()), atol=1e-4)
