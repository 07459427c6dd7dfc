"""lm-evaluation-harness against the gateway: `local-completions` through its Python API, with its
remote tokenizer (auto-detected on a model's own base URL), on a small multiple-choice task kept in
tests/data, offline. Every log-likelihood must equal a plain transformers forward pass."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from support.cluster import Deployment
from support.models import plain_logits, tiny

from routing.http.app import GatewaySettings
from routing.http.server import GatewayThread

DATA = Path(__file__).parent / "data" / "lm_eval"


@pytest.fixture(scope="module")
def gateway():
    d = Deployment(["llama,1", "gpt2,1"], num_workers=2)
    g = GatewayThread(GatewaySettings(router=d.frontend), "127.0.0.1", 0).start()
    yield g
    g.stop()
    d.close()


def test_lm_eval_local_completions_loglikelihoods_equal_a_plain_forward(gateway, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "tiny_mc.yaml").write_text((DATA / "tiny_mc.yaml").read_text().replace(
        "DATA_FILE", str(DATA / "tiny_mc.jsonl")))
    monkeypatch.chdir(tmp_path)  # lm_eval writes caches relative to the working directory
    out = lm_eval.simple_evaluate(
        model="local-completions",
        # the model's own base URL: the remote tokenizer it detects there is that model's
        model_args={"model": "gpt2", "base_url": f"{gateway.url}/models/gpt2/v1/completions",
                    "num_concurrent": 2, "max_retries": 1},
        tasks=["mmfusion_tiny_mc"], task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    samples = out["samples"]["mmfusion_tiny_mc"]
    assert len(samples) == 4
    lm = tiny("gpt2", "float32")
    scored = 0
    for s in samples:
        doc = s["doc"]
        for choice, (ll, _greedy) in zip(doc["choices"], [r[0] for r in s["resps"]], strict=True):
            ctx = lm.tokenizer(doc["question"], add_special_tokens=False).input_ids
            # lm_eval's default target delimiter, a space, goes between the question and the choice
            whole = lm.tokenizer(doc["question"] + " " + choice, add_special_tokens=False).input_ids
            logp = torch.log_softmax(plain_logits(lm.model, whole), -1)
            want = sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))
            assert math.isclose(ll, want, abs_tol=1e-3), (doc["question"], choice, ll, want)
            scored += 1
    assert scored == 11
    assert 0.0 <= out["results"]["mmfusion_tiny_mc"]["acc,none"] <= 1.0
