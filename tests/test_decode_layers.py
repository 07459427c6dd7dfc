"""Decode steps through the lean forward's layers in one C++ call (workers.engine.cpu.decode_layers):
the same kernels in the same order as the layer loop in Python, so the same tokens and the same
log-probabilities bit for bit, in each family (Llama, Mistral's window, Qwen 2's biases, Gemma 3's
norms, GELU and sliding layers), dtype and weight kind it serves; and the linears it does not serve
keep the loop in Python."""

from __future__ import annotations

import random

import pytest
import torch
from support.models import tiny

from workers.capability import cpu_capability
from workers.engine import Engine, EngineConfig
from workers.engine.cpu.decode_layers import FusedDecode, kernel_linear
from workers.engine.cpu.linears import pack_for_tiles, tiles_fit
from workers.engine.cpu.row_kernels import PACKED, RowChoice
from workers.engine.params import SamplingParams


def _with_biases(lm):
    """Qwen 2's q/k/v biases drawn at random (its initialisation zeroes them)."""
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    return lm


def _answers(eng: Engine, vocab: int) -> list[tuple[list[int], list[float]]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(5, 40))] for _ in range(5)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in eng.generate(prompts, [params] * len(prompts))]


@pytest.mark.parametrize("arch,dtype,quantization,deterministic", [
    ("llama", "bfloat16", "int4", False), ("llama", "float32", "int8", False), ("llama", "float32", "int4", False),
    ("mistral", "float32", "int4", False), ("qwen2", "float32", "int8", False), ("gemma3", "float32", "int8", False),
    ("gemma3", "float32", "int4", False), ("llama", "bfloat16", "none", True), ("llama", "float32", "none", True),
    ("gemma3", "float32", "none", True)])
def test_decode_steps_in_one_call_give_the_loops_answers_bit_for_bit(arch, dtype, quantization, deterministic):
    lm = _with_biases(tiny(arch, dtype=dtype))

    def engine() -> Engine:
        eng = Engine(lm, EngineConfig(max_batch_size=8, max_batch_tokens=64, quantization=quantization,
                                      deterministic=deterministic))
        # every row count on the blocks, as the fused call multiplies them (a CPU whose measurement
        # gave the many-rows ways a few rows would send those steps to the loop: not this test's point)
        lean = eng.runner.lean
        for lin in lean.linears():
            lin.rows = None
        lean.decode_layers = lean.fused_decode()
        return eng

    fused = engine()
    lean = fused.runner.lean
    # dense weights join it through the C++ strips of `deterministic`, built at AVX2 and above;
    # below, their tiles of rows keep the loop
    if quantization == "none" and not cpu_capability().at_least("avx2"):
        assert lean.decode_layers.layers is None
        return
    assert lean.decode_layers.layers is not None and len(lean.decode_layers.layers) == len(lean.layers)
    got = _answers(fused, lm.vocab_size)
    assert lean.decode_layers._position is not None  # decode steps went through it
    loop = engine()
    loop.runner.lean.decode_layers = FusedDecode()
    want = _answers(loop, lm.vocab_size)
    assert all(len(t) == 16 and None not in lp for t, lp in want)
    assert got == want


def test_packed_linears_keep_the_loop_in_python():
    for arch, quantization in (("llama", "none"), ("gemma3", "none")):
        lm = tiny(arch, dtype="float32")
        eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, quantization=quantization))
        assert eng.runner.lean.decode_layers.layers is None, arch
        assert all(len(t) == 16 for t, _ in _answers(eng, lm.vocab_size))


def test_a_layer_linear_outside_the_kernels_keeps_the_loop():
    lm = tiny("llama", dtype="float32")
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, quantization="int8"))
    lean = eng.runner.lean
    lean.layers[1].down.rows_per_call = 16  # tiles of rows: only the Python loop takes them
    assert FusedDecode.of(lean, lean.norms).layers is None
    x = torch.randn(3, lean.hidden)
    lin = lean.layers[0].qkv
    assert torch.equal(kernel_linear(lin, lean.norms)(x), lin(x))


def test_qwen2s_biases_in_the_lean_forward_give_transformers_greedy():
    from support.models import hf_greedy

    lm = _with_biases(tiny("qwen2", dtype="float32"))
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64))
    assert eng.runner.lean is not None and eng.runner.lean.layers[0].qkv.bias is not None
    prompts = [[4, 5, 6, 7], [9] * 6, [200, 3]]
    outs = eng.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(lm.model, p, 10)


def test_decode_steps_on_the_amx_tiles_in_one_call_give_the_loops_answers_bit_for_bit():
    """Where a layer linear's choice takes the packed values (AMX tiles, or vdpbf16ps without them) from
    some rows on, the one-call decode takes them from the same rows (KernelLinear's packed_from): its answers equal the loop's."""
    lm = tiny("llama", dtype="bfloat16")

    def engine(fused: bool) -> Engine:
        eng = Engine(lm, EngineConfig(max_batch_size=8, max_batch_tokens=64, quantization="int4"))
        lean = eng.runner.lean
        if not tiles_fit(lean.norms):
            pytest.skip("this CPU has no bfloat16 dot products for the packed values (AMX or AVX512-BF16), or the level is capped below them")
        layer_linears = [x for layer in lean.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        packed = pack_for_tiles(lean.norms, {str(i): lin.quant for i, lin in enumerate(layer_linears)})
        for i, lin in enumerate(layer_linears):
            lin.rows, lin.packed16 = RowChoice(3, PACKED), packed[str(i)]
        lean.decode_layers = lean.fused_decode() if fused else FusedDecode()
        return eng

    fused = engine(True)
    got = _answers(fused, lm.vocab_size)
    assert fused.runner.lean.decode_layers._position is not None  # decode steps of 1 to 5 rows went through it
    assert got == _answers(engine(False), lm.vocab_size)


def test_decode_steps_with_8_bit_activations_in_one_call_give_the_loops_answers_bit_for_bit():
    """Where a layer linear's blocks take the 8-bit activations at a few rows (row_kernels.ACT8), the
    one-call decode takes them too (KernelLinear's act8): its answers equal the loop's, and differ
    from those of the compute dtype's activations. A bfloat16 model computes in bfloat16 where the
    CPU has bf16 arithmetic (the AVX512-VNNI path) and in float32 under the AVX2 switch (the AVX2 path)."""
    lm = tiny("llama", dtype="bfloat16")

    def engine(fused: bool, act8: bool) -> Engine:
        eng = Engine(lm, EngineConfig(max_batch_size=8, max_batch_tokens=64, quantization="int4"))
        lean = eng.runner.lean
        compute = str(eng.precision.compute).removeprefix("torch.")
        if compute not in lean.norms.act8_dtypes():
            pytest.skip(f"no 8-bit activations' path for {compute} at this CPU level ({lean.norms.act8_dtypes()})")
        for lin in lean.linears():
            lin.rows = RowChoice(act8=4 if act8 else 0)  # every row count on the blocks
        lean.decode_layers = lean.fused_decode() if fused else FusedDecode()
        return eng

    fused = engine(True, True)
    got = _answers(fused, lm.vocab_size)
    assert fused.runner.lean.decode_layers._position is not None
    assert got == _answers(engine(False, True), lm.vocab_size)
    assert got != _answers(engine(True, False), lm.vocab_size)
