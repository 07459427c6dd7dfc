"""run_mm.py predict over JSONL, eval and compile_only, end to end: router, worker processes, files."""

from __future__ import annotations

import getpass
import json
import math
import subprocess
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from support.batch import START, run_mm, same_choices, tiny_variant, write_params
from support.cluster import ROOT
from support.models import plain_logits, tiny

from routing.entrypoints import CLI, command
from workers.completions import completion_result
from workers.engine import Engine, EngineConfig, compile_cache
from workers.request_params import sampling_params


def check_completion_object(res: dict, with_logprobs: list[bool]) -> None:
    """The shape of an OpenAI completions response, plus request_time."""
    assert res["id"].startswith("cmpl-") and res["object"] == "text_completion"
    assert isinstance(res["created"], int) and isinstance(res["model"], str)
    assert [c["index"] for c in res["choices"]] == list(range(len(res["choices"])))
    for c, lp in zip(res["choices"], with_logprobs, strict=True):
        assert isinstance(c["text"], str) and c["finish_reason"] in ("stop", "length")
        if not lp:
            assert c["logprobs"] is None
            continue
        block = c["logprobs"]
        assert set(block) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        n = len(block["tokens"])
        assert all(len(block[k]) == n for k in block) and n > 0
        assert all(isinstance(t, str) for t in block["tokens"])
        assert block["text_offset"] == sorted(block["text_offset"])
    u = res["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    rt = res["request_time"]
    assert rt["batch_time"] >= 0 and isinstance(rt["batch_size"], int) and rt["batch_size"] >= 1


REQUESTS = [
    {"prompt": "Hello there", "max_tokens": 5, "logprobs": 2},
    {"prompt": [5, 6, 7], "max_tokens": 4, "echo": True, "logprobs": 1},
    "this line is not JSON",
    {"prompt": "abc", "model": "gpt-4"},
    {"prompt": "abc", "model": "gpt2", "max_tokens": 3, "n": 2, "temperature": 0.7, "seed": 3, "logprobs": 0},
    {"prompt": "abc", "max_tokens": 3, "logprobs": 50},
    {"prompt": "The quick brown", "max_tokens": 8, "best_of": 3, "n": 1, "temperature": 1.0, "seed": 1},
    {"prompt": "stop me", "max_tokens": 12, "stop": ["STOP"], "logprobs": 0},
    {"prompt": [9, 8, 7, 6], "engine": "gpt2", "max_tokens": 6, "echo": True},
    {"prompt": "abc", "max_tokens": 3, "seed": 2**70},  # beyond what the wire carries: that line's error
    # OpenAI's Batch API form: its body served, the line echoed whole (its custom_id)
    {"custom_id": "r-10", "method": "POST", "url": "/v1/completions",
     "body": {"model": "gpt2", "prompt": "batch form", "max_tokens": 4, "logprobs": 1}},
]


def test_predict_jsonl_matches_the_engine_in_process(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    reqs = [dict(r) if isinstance(r, dict) else r for r in REQUESTS]
    # a stop string that greedy generation really produces, so that the cut is exercised
    ref = Engine(tiny("llama", "float32")).generate(["stop me"], sampling_params({"max_tokens": 12},
                                                                                {"temperature": 0.0})[0])[0]
    text = ref.outputs[0].text
    stop = next(text[i: i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i: i + 2])
    reqs[7]["stop"] = [stop]
    (data / "req.jsonl").write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in reqs) + "\n")
    params = write_params(tmp_path, {"llama": tiny_variant("llama", "JsonlCompletions", data),
                                     "gpt2": tiny_variant("gpt2", "JsonlCompletions", data)})
    out = run_mm(params, "predict", ["llama,1", "gpt2,1"], tmp_path / "md")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in (tmp_path / "md" / "predictions" / "output_req.jsonl").read_text().splitlines()]
    assert len(lines) == len(reqs) and [ln["request"] for ln in lines] == reqs  # input order, request echoed
    errors = {i: ln["error"] for i, ln in enumerate(lines) if "error" in ln}
    assert sorted(errors) == [2, 3, 5, 9]
    assert errors[9]["code"] == "bad_request" and "params.seed is out of range" in errors[9]["message"]
    assert errors[2]["message"].startswith("req.jsonl line 3: not valid JSON")
    assert "unknown model 'gpt-4'" in errors[3]["message"]
    assert errors[5]["code"] == "bad_request" and "logprobs must be an integer in [0, 20]" in errors[5]["message"]
    engines = {arch: Engine(tiny(arch, "float32"), EngineConfig(max_batch_size=8)) for arch in ("llama", "gpt2")}
    for i, (line, ln) in enumerate(zip(reqs, lines)):
        if i in errors:
            continue
        req = line.get("body", line)
        res = ln["result"]
        variant = req.get("model") or req.get("engine") or "llama"
        assert res["model"] == variant
        params_, echo = sampling_params({k: v for k, v in req.items() if k != "prompt"}, {"temperature": 0.0})
        eng = engines[variant]
        want = completion_result(eng.generate([req["prompt"]], params_)[0], variant, eng.tokenizer, echo,
                                 params_.logprobs is not None)
        check_completion_object(res, [params_.logprobs is not None] * params_.n)
        same_choices(res["choices"], want["choices"])
        assert res["usage"] == want["usage"]
    cut = lines[7]["result"]["choices"][0]
    assert cut["finish_reason"] == "stop" and stop not in cut["text"] and text.startswith(cut["text"])
    assert lines[1]["result"]["choices"][0]["logprobs"]["token_logprobs"][0] is None  # echo: first prompt token
    assert len(lines[4]["result"]["choices"]) == 2 and len(lines[6]["result"]["choices"]) == 1


def test_eval_matches_plain_forward_logprobs(tmp_path):
    jdir, hdir = tmp_path / "jsonl", tmp_path / "h5"
    jdir.mkdir()
    hdir.mkdir()
    (jdir / "a.jsonl").write_text('{"prompt": "Some text to score"}\n{"prompt": "x"}\nnot json\n'
                                  '{"prompt": [3, 4, 5, 6], "model": "elsewhere"}\n')
    rows = [[7, 8, 9, 10, 11], [12, 13, 14]]
    arr = np.full((2, 8), START, dtype=np.int32)
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    with h5py.File(hdir / "p.h5", "w") as f:
        f["data"] = arr
    params = write_params(tmp_path, {"llama": tiny_variant("llama", "JsonlCompletions", jdir),
                                     "gpt2": tiny_variant("gpt2", "GptHDF5MapDataProcessor", hdir, start_token=START)})
    out = run_mm(params, "eval", ["llama,1", "gpt2,1"], tmp_path / "md")
    assert out.returncode == 0, out.stderr
    assert "terminate called" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "perplexity" in out.stdout
    for name, prompts in (("llama", ["Some text to score", "x", None, [3, 4, 5, 6]]), ("gpt2", rows)):
        rep = json.loads((tmp_path / "md" / "eval" / f"{name}.json").read_text())
        lm = tiny(name, "float32")
        all_lp = []
        assert rep["samples"] == len(prompts)
        for prompt, s in zip(prompts, rep["per_sample"], strict=True):
            if prompt is None:
                assert "not valid JSON" in s["error"]
                continue
            ids = lm.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
            logp = torch.log_softmax(plain_logits(lm.model, ids), -1)
            want = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
            assert s["token_logprobs"][0] is None and np.allclose(s["token_logprobs"][1:], want, atol=1e-4)
            if want:
                assert math.isclose(s["perplexity"], math.exp(-sum(want) / len(want)), rel_tol=1e-4)
            else:
                assert s["perplexity"] is None  # one token: nothing to score
            all_lp += want
        assert rep["scored_tokens"] == len(all_lp)
        assert math.isclose(rep["perplexity"], math.exp(-sum(all_lp) / len(all_lp)), rel_tol=1e-4)


def test_compile_only_compiles_reports_memory_and_predict_starts_from_it(tmp_path):
    import os

    data = tmp_path / "data"
    data.mkdir()
    (data / "r.jsonl").write_text('{"prompt": "one"}\n{"prompt": "two two"}\n')
    params = write_params(tmp_path, {"llama": tiny_variant("llama", "JsonlCompletions", data, batch_size=5,
                                                           max_tokens=7, compile_buckets=[48],
                                                           max_batch_size=5, max_batch_tokens=48,
                                                           prepack_weights=False)})
    # inductor's cache where the deployment puts it when the user names none: under the project's
    # cache, in its CPU level's directory. That directory is the suite's own inductor cache, linked
    # there: its kernels for this graph and its precompiled headers (150 MB, seconds to build) are
    # built once in the suite (test_compiled checks that the headers go into inductor's directory)
    env = {**{k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"},
           "MMFUSION_CACHE": str(tmp_path / "cache")}
    inductor = compile_cache.inductor_dir(tmp_path / "cache")
    inductor.parent.mkdir()
    inductor.symlink_to(os.environ["TORCHINDUCTOR_CACHE_DIR"], target_is_directory=True)
    torch_default = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    was_there = torch_default.exists()
    out = run_mm(params, "compile_only", ["llama,2"], tmp_path / "md", env=env)
    assert out.returncode == 0, out.stderr
    # nothing in /tmp: inductor's cache and its precompiled headers are in the project's cache
    assert list(inductor.glob("precompiled_headers/*.gch"))
    assert was_there or not torch_default.exists()
    recs = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    rep, dev = recs
    assert rep["variant"] == "llama" and rep["fits"] and rep["error"] is None
    assert rep["batch_size"] == 5 and rep["tokens_generated"] == 5 * 7  # a short file is repeated to fill it
    assert rep["measured_bytes"] > 0 and rep["load_s"] > 0 and rep["load_s_before_cache"] is None
    # the two copies map one set of weights: the device counts them once
    assert rep["shared_weights"] and rep["weight_bytes"] > 0
    assert dev == {"device": "cpu", "workers": 2, "measured_bytes": 2 * rep["measured_bytes"] - rep["weight_bytes"],
                   "available_bytes": dev["available_bytes"], "fits": True}
    compiled = rep["compile"]
    assert compiled["compiled"] and compiled["buckets"] == [48] and compiled["cache"].startswith(str(tmp_path))
    assert (Path(compiled["cache"]) / "artifacts.bin").is_file()
    # predict (compile: auto) starts both workers from the artifacts, and answers as eagerly
    pred = run_mm(params, "predict", ["llama,2"], tmp_path / "md", env=env)
    assert pred.returncode == 0, pred.stderr
    assert pred.stderr.count(f"forward loaded from {compiled['cache']}") == 2, pred.stderr[-3000:]
    got = [json.loads(x)["result"] for x in (tmp_path / "md" / "predictions" / "output_r.jsonl").read_text()
           .splitlines()]
    eng = Engine(tiny("llama", "float32"), EngineConfig(compile=False))
    for res, prompt in zip(got, ["one", "two two"], strict=True):
        params_, echo = sampling_params({"max_tokens": 7}, {"temperature": 0.0})
        want = completion_result(eng.generate([prompt], params_)[0], "llama", eng.tokenizer, echo, False)
        same_choices(res["choices"], want["choices"])


def test_compile_only_names_bad_data(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    params = write_params(tmp_path, {"llama": tiny_variant("llama", "JsonlCompletions", data)})
    out = run_mm(params, "compile_only", ["llama,1"], tmp_path / "md")
    assert out.returncode == 2 and f"data_dir {data} holds no .jsonl file" in out.stderr
    bare = write_params(tmp_path, {"llama": {"model": {"source": "tiny:llama", "dtype": "float32"}}})
    out = run_mm(bare, "compile_only", ["llama,1"], tmp_path / "md")
    assert out.returncode == 2 and "variant 'llama' has no inference_input: compile_only runs one batch" in out.stderr


@pytest.mark.parametrize("mode", ["predict", "eval"])
def test_an_output_directory_that_cannot_be_is_refused_before_any_load(tmp_path, mode):
    data = tmp_path / "data"
    data.mkdir()
    (data / "req.jsonl").write_text(json.dumps({"prompt": "Hello", "max_tokens": 2}) + "\n")
    params = write_params(tmp_path, {"llama": tiny_variant("llama", "JsonlCompletions", data)})
    (tmp_path / "a_file").write_text("")
    out = run_mm(params, mode, ["llama,1"], tmp_path / "a_file" / "md")
    assert out.returncode == 2, out.stderr
    assert f"model_dir {tmp_path / 'a_file' / 'md'}: cannot write there (Not a directory)" in out.stderr
    assert "Traceback" not in out.stderr and "worker" not in out.stdout


@pytest.mark.slow
def test_compile_only_caches_gguf_as_safetensors(tmp_path, monkeypatch, smollm2_fp32):
    import os

    from workers.models import load_model
    from workers.weights.sources import gguf_cache_dir, source_gguf

    data = tmp_path / "data"
    data.mkdir()
    (data / "r.jsonl").write_text('{"prompt": "The capital of France is"}\n')
    params = write_params(tmp_path, {"smollm2": {
        # compile: false: this test is about the GGUF cache (compiling is test_compiled's and the one above)
        "model": {"source": "smollm2-135m", "dtype": "bfloat16", "max_tokens": 4, "compile": False},
        "inference_input": {"data_processor": "JsonlCompletions", "data_dir": str(data), "batch_size": 2}}})
    env = {**os.environ, "MMFUSION_CACHE": str(tmp_path / "cache")}
    cmd = [*command(CLI), "--mode", "compile_only", "--params", str(params), "--variants", "smollm2,1"]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr
    rep = [json.loads(x) for x in first.stdout.splitlines() if x.startswith("{")][0]
    assert rep["fits"] and rep["load_s_before_cache"] > rep["load_s"] and rep["cache"].startswith(str(tmp_path))
    assert (Path(rep["cache"]) / "model.safetensors").exists()
    # the next compile_only or worker finds the cache (compile_only then converts nothing: the
    # test above covers a run with nothing to convert), and loading from it gives what the GGUF
    # gives: the same weights, bit for bit, and the same tokens
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path / "cache"))
    assert str(gguf_cache_dir(source_gguf("smollm2-135m"))) == rep["cache"]
    cached = load_model("smollm2-135m", dtype="float32")
    mine, theirs = cached.model.state_dict(), smollm2_fp32.model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    prompt = "The capital of France is"
    assert cached.tokenizer(prompt).input_ids == smollm2_fp32.tokenizer(prompt).input_ids


def test_a_model_that_cannot_load_is_an_error_not_a_hang(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "r.jsonl").write_text('{"prompt": "one"}\n')
    variant = tiny_variant("llama", "JsonlCompletions", data)
    variant["model"]["source"] = "no-such-model"
    params = write_params(tmp_path, {"llama": variant})
    for mode in ("predict", "compile_only"):  # named before any worker starts
        out = run_mm(params, mode, ["llama,1"], tmp_path / "md", timeout=120)
        assert out.returncode == 2 and out.stderr.strip().startswith("error: unknown model source 'no-such-model'")
    broken = tmp_path / "broken"  # a model directory whose load fails in the worker
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    variant["model"]["source"] = str(broken)
    params = write_params(tmp_path, {"llama": variant})
    out = run_mm(params, "predict", ["llama,1"], tmp_path / "md", timeout=120)
    assert out.returncode == 1 and "could not load model 0: " in out.stderr, out.stderr[-2000:]
