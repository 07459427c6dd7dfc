"""A GGUF file's shared weights written a tensor at a time (workers.weights.gguf_stream): the same
bytes, config and tokenizer as transformers' whole load gives, and the load that uses it."""

from __future__ import annotations

import json

import pytest
import torch

from workers.models import load_model
from workers.weights import shared
from workers.weights.gguf_stream import NotStreamable, gguf_writer, write_gguf_shared
from workers.weights.hf_loader import load_private
from workers.weights.sources import embedded_gguf


def _same_directory(a, b) -> None:
    ta, ma = shared.map_tensors(a / shared.WEIGHTS_FILE)
    tb, mb = shared.map_tensors(b / shared.WEIGHTS_FILE)
    assert ma == mb and json.loads(ma["aliases"])  # the tied LM head stored once, both ways
    assert set(ta) == set(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and ta[name].shape == tb[name].shape, name
        assert torch.equal(ta[name].view(torch.uint8), tb[name].view(torch.uint8)), name
    for f in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert json.loads((a / f).read_text()) == json.loads((b / f).read_text()), f
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def _both_ways(tmp_path, source: str, dtype: torch.dtype):
    streamed, whole = tmp_path / "streamed", tmp_path / "whole"
    streamed.mkdir()
    tok = write_gguf_shared(embedded_gguf(source), dtype, streamed)
    model, tok_whole = load_private(source, dtype, use_cache=False)
    shared.publish(model, tok_whole, whole)
    return streamed, whole, (tok, tok_whole)


def test_smollm2_streamed_equals_transformers_whole_load(tmp_path):
    streamed, whole, (tok, tok_whole) = _both_ways(tmp_path, "smollm2-135m", torch.bfloat16)
    _same_directory(streamed, whole)
    assert tok("Once upon a time").input_ids == tok_whole("Once upon a time").input_ids


@pytest.mark.slow
def test_gemma3_streamed_equals_transformers_whole_load(tmp_path, gemma3_fp32):
    """Gemma's norms are stored as w + 1 (the processor takes 1 off), its embedding (262k rows) goes
    in slabs, and it computes in float32 from float16 weights under `auto`. The whole load is the
    session's, in float32 (a whole load in float16 rounds those very values: the SmolLM2 test above
    compares with one in the 16-bit dtype itself), so Gemma's 15 s of it run once in the suite."""
    streamed = tmp_path / "streamed"
    streamed.mkdir()
    write_gguf_shared(embedded_gguf("gemma3-270m"), torch.float16, streamed)
    tensors, meta = shared.map_tensors(streamed / shared.WEIGHTS_FILE)
    whole, aliases = shared.unique_tensors(gemma3_fp32.model)
    assert json.loads(meta["aliases"]) == aliases and aliases  # the tied LM head stored once, both ways
    assert set(tensors) == set(whole)
    for name, t in tensors.items():
        assert t.dtype == torch.float16 and torch.equal(t, whole[name].to(torch.float16)), name
    config = json.loads((streamed / "config.json").read_text())
    assert config["dtype"] == "float16" and config["model_type"] == gemma3_fp32.model.config.model_type


def test_a_first_shared_load_writes_the_file_tensor_by_tensor(tmp_path, monkeypatch):
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path / "cache"))
    source, dtype = "smollm2-135m", torch.bfloat16
    writer = gguf_writer(source, dtype)
    assert writer is not None  # no converted float32 cache in this empty one

    def whole():
        raise AssertionError("transformers' whole load ran where the file could be streamed")

    model, tok, info = shared.load_shared(source, dtype, whole, writer)
    assert info.shared and info.path.startswith(str(tmp_path / "cache"))
    assert all(not p.is_meta for p in model.parameters())
    lm = load_model(source, dtype="bfloat16", share_weights=True)  # attaches to the file just written
    assert lm.weights.path == info.path
    private = load_model(source, dtype="bfloat16", use_cache=False)  # transformers' whole load of the file
    copied = load_model(source, dtype="bfloat16")  # share_weights off: a copy of the shared file's tensors
    assert not copied.weights.shared
    mapped = {t.data_ptr() for t in lm.model.state_dict().values()}
    assert not mapped & {t.data_ptr() for t in copied.model.state_dict().values()}
    for name, a in lm.model.state_dict().items():
        assert torch.equal(a, private.model.state_dict()[name]), name
        assert torch.equal(a, copied.model.state_dict()[name]), name
    assert copied.model.lm_head.weight is copied.model.model.embed_tokens.weight  # tied stays tied


def test_a_file_that_cannot_be_streamed_loads_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path / "cache"))
    loaded = []

    def cannot(dest):
        (dest / "partial").write_text("left by a writer that gave up")
        raise NotStreamable("the GGUF file has no tensor for 1 of the model's")

    def whole():
        loaded.append(True)
        return load_private("tiny:llama", torch.float32)

    model, _, info = shared.load_shared("tiny:llama", torch.float32, whole, cannot)
    assert loaded and info.shared
    assert not (shared.shared_dir("tiny:llama", torch.float32) / "partial").exists()
    assert not [p for p in shared.shared_dir("tiny:llama", torch.float32).parent.iterdir()
                if p.name.startswith(".") and p.is_dir()]  # no temporary directory left


def test_writer_only_for_gguf_sources_without_a_converted_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path / "cache"))
    assert gguf_writer("tiny:llama", torch.float32) is None
    assert gguf_writer("smollm2-135m", torch.float32, use_cache=False) is not None
