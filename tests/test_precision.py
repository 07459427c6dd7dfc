"""What the engine decides from the CPU's capability (workers.capability, workers.precision), and
the 16-bit-weights, float32-math path it picks where the CPU has no bf16 arithmetic: exact
against transformers' float32 forward on the same rounded weights."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.models import hf_greedy, tiny

from workers import files
from workers.capability import AVX2_ENV, ISA_ENV, cpu_capability, decide
from workers.engine import Engine, EngineConfig
from workers.engine.cpu import extension
from workers.engine.params import SamplingParams
from workers.models import load_model
from workers.platform import CpuPlatform, CudaPlatform, weights_dtype
from workers.precision import FP16, FUSED, ONEDNN, PLAIN, Precision

ROOT = Path(__file__).resolve().parents[1]
ZEN3 = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2".split())
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}
SKYLAKE = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}
FP16_GEMM = pytest.mark.skipif(not cpu_capability().fp16_gemm, reason="FBGEMM's fp16 linear is not available")


def test_levels_follow_the_flags_and_the_switch_caps_them():
    assert decide(ZEN3, None, "x86_64").level == "avx2"
    zen3 = decide(ZEN3, None, "x86_64")
    assert not zen3.bf16_arith and not zen3.onednn_bf16 and zen3.cflags == ("-march=native",)
    assert decide(SKYLAKE, None, "x86_64").level == "avx512"
    zen4 = decide(ZEN4, None, "x86_64")
    assert zen4.level == "avx512_bf16" and zen4.bf16_arith and not zen4.capped
    capped = decide(ZEN4, "avx2", "x86_64")
    assert (capped.level, capped.native, capped.capped) == ("avx2", "avx512_bf16", True)
    assert not capped.bf16_arith and not capped.onednn_bf16
    assert capped.cflags[0] == "-march=x86-64-v3" and capped.tag() != zen4.tag()
    assert decide(ZEN3, "avx512_bf16", "x86_64").level == "avx2"  # a cap never raises the level
    assert decide(ZEN4, "native", "x86_64").level == "avx512_bf16"
    assert decide(frozenset({"sse2"}), None, "x86_64").level == "baseline"
    # AMX is a level above AVX512-BF16, and capped to it an AMX CPU builds for one without AMX
    spr = decide(SAPPHIRE_RAPIDS, None, "x86_64")
    assert spr.level == "amx" and spr.bf16_arith and spr.at_least("avx512_bf16")
    no_amx = decide(SAPPHIRE_RAPIDS, "avx512_bf16", "x86_64")
    assert (no_amx.level, no_amx.capped, no_amx.bf16_arith) == ("avx512_bf16", True, True)
    assert no_amx.cflags[0] == "-march=cooperlake" and no_amx.tag() != spr.tag()
    with pytest.raises(ValueError, match=ISA_ENV):
        decide(ZEN4, "avx3", "x86_64")


def test_the_dtypes_each_cpu_kind_serves():
    cap = cpu_capability()
    assert weights_dtype("auto", "cuda") == torch.bfloat16
    assert weights_dtype("float32", "cpu", lean=True) == torch.float32
    auto_lean = weights_dtype("auto", "cpu", lean=True)
    if cap.bf16_arith:
        assert auto_lean == torch.bfloat16 and CpuPlatform.compute(auto_lean, True) == Precision(
            torch.bfloat16, torch.bfloat16, ONEDNN)
    else:
        # no bf16 arithmetic: 16-bit weights (half the bytes a decode step reads), float32 math
        assert auto_lean == (torch.float16 if cap.fp16_gemm else torch.float32)
        assert weights_dtype("auto", "cpu", lean=False) == torch.float32
        if not cap.onednn_bf16 and cap.fp16_gemm:
            assert CpuPlatform.compute(torch.bfloat16, True) == Precision(torch.bfloat16, torch.float32, FP16)
    # transformers' own modules compute in their weights' dtype, wherever they run
    assert CpuPlatform.compute(torch.bfloat16, False) == Precision(torch.bfloat16, torch.bfloat16, PLAIN)
    assert CudaPlatform.compute(torch.float16, False) == Precision(torch.float16, torch.float16, PLAIN)
    # a GPU's lean forward: fused copies of q/k/v and gate/up in the weights' dtype
    assert CudaPlatform.compute(torch.float16, True) == Precision(torch.float16, torch.float16, FUSED)
    assert CpuPlatform.compute(torch.float32, True).linears == ONEDNN


@FP16_GEMM
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_weights_with_float32_math_equal_transformers_float32_on_the_same_weights(dtype, arch):
    """The lean forward over 16-bit weights computing in float32 (auto on a CPU without bf16
    arithmetic; bfloat16 where oneDNN has no bf16 path; float16 anywhere): greedy tokens equal
    transformers' float32 forward on the same rounded weights, token for token. Gemma 3's prompts
    run past its sliding window (32)."""
    lm = tiny(arch, dtype=dtype)
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=32))
    mixed = eng.precision.mixed
    if dtype == "bfloat16" and cpu_capability().onednn_bf16:
        assert not mixed and eng.precision.compute == torch.bfloat16  # oneDNN's bf16: the test's point is elsewhere
        return
    assert mixed and eng.precision == Precision(lm.dtype, torch.float32, FP16)
    assert eng.runner.cache.keys.dtype == torch.float32
    linears = sum(m.weight.numel() for m in lm.model.modules() if isinstance(m, torch.nn.Linear))
    assert eng.runner.lean.own_bytes == 2 * linears  # FBGEMM's float16 copies
    reference = copy.deepcopy(lm.model).float()
    for m in reference.modules():  # the weights as FBGEMM holds them: float16 values
        if isinstance(m, torch.nn.Linear):
            m.weight.data = m.weight.data.half().float()
    prompts = [[(7 * i + j) % 300 + 1 for j in range(n)] for i, n in enumerate((1, 9, 50, 70))]
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(reference, p, 12)


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16", "float16"])
def test_the_plan_expects_the_precision_and_forward_that_the_engine_picks(dtype):
    """Gemma 3's lean forward computes only in float32: where its weights would compute in
    bfloat16 (AVX512-BF16 or AMX), it runs transformers' modules, packs nothing, and the plan counts
    no packed linears for it."""
    from fusion.plan import planned_precision

    for arch in ("llama", "gemma3", "gpt2"):
        eng = Engine(load_model(f"tiny:{arch}", dtype=dtype), EngineConfig(max_batch_size=2, max_batch_tokens=16))
        assert planned_precision(f"tiny:{arch}", dtype, "cpu", True) == eng.precision, arch
        lean = eng.runner.lean is not None
        assert lean == (arch == "llama" or (arch == "gemma3" and eng.precision.compute == torch.float32)), arch


@pytest.mark.any_isa
def test_the_switch_builds_and_decides_as_an_avx2_cpu():
    """MMFUSION_CPU_ISA=avx2 (with torch's and its libraries' switches) in a process of its own: the
    kernels build for x86-64-v3 with the AVX2 paths and without the AVX512-BF16 ones, bfloat16 is not prepacked for
    oneDNN, and auto keeps float16 weights for the lean forward."""
    if not cpu_capability().at_least("avx2"):
        pytest.skip(f"this CPU is below AVX2 ({cpu_capability().native})")
    code = ("import json, torch\n"
            "from workers.capability import cpu_capability\n"
            "from workers.engine.cpu import extension\n"
            "from workers.precision import onednn_packs\n"
            "from workers.platform import load_dtype\n"
            "c = cpu_capability()\n"
            "print(json.dumps({'level': c.level, 'paths': extension.kernel_paths(), 'error': extension.build_error(),"
            " 'pack_bf16': onednn_packs(torch.bfloat16), 'cflags': list(c.cflags),"
            " 'auto': str(load_dtype('auto', 'cpu', True, 'tiny:llama'))}))\n")
    env = {**os.environ, **AVX2_ENV, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["level"] == "avx2" and got["error"] is None and got["paths"] == ["generic", "f32_avx2"]
    # a CPU whose own level is AVX2 builds for itself; a higher one, capped, for x86-64-v3
    march = "-march=native" if cpu_capability().native == "avx2" else "-march=x86-64-v3"
    assert got["cflags"][0] == march and not got["pack_bf16"]
    assert got["auto"] == ("torch.float16" if cpu_capability().fp16_gemm else "torch.float32")
    # this process's own build is for its own level, in another cache entry
    assert ("bf16_avx512" in extension.kernel_paths()) == cpu_capability().bf16_arith


@pytest.mark.slow
@pytest.mark.avx2
@FP16_GEMM
def test_smollm2_in_bfloat16_without_bf16_arithmetic_equals_transformers_on_its_weights(smollm2_fp32):
    """`dtype: bfloat16` on a CPU whose oneDNN has no bf16 path (AVX2): SmolLM2 loads, keeps its
    bfloat16 weights and computes in float32; its greedy tokens equal transformers' float32
    forward on the same weights, token for token."""
    from support.models import real_batch_prompts

    from workers.models import load_model

    if cpu_capability().onednn_bf16:
        pytest.skip("oneDNN has a bf16 path here: bfloat16 computes in bfloat16 (tests/test_lean.py's bf16 tests)")
    lm = load_model("smollm2-135m", dtype="bfloat16")
    # the 16-bit linears (`quantization: auto` would run the file's int4 blocks: tests/test_quantized.py)
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=96, quantization="none"))
    assert eng.precision == Precision(torch.bfloat16, torch.float32, FP16)
    reference = copy.deepcopy(lm.model).float()
    for m in reference.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight.data = m.weight.data.half().float()
    prompts = real_batch_prompts(lm)[:4]
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(reference, p, 12)


def test_the_long_prompt_price_is_measured_on_this_machine():
    """attention_span (what a position of a long prompt's attention costs, in tokens' linears) is
    measured at load on the attention path that serves; where every layer is windowed there is
    nothing to measure and the model's shapes give it."""
    from workers.engine.cpu import calibrate
    from workers.engine.runners.base import estimated_attention_span

    lm = tiny("llama", dtype="float32")
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=32))
    measured = eng.runner.measured_attention_span()
    assert measured is not None and calibrate.SPAN_LIMITS[0] <= measured <= calibrate.SPAN_LIMITS[1]
    assert eng.attention_span == min(measured, estimated_attention_span(lm)) and eng.runner.holder.current is None
    assert eng.scheduler.config.attention_span == eng.attention_span
    windowed = tiny("mistral", dtype="float32")  # a sliding window on every layer
    eng = Engine(windowed, EngineConfig(max_batch_size=4, max_batch_tokens=32))
    assert eng.runner.measured_attention_span() is None and eng.attention_span == estimated_attention_span(windowed)


def test_the_measured_price_is_kept_for_the_next_load(tmp_path, monkeypatch):
    """The measurement is a large part of a warm reload: it is kept in the cache under a key of all
    it depends on, read back by the next load with that key, and measured again for another key
    or when the kept file is unreadable."""
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path))
    calls = []

    def measure(span):
        return lambda: calls.append(span) or span

    assert files.remembered("model a|float32|2 threads", measure(300)) == 300
    assert files.remembered("model a|float32|2 threads", measure(999)) == 300 and calls == [300]
    assert files.remembered("model a|float32|1 thread", measure(120)) == 120 and calls == [300, 120]
    for kept in (tmp_path / "calibration").iterdir():
        kept.write_text("{not json")
    assert files.remembered("model a|float32|2 threads", measure(310)) == 310 and calls == [300, 120, 310]
    lm = tiny("llama", dtype="float32")  # an engine's own key: its second load reads what its first measured
    first = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=32)).attention_span
    kept = sorted((tmp_path / "calibration").glob("*.json"))
    assert len(kept) == 3
    assert Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=32)).attention_span == first
    assert sorted((tmp_path / "calibration").glob("*.json")) == kept
