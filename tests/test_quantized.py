"""Weight-only quantized linears (workers.quant, kernels/qlinear.cpp, `quantization`): the C++
kernels against their float32 reference on every row count and dtype, a GGUF file's blocks kept bit
for bit, fresh quantization's error bound, and the engine's greedy tokens against transformers on
the same (dequantized) weights. Run again on the AVX2 path by `make test`."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from support.models import dequantized_reference, hf_greedy, tiny

from workers.engine import Engine, EngineConfig
from workers.engine.cpu import extension
from workers.engine.cpu.row_kernels import RowChoice
from workers.engine.params import SamplingParams
from workers.platform import for_source
from workers.quant.formats import BLOCK
from workers.quant.gguf import from_gguf_blocks
from workers.quant.weight import INT4, INT8, QuantizedWeight, concat, quantize
from workers.weights.gguf_blocks import _rows_order

KERNELS = extension.kernel_module()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason=f"no C++ kernels: {extension.build_error()}")


def _call(qw: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The format's own C++ kernel, named by its registry row."""
    return getattr(KERNELS, qw.format.cpu_kernel)(x, qw.qs, qw.scales, qw.offsets, bias)


@needs_kernels
@pytest.mark.parametrize("kind", [INT4, INT8])
@pytest.mark.parametrize("k", [32, 96, 576, 4160])
@pytest.mark.parametrize("n", [37, 80])
def test_kernel_equals_its_float32_reference(kind, k, n):
    """No rows (a prompt's chunk that keeps no logits), rows 1 to 9 (the four-row passes and their
    remainders), 13 (a batch: tiles of input rows), 30, 96 and 101 (bfloat16: packed strips where
    the output count is whole vectors, else from 96 rows the GEMM on widened weights); an output
    count that is no multiple of anything and one of five vectors (strips of 48 and a last one of
    32), rows of 1 to 130 blocks (the float32 passes convert a row's scales 128 blocks at a time), a
    bias, and float32, bfloat16 and float16 activations: the float32 product of the
    activations with the blocks' values, rounded once to the activations' dtype."""
    gen = torch.Generator().manual_seed(k)
    qw = quantize(torch.randn(n, k, generator=gen) * 0.1, kind)
    w = qw.dequantize()
    bias = torch.randn(n, generator=gen)
    for rows in (0, 1, 2, 3, 4, 5, 8, 9, 13, 30, 96, 101):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            for b in (None, bias):
                want = x.float() @ w.T + (0 if b is None else b)
                got = _call(qw, x, b)
                assert got.dtype == dtype and got.shape == (rows, n)
                if not rows:
                    continue
                scale = want.abs().max().item()
                tol = 1e-5 if dtype == torch.float32 else 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
                assert (got.float() - want).abs().max().item() <= tol * scale + 1e-6, (rows, dtype)


@needs_kernels
@pytest.mark.parametrize("kind", [INT4, INT8])
def test_kernel_panels_cover_every_output_row(kind):
    """A chunk's rows against more output rows than one widened panel holds (16 MiB: 2,048 rows of
    4,096 values in bfloat16, 1,024 in float32): every panel, the last one short, lands in its own
    columns with its own bias."""
    gen = torch.Generator().manual_seed(7)
    qw = quantize(torch.randn(4001, 4096, generator=gen) * 0.1, kind)
    w = qw.dequantize()
    bias = torch.randn(4001, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(100, 4096, generator=gen).to(dtype)
        want = x.float() @ w.T + bias
        got = _call(qw, x, bias)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        assert (got.float() - want).abs().max().item() <= tol * want.abs().max().item(), dtype


@needs_kernels
@pytest.mark.parametrize("kind", [INT4, INT8])
def test_one_float32_row_keeps_float32_precision(kind):
    """One float32 row against int4 (AVX2 and AVX-512) or int8 (AVX2) blocks runs in fixed point
    (two int16 halves a block of activations): a block of zeros, a block whose values span nine
    orders of magnitude, and signs mixed still give the product within float32's own error bound
    (k * 2^-24 of the sum of |w x|), each output row within it, against float64 math on the same
    values."""
    gen = torch.Generator().manual_seed(3)
    k = 1536
    qw = quantize(torch.randn(64, k, generator=gen) * 0.1, kind)
    w = qw.dequantize().double()
    x = torch.randn(1, k, generator=gen)
    x[0, 32:64] = 0.0
    x[0, 64:96] = torch.logspace(-5, 4, 32) * torch.where(torch.arange(32) % 2 == 0, 1.0, -1.0)
    got = _call(qw, x, None).double()
    want = x.double() @ w.T
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.abs().T)
    assert bool(((got - want).abs() <= bound).all()), ((got - want).abs() / bound).max().item()


def _act8_built(dtype: torch.dtype) -> bool:
    return KERNELS is not None and str(dtype).removeprefix("torch.") in KERNELS.act8_dtypes()


def _rounded_to_8_bits(x: torch.Tensor) -> torch.Tensor:
    """x's values as the act8 path rounds them, in its float32 steps: per block of 32, x * (127 /
    the block's largest magnitude) to the nearest integer (ties to even), times that magnitude / 127."""
    blocks = x.float().view(x.shape[0], -1, BLOCK)
    most = blocks.abs().amax(-1, keepdim=True)
    # a true division, as the kernel's (a scalar over a tensor is torch's reciprocal times 127)
    inv = torch.where(most > 0, torch.full_like(most, 127.0) / torch.where(most > 0, most, 1), 0)
    q = torch.round(blocks * inv)
    return (q.double() * (most / 127).double()).view(x.shape)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", [INT4, INT8])
@pytest.mark.parametrize("k", [32, 96, 576, 4160])
def test_act8_rows_are_the_products_of_8_bit_activations(kind, k, dtype):
    """`act8`, rows 1 to 4 (bfloat16 on AVX512-VNNI, float32 on AVX2): the products of the blocks'
    values with the activations rounded to 8 bits a block (_rounded_to_8_bits) in float64, to within
    the output's rounding and float32 sums; so within half a step a block of the exact product.
    Rows of 1 to 130 blocks (the AVX-512 kernels take 4 int4 or 2 int8 blocks a step: every
    remainder), an output count that is no multiple of 4, a bias, and a block of zeros. From 5
    rows, under `strips` and for rows of another dtype the flag changes nothing."""
    if not _act8_built(dtype):
        pytest.skip(f"no 8-bit activations' path for {dtype} in this build ({KERNELS.act8_dtypes()})")
    out_eps = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -23
    gen = torch.Generator().manual_seed(k + 1)
    n = 37
    qw = quantize(torch.randn(n, k, generator=gen) * 0.1, kind)
    w = qw.dequantize().double()
    bias = torch.randn(n, generator=gen)
    call = getattr(KERNELS, qw.format.cpu_kernel)
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        if k > BLOCK:
            x[0, :BLOCK] = 0
        for b in (None, bias):
            got = call(x, qw.qs, qw.scales, qw.offsets, b, False, 4).double()
            x8 = _rounded_to_8_bits(x)
            want = x8 @ w.T + (0 if b is None else b.double())
            sums = x8.abs() @ w.abs().T
            assert ((got - want).abs() <= out_eps * want.abs() + k * 2 ** -23 * sums + 1e-6).all(), (kind, k, rows)
            exact = x.double() @ w.T + (0 if b is None else b.double())
            step = (x.double() - x8).abs() @ w.abs().T  # what the rounding can move each output
            assert ((got - exact).abs() <= step + out_eps * exact.abs() + k * 2 ** -23 * sums + 1e-6).all()
            assert not torch.equal(got, call(x, qw.qs, qw.scales, qw.offsets, b).double())  # it did round
    other = torch.float16 if dtype == torch.float32 else torch.float32
    others = (torch.randn(2, k, generator=gen).to(other),) if not _act8_built(other) else ()
    for x in (torch.randn(5, k, generator=gen).to(dtype), *others):
        assert torch.equal(call(x, qw.qs, qw.scales, qw.offsets, bias, False, 4),
                           call(x, qw.qs, qw.scales, qw.offsets, bias))
    x = torch.randn(2, k, generator=gen).to(dtype)
    # act8 names the most rows it takes: 1 takes one row, not two
    assert torch.equal(call(x, qw.qs, qw.scales, qw.offsets, bias, False, 1), call(x, qw.qs, qw.scales, qw.offsets, bias))
    assert torch.equal(call(x[:1], qw.qs, qw.scales, qw.offsets, bias, False, 1),
                       call(x[:1], qw.qs, qw.scales, qw.offsets, bias, False, 4))
    assert torch.equal(call(x, qw.qs, qw.scales, qw.offsets, bias, True, 4),
                       call(x, qw.qs, qw.scales, qw.offsets, bias, True))


@needs_kernels
def test_kernel_refuses_what_it_cannot_take():
    qw = quantize(torch.randn(8, 64), INT4)
    with pytest.raises(RuntimeError, match="x must be"):
        _call(qw, torch.randn(2, 32), None)
    with pytest.raises(RuntimeError, match="bias must have 8"):
        _call(qw, torch.randn(2, 64), torch.randn(7))


def test_fresh_quantization_error_is_bounded():
    """Round to nearest on the float16-rounded scale: int8 within half a step of max|w|/127 a block,
    int4 within half a step of its range/15 (the scales' float16 rounding adds a little)."""
    w = torch.randn(64, 256) * 0.02
    blocks = w.view(64, -1, BLOCK)
    err8 = (quantize(w, INT8).dequantize() - w).abs().view(64, -1, BLOCK).amax(-1)
    assert bool((err8 <= blocks.abs().amax(-1) / 127 * 0.51 + 1e-7).all())
    err4 = (quantize(w, INT4).dequantize() - w).abs().view(64, -1, BLOCK).amax(-1)
    span = blocks.amax(-1) - blocks.amin(-1)
    assert bool((err4 <= span / 15 * 0.51 + span * 2e-3).all())
    zeros = quantize(torch.zeros(4, 32), INT4).dequantize()
    assert torch.equal(zeros, torch.zeros(4, 32))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_gguf_blocks_are_kept_bit_for_bit(type_name):
    """A GGUF tensor's blocks, read as they are, dequantize to gguf's own values exactly (what
    transformers loads); a row reordering moves whole rows."""
    from gguf import GGMLQuantizationType
    from gguf import quants as gq

    t = getattr(GGMLQuantizationType, type_name)
    w = (np.random.default_rng(0).standard_normal((12, 96)) * 0.05).astype(np.float32)
    raw = gq.quantize(w, t)
    qw = from_gguf_blocks(type_name, raw, (12, 96))
    assert qw.kind == (INT8 if type_name in ("Q5_0", "Q8_0") else INT4)
    want = torch.from_numpy(gq.dequantize(raw, t).astype(np.float32))
    assert torch.equal(qw.dequantize(), want)
    order = torch.tensor([3, 0, 11, 5, 1, 2, 4, 6, 7, 8, 9, 10])
    assert torch.equal(qw.rows(order).dequantize(), want[order])
    both = concat([qw, qw.rows(order)])
    assert torch.equal(both.dequantize(), torch.cat([want, want[order]]))
    with pytest.raises(ValueError, match="not kept"):
        from_gguf_blocks("Q6_K", raw, (12, 96))


def test_rows_order_is_transformers_reverse_permutation():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    n, heads = 48, 3
    want = LlamaTensorProcessor()._reverse_permute_weights(np.arange(n)[:, None], heads, heads)[:, 0]
    assert _rows_order(n, heads).tolist() == want.tolist()


@pytest.mark.parametrize("kind", [INT8, INT4])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # each family of the lean forward
def test_greedy_equals_transformers_on_the_dequantized_weights(kind, arch):
    """The engine with `quantization` in float32 gives transformers' greedy tokens on a model whose
    linears hold the same quantized values (fresh quantization of the tiny model's weights)."""
    lm = tiny(arch, dtype="float32")
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, kv_block_size=4, quantization=kind))
    assert eng.precision.quantization == kind
    ref = dequantized_reference(lm.model, kind)
    prompts = [[5, 6, 7, 8], [9] * 13, [3, 100, 42]]
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(ref, p, 12)
    assert eng.runner.lean.own_bytes < sum(m.weight.numel() for m in ref.modules()
                                           if isinstance(m, torch.nn.Linear)) * 4 / 3


def test_quantization_is_refused_where_it_cannot_run():
    lm = tiny("gpt2", dtype="float32")
    with pytest.raises(ValueError, match="runs on the lean forward.*set quantization: none"):
        Engine(lm, EngineConfig(quantization="int4"))
    # CUDA runs them on the device's lean forward (tests/test_cuda_runner.py), never on transformers'
    assert for_source("tiny:llama", "bfloat16", "cuda:0", True, "int8").precision.quantization == "int8"
    with pytest.raises(ValueError, match="runs on the lean forward"):
        for_source("tiny:gpt2", "bfloat16", "cuda:0", True, "int8")
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="int3")
    assert for_source("tiny:llama", "float32", "cpu", True, "auto").precision.quantized is False


def test_auto_keeps_a_gguf_files_class_where_it_can():
    """`auto`: SmolLM2's Q4_1 file runs int4 (its class); Gemma 3's "Q4_K_M" file int8 in float32
    (640 wide rows take no K-quant: most of its linears are Q5_0, its LM head Q8_0); a source that
    is not GGUF, a CUDA device and transformers' modules stay as they load; no `auto` is refused."""
    from workers.weights.gguf_blocks import file_class
    from workers.weights.sources import source_gguf

    assert file_class(source_gguf("smollm2-135m")) == INT4
    assert file_class(source_gguf("gemma3-270m")) == INT8
    gemma = for_source("gemma3-270m", "float32", "cpu", True, "auto").precision
    assert (gemma.quantization, gemma.file_classes) == (INT8, True)
    auto = for_source("smollm2-135m", "bfloat16", "cpu", True, "auto").precision
    assert (auto.quantization, auto.file_classes, auto.quantized_key) == (INT4, True, "auto")
    assert "GGUF file's classes" in auto.describe()
    explicit = for_source("smollm2-135m", "bfloat16", "cpu", True, "int4").precision
    assert (explicit.file_classes, explicit.quantized_key) == (False, INT4)
    # bfloat16 weights: Gemma 3's lean forward runs where they compute in float32 (CPUs without bf16)
    g16 = for_source("gemma3-270m", "bfloat16", "cpu", True, "auto")
    assert g16.precision.quantized == g16.lean == (g16.precision.compute == torch.float32)
    for source, dtype, device, prepack in [("tiny:llama", "float32", "cpu", True),
                                           ("smollm2-135m", "bfloat16", "cpu", False),
                                           ("smollm2-135m", "bfloat16", "cuda:0", True)]:
        assert not for_source(source, dtype, device, prepack, "auto").precision.quantized, source


@pytest.mark.slow
def test_smollm2_gguf_blocks_kept_and_greedy_equals_transformers_float32(smollm2_fp32):
    """SmolLM2's Q4_1 file: every linear (and the Q8_0 LM head) kept as the file's blocks, and in
    float32 the engine's greedy tokens equal transformers' on the file (which dequantizes it), with
    `quantization: auto` (the default) as with int4."""
    from workers.weights.gguf_blocks import gguf_blocks
    from workers.weights.sources import source_gguf

    lm = smollm2_fp32
    blocks = gguf_blocks(source_gguf("smollm2-135m"), lm.model)
    assert len(blocks) == 30 * 7 + 1 and blocks["lm_head"].kind == INT8
    assert {b.kind for name, b in blocks.items() if name != "lm_head"} == {INT4}
    prompt = lm.tokenizer("The quick brown fox jumps over the lazy dog. Once upon a time").input_ids
    want = hf_greedy(lm.model, prompt, 24)
    for quantization in ("auto", "int4"):
        eng = Engine(lm, EngineConfig(max_batch_size=2, max_batch_tokens=128, quantization=quantization))
        assert eng.platform.precision.quantization == INT4
        assert all(lin.quant is not None for lin in eng.runner.lean._keyed.values())
        out = eng.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == want, quantization
        eng.close()


TEXT = ("The history of the city begins with a small settlement on the river, where traders stopped to "
        "rest and to exchange grain, salt and cloth. Over the centuries the settlement grew into a market "
        "town, then into a city with walls, churches and a university. Its people built bridges and mills, "
        "and later factories and railways, and the city became known for its printing houses and its "
        "schools. Today it is a quiet place of parks and museums, where visitors walk along the old walls "
        "and read the names of the streets, which still recall the trades of those who lived there.")


@pytest.mark.slow
# each family of the lean forward; Gemma 3 in int4 only, whose linears are int8 where int4 would
# cost most (the LM head, v and down): int8 everywhere is SmolLM2's case, on the same kernels
@pytest.mark.parametrize("fixture,source,kinds", [("smollm2_fp32", "smollm2-135m", (INT8, INT4)),
                                                  ("gemma3_fp32", "gemma3-270m", (INT4,))],
                         ids=["smollm2", "gemma3"])
def test_fresh_quantization_keeps_perplexity(fixture, source, kinds, request):
    """The model from a Hugging Face directory (no GGUF blocks to keep: every linear quantized
    afresh), in float32: the perplexity of a fixed text within 1% (int8) and 4% (int4) of the
    unquantized model's, from the engine's prompt log-probabilities. (SmolLM2's 16-bit weights are
    its GGUF file's Q4_1 values, which int4 finds again almost exactly: the LM head, Q8_0 in the
    file, is what 4 bits would cost, 8% when it was quantized to int4 too.)"""
    import math

    from workers.models import load_model
    from workers.weights.sources import embedded_gguf, gguf_cache_dir

    request.getfixturevalue(fixture)  # the embedded model, converted by the session into the test cache:
    path = gguf_cache_dir(embedded_gguf(source))  # a Hugging Face directory of its float32 weights
    assert "quantization_config" not in json.loads((path / "config.json").read_text())  # no GGUF marker
    lm = load_model(str(path), dtype="float32")
    ids = lm.tokenizer(TEXT).input_ids
    ppl = {}
    for kind in ("none", *kinds):
        eng = Engine(lm, EngineConfig(max_batch_size=2, max_batch_tokens=256, quantization=kind))
        assert eng.runner.lean is not None and eng.platform.precision.quantized == (kind != "none")
        if kind == INT4:  # as llama.cpp's Q4_K_M: the values (so the fused q/k/v) and down in more bits
            # by the last module a linear fuses: v_proj (q/k/v), o_proj, up_proj (gate/up), down_proj
            kinds = {key.rsplit(".", 1)[-1]: lin.quant.kind for key, lin in eng.runner.lean._keyed.items()}
            assert kinds["v_proj"] == kinds["down_proj"] == INT8
            assert kinds["o_proj"] == kinds["up_proj"] == INT4
        out = eng.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))[0]
        scores = [s for s in out.prompt_logprobs if s is not None]
        assert len(scores) == len(ids) - 1
        ppl[kind] = math.exp(-sum(scores) / len(scores))
    assert ppl.get(INT8, ppl["none"]) <= ppl["none"] * 1.01, ppl
    assert ppl[INT4] <= ppl["none"] * 1.04, ppl  # the LM head stays int8 (lean.LeanLlama)


@needs_kernels
@pytest.mark.slow
def test_act8_keeps_perplexity():
    """SmolLM2's Q4_1 file with `dtype: auto` (bfloat16 with bf16 arithmetic, else float16 weights
    and float32 math), the text's prompt in chunks of 4 rows, so that every linear multiplies calls
    of the few rows act8 takes (every linear on its blocks): the log-probabilities with the
    activations rounded to 8 bits move by under 0.1 nats a token on average, and the perplexity
    stays within 2% (half the int4 weights' bound above) of the same blocks with the compute
    dtype's activations. On this 114-token text the perplexity moved +0.4-0.5% in bfloat16 and
    +0.5-1.3% in float32 math between builds whose moves per token were alike (0.05-0.06 nats):
    the sign of the change is the text's, so the bound is looser than its mean move."""
    import math

    from workers.models import load_model

    lm = load_model("smollm2-135m", dtype="auto")
    ids = lm.tokenizer(TEXT).input_ids
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=4))
    try:
        if not _act8_built(eng.precision.compute):
            pytest.skip(f"no 8-bit activations' path for {eng.precision.compute} in this build")
        assert eng.platform.precision.quantization == INT4
        ppl, scores = {}, {}
        for act8 in (False, True):
            for lin in eng.runner.lean.linears():
                lin.rows = RowChoice(act8=4 if act8 else 0)  # every row count on the blocks
            out = eng.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))[0]
            scores[act8] = [s for s in out.prompt_logprobs if s is not None]
            ppl[act8] = math.exp(-sum(scores[act8]) / len(scores[act8]))
    finally:
        eng.close()
    moved = [abs(a - b) for a, b in zip(scores[True], scores[False], strict=True)]
    assert 0 < sum(moved) / len(moved) < 0.1, sum(moved) / len(moved)
    assert ppl[True] <= ppl[False] * 1.02, ppl


def _mapped(path) -> list[tuple[int, int]]:
    """The address ranges at which this process maps `path` (/proc/self/maps)."""
    spans = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            a, b = (int(x, 16) for x in fields[0].split("-"))
            spans.append((a, b))
    return spans


def _resident_kib(path) -> int:
    """This process's resident KiB of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_a_quantized_copy_lets_its_16_bit_linears_go():
    """A sharing copy that runs quantized linears drops its view of the shared file's 16-bit linears
    (they stay in the page cache; a read brings them back, unchanged)."""
    from workers.models import load_model
    from workers.weights.shared import WEIGHTS_FILE, shared_dir

    lm = load_model("tiny:llama", dtype="float32", share_weights=True)
    path = shared_dir("tiny:llama", torch.float32) / WEIGHTS_FILE
    linears = [m.weight for m in lm.model.modules() if isinstance(m, torch.nn.Linear)]
    before = [w.clone() for w in linears]
    full = _resident_kib(path)
    assert full > 0
    Engine(lm, EngineConfig(max_batch_size=2, max_batch_tokens=64, kv_block_size=4, quantization=INT8))
    after = _resident_kib(path)
    linear_kib = sum(w.numel() * w.element_size() for w in linears) // 1024
    assert after <= full - linear_kib // 2, (full, after, linear_kib)
    assert all(torch.equal(a, b) for a, b in zip(linears, before))  # read again from the page cache


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_quantized_model_of_its_own_lets_the_16_bit_weights_of_its_blocks_go(arch):
    """A worker's model (one engine's alone, LoadedModel.one_engine) with weights of its own: once
    the lean forward has built its blocks, the 16-bit weights of those linears go to `meta` (the
    embedding stays), its tokens unchanged; an engine built on it again runs the same blocks, one
    asking another quantization is refused by name. A model other engines may run keeps them."""
    lm = tiny(arch, dtype="float32")
    cfg = EngineConfig(max_batch_size=4, max_batch_tokens=64, kv_block_size=4, quantization=INT8)
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = Engine(lm, cfg).generate([prompt], params)[0].outputs[0].token_ids
    assert not any(p.is_meta for p in lm.model.parameters()) and lm.quantized is None
    lm = tiny(arch, dtype="float32")
    lm.one_engine = True
    linears = {f"{n}.weight" for n, m in lm.model.named_modules() if isinstance(m, torch.nn.Linear)}
    if lm.model.lm_head.weight is lm.model.get_input_embeddings().weight:
        linears.discard("lm_head.weight")
    eng = Engine(lm, cfg)
    assert {n for n, p in lm.model.named_parameters() if p.is_meta} == linears
    assert eng.generate([prompt], params)[0].outputs[0].token_ids == want
    again = Engine(lm, cfg)
    assert again.generate([prompt], params)[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="holds its linears as int8 blocks only .*asks quantization int4"):
        Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, kv_block_size=4, quantization=INT4))


def test_sharing_copies_map_one_file_of_quantized_linears():
    """Copies that share their weights build the quantized linears once, into the cache, and map
    that file (read-only views, none of their own bytes); their tokens are a private copy's."""
    from workers.models import load_model
    from workers.weights.quantized_cache import cache_path

    cfg = EngineConfig(max_batch_size=2, max_batch_tokens=64, kv_block_size=4, quantization=INT4)
    shared = load_model("tiny:llama", dtype="float32", share_weights=True)
    path = cache_path("tiny:llama", torch.float32, INT4)
    path.unlink(missing_ok=True)
    first = Engine(shared, cfg)
    assert path.exists()
    stamp = path.stat().st_mtime_ns
    second = Engine(load_model("tiny:llama", dtype="float32", share_weights=True), cfg)
    assert path.stat().st_mtime_ns == stamp  # mapped, not written again
    spans = _mapped(path)
    assert spans  # the file is mapped into this process
    for eng in (first, second):
        lean = eng.runner.lean
        assert lean.own_bytes == 0
        for q in lean.quantized_weights().values():  # views of that mapping, not copies
            assert any(a <= q.qs.data_ptr() < b for a, b in spans)
    private = Engine(tiny("llama", dtype="float32"), cfg)
    assert private.runner.lean.own_bytes > 0
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = private.generate([[4, 5, 6, 7]], p)[0].outputs[0].token_ids
    assert first.generate([[4, 5, 6, 7]], p)[0].outputs[0].token_ids == want
    assert second.generate([[4, 5, 6, 7]], p)[0].outputs[0].token_ids == want


def test_without_the_kernels_the_blocks_run_as_a_dense_weight():
    """Where the C++ kernels could not be built, a quantized linear multiplies its blocks' values as
    a dense weight, the precision's way: the same outputs as the blocks' float32 reference."""
    from workers.engine.cpu.linears import quantized
    from workers.precision import PLAIN

    m = torch.nn.Linear(64, 10, bias=True)
    lin = quantized([m], INT4, {}, torch.float32, None, PLAIN)
    assert lin.quant is None and lin.weight is not None
    x = torch.randn(3, 64)
    want = x @ quantize(m.weight, INT4).dequantize().T + m.bias
    assert torch.allclose(lin(x), want, atol=1e-5)


def test_the_gguf_tensor_table_is_read_as_gguf_reads_it(tmp_path):
    """The light reader (the metadata walked, not decoded) finds the architecture and every
    tensor's name, type, shape and data offset as gguf's own reader does, past string arrays and a
    custom alignment; its blocks are the file's."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFReader, GGUFWriter
    from gguf import quants as gq

    from workers.weights.gguf_blocks import read_tensors

    path = tmp_path / "t.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc", "dddd"])
    w.add_array("tokenizer.ggml.scores", [0.5, 0.25, 0.125, 0.0])
    w.add_string("general.name", "tiny")
    rng = np.random.default_rng(1)
    raws = {}
    for name, t in (("blk.0.attn_q.weight", T.Q4_1), ("blk.0.attn_v.weight", T.Q8_0), ("blk.0.ffn_up.weight", T.Q5_0)):
        raws[name] = gq.quantize((rng.standard_normal((8, 64)) * 0.1).astype(np.float32), t)
        w.add_tensor(name, raws[name], raw_dtype=t)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    arch, tensors, mm = read_tensors(path)
    ref = GGUFReader(str(path))
    assert arch == "llama"
    assert [(t.name, t.type_id, t.dims, t.offset) for t in tensors] == [
        (r.name, int(r.tensor_type), tuple(int(x) for x in r.shape), int(r.data_offset)) for r in ref.tensors]
    for t in tensors:
        if t.name in raws:
            raw = raws[t.name]
            assert mm[t.offset: t.offset + raw.nbytes] == raw.tobytes()


def _hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    from workers.engine.attention import hf_attention

    with hf_attention(model, "sdpa"), torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1].double()
    return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


@pytest.mark.slow
def test_gemma3s_k_quants_run_quantized_within_their_rounding(gemma3_fp32):
    """Gemma 3's file: its Q4_K o and down projections are kept as int4 blocks whose scales and
    offsets are the file's, rounded to float16, each value within that rounding of transformers'
    float32 one; its Q6_K downs run as int8 quantized afresh from the file's values, each within
    half an int8 step. With `auto` the prompt's log-probabilities are closer to transformers'
    float32 forward on the file than transformers' own bfloat16 forward is."""
    from workers.quant.gguf import rounding_bound
    from workers.weights.gguf_blocks import gguf_blocks
    from workers.weights.sources import source_gguf

    lm = gemma3_fp32
    modules = dict(lm.model.named_modules())
    blocks = gguf_blocks(source_gguf("gemma3-270m"), lm.model)
    q4k = {name: b for name, b in blocks.items() if b.kind == INT4}
    assert len(q4k) == 27 and all(name.endswith(("o_proj", "down_proj")) for name in q4k)
    for name, qw in q4k.items():
        err = (qw.dequantize() - modules[name].weight.detach()).abs()
        assert (err <= rounding_bound(qw)).all() and err.max() > 0, name
    q6k = [name for name in blocks if name.endswith("down_proj") and name not in q4k]
    assert len(q6k) == 9 and all(blocks[name].kind == INT8 for name in q6k)
    for name in q6k:
        qw = blocks[name]
        half_step = qw.scales.float().repeat_interleave(32, dim=1) / 2 * (1 + 2 ** -10)
        assert ((qw.dequantize() - modules[name].weight.detach()).abs() <= half_step).all(), name
    assert len(blocks) == 18 * 7 + 1  # every linear and the LM head
    eng = Engine(lm, EngineConfig(max_batch_size=2, max_batch_tokens=128))  # quantization: auto
    lean = eng.runner.lean
    assert lean.layers[0].o.quant is not None and lean.layers[0].o.quant.kind == INT4
    assert all(lin.quant is not None for lin in lean.linears())
    prompt = lm.tokenizer(TEXT).input_ids[:96]
    out = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    ours = torch.tensor(out.prompt_logprobs[1:], dtype=torch.float64)
    truth = _hf_prompt_logprobs(lm.model, prompt)
    bf16 = _hf_prompt_logprobs(copy.deepcopy(lm.model).to(torch.bfloat16), prompt)
    ours_err, bf16_err = (ours - truth).abs().max(), (bf16 - truth).abs().max()
    assert ours_err < bf16_err, (float(ours_err), float(bf16_err))
    eng.close()
