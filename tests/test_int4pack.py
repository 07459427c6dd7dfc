"""torch's tinygemm for int4 blocks on a GPU (workers.engine.cuda.int4pack) and the measured choice of
up to how many rows it serves (workers.engine.cuda.int4_rows). On the CPU, torch's `_for_cpu` twin
of the kernel multiplies the same values, scales and zeros in its own layout: the mapping from the
blocks (the nibbles' order, zero = offset + 8 x scale) is checked against the blocks' own values, the
choice with stand-in timings, and the lean forward's dispatch on the CUDA runner run on the CPU.
On a GPU the last test packs and times for real."""

from __future__ import annotations

import time

import pytest
import torch
from support.models import tiny

from workers.engine import Engine, EngineConfig
from workers.engine.cuda import int4_rows
from workers.engine.cuda.int4pack import Int4Pack, refusal, scales_and_zeros, values
from workers.engine.cuda.lean import DeviceLinear
from workers.engine.cuda.ops import reference_qlinear
from workers.engine.params import SamplingParams
from workers.platform import CudaPlatform
from workers.quant.weight import INT4, INT8, quantize


def _weight(n: int, k: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantize(w, INT4)


def test_values_scales_and_zeros_give_the_blocks_own_values():
    """(q - 8) x scale + zero with the zero unrounded is the blocks' value (scale x q + offset), and
    the bfloat16 pair is that scale and zero rounded once."""
    qw = _weight(48, 96)
    q = values(qw).double()
    assert q.dtype == torch.float64 and q.min() >= 0 and q.max() <= 15
    scale = qw.scales.double().repeat_interleave(32, 1)
    zero = (qw.offsets.double() + 8 * qw.scales.double()).repeat_interleave(32, 1)
    assert torch.equal((q - 8) * scale + zero, qw.dequantize().double())
    sz = scales_and_zeros(qw)
    assert sz.shape == (96 // 32, 48, 2) and sz.dtype == torch.bfloat16
    assert torch.equal(sz[..., 0], qw.scales.float().t().to(torch.bfloat16))
    assert torch.equal(sz[..., 1], (qw.offsets.float() + 8 * qw.scales.float()).t().to(torch.bfloat16))


@pytest.mark.parametrize("n,k", [(64, 576), (96, 1536), (48, 64)])
def test_tinygemm_multiplies_the_blocks_as_closely_as_their_bfloat16_values(n, k):
    """The packed linear against the blocks' exact product: within 2.5x of what rounding each of
    the blocks' values to bfloat16 costs (1.2-1.4x here: tinygemm rounds the scale and the zero
    instead), so a wrong nibble order or zero, off by whole steps of a block, fails it."""
    qw = _weight(n, k, seed=n + k)
    pack = Int4Pack.of(qw)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    exact = x.double() @ qw.dequantize().double().t()
    rounded = (x.float() @ qw.dequantize().to(torch.bfloat16).float().t()).to(torch.bfloat16).double()
    got = pack(x)
    assert got.dtype == torch.bfloat16 and got.shape == (5, n)
    assert (got.double() - exact).abs().max() <= 2.5 * (rounded - exact).abs().max()
    bias = torch.randn(n).to(torch.bfloat16)
    assert torch.equal(pack(x, bias), got + bias)
    assert pack.nbytes < qw.nbytes * 1.25  # the same four bits a weight, bfloat16 scale and zero


def test_what_tinygemm_cannot_take_is_refused_by_name():
    assert "int4" in refusal(quantize(torch.randn(32, 64), INT8), torch.bfloat16)
    assert "bfloat16" in refusal(_weight(32, 64), torch.float32)
    assert "outputs" in refusal(_weight(40, 64), torch.bfloat16)
    assert refusal(_weight(32, 64), torch.bfloat16) is None
    with pytest.raises(ValueError, match="bfloat16"):
        Int4Pack.of(_weight(32, 64))(torch.randn(2, 64))


def test_tinygemm_rows_take_the_buckets_it_wins_from_the_smallest_up():
    """Stand-in timings (rows, Triton's seconds, tinygemm's): the buckets from 1 up while tinygemm
    wins by the margin; a bucket it loses ends them, though it wins again above; level is a loss."""
    assert int4_rows.tinygemm_rows([(1, 2.0, 1.0), (2, 2.0, 1.0), (4, 2.0, 1.0), (8, 1.0, 2.0)]) == 4
    assert int4_rows.tinygemm_rows([(4, 2.0, 1.0), (1, 2.0, 1.0), (2, 1.0, 1.0), (8, 2.0, 1.0)]) == 1
    assert int4_rows.tinygemm_rows([(1, 1.0, 2.0), (2, 2.0, 1.0)]) == 0
    assert int4_rows.tinygemm_rows([(1, 1.04, 1.0)]) == 0  # within the 5% margin
    assert int4_rows.tinygemm_rows([(1, 1.06, 1.0)]) == 1
    assert int4_rows.tinygemm_rows([(1, 2.0, 1.0), (64, 2.0, 1.0)]) == 64


def test_the_rows_timed_run_past_the_decode_buckets_to_the_largest_step():
    assert int4_rows.row_buckets([1, 2, 4, 8, 16, 32, 64], 512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert int4_rows.row_buckets([1, 2, 4], 300) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert int4_rows.row_buckets([1, 2, 4, 8], 6) == [1, 2, 4, 6, 8]


def test_measure_times_both_ways_at_every_bucket_and_chooses_by_its_timings():
    """measure() on the CPU's twin, timed by the wall clock: every bucket timed for both, and the
    rows it returns are tinygemm_rows of those timings."""
    qw = _weight(64, 128)
    calls = []

    def timer(fn):
        t = time.perf_counter()
        out = fn()
        calls.append(out.shape)
        return time.perf_counter() - t

    rows, timings = int4_rows.measure(qw, reference_qlinear, [4, 1, 2], timer)
    assert [r for r, _, _ in timings] == [1, 2, 4]
    assert sorted(calls) == sorted([(r, 64) for r in (1, 2, 4)] * 2)
    assert rows == int4_rows.tinygemm_rows(timings)


def test_a_linear_sends_calls_of_up_to_its_packed_rows_to_tinygemm():
    qw = _weight(64, 128)
    pack = Int4Pack.of(qw)
    lin = DeviceLinear(None, qw, None, reference_qlinear, own=True, packed=pack, packed_rows=4)
    x = torch.randn(5, 128).to(torch.bfloat16)
    assert torch.equal(lin(x[:4]), pack(x[:4]))
    assert torch.equal(lin(x), reference_qlinear(x, qw))
    assert lin.own_bytes == qw.nbytes + pack.nbytes


def _engine(lm, device: str = "cpu") -> Engine:
    prec = CudaPlatform.quantized(CudaPlatform.compute(lm.dtype, True), INT4, True, "tiny")
    platform = CudaPlatform(torch.device(device), prec, lean=True, deterministic=False)
    return Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, kv_block_size=4, kv_cache_memory=4 << 20),
                  platform=platform)


def test_the_lean_forward_packs_its_int4_linears_and_decodes_through_them():
    """`pack_int4` on the CUDA runner's lean forward (run on the CPU): every int4 linear of a shape
    given rows gets a packing, the int8 LM head none; a decode step's logits then stay as close to
    the Triton path's (here its reference) as bfloat16 allows."""
    lm = tiny("llama", dtype="bfloat16")
    plain, packed = _engine(lm), _engine(lm)
    try:
        lean = packed.runner.device_lean
        shapes = {(lin.quant.out_features, lin.quant.in_features) for lin in lean.linears()
                  if lin.quant is not None and lin.quant.kind == INT4}
        assert shapes
        before = lean.own_bytes
        lean.pack_int4({shape: 2 for shape in shapes})
        int4 = [lin for lin in lean.linears() if lin.quant.kind == INT4]
        assert all(lin.packed is not None and lin.packed_rows == 2 for lin in int4)
        assert lean.lm_head.quant.kind == INT8 and lean.lm_head.packed is None
        assert lean.own_bytes == before + sum(lin.packed.nbytes for lin in int4)
        # two tokens: the first from the prompt's step (no packing: more than 2 rows), the second
        # from a decode step of one row through tinygemm; its top log-probabilities against the plain one's
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=5)
        for prompt in ([3, 9, 1, 4], [17] * 6):
            a = plain.generate([prompt], params)[0].outputs[0]
            b = packed.generate([prompt], params)[0].outputs[0]
            assert a.token_ids[0] == b.token_ids[0] and a.logprobs[0] == b.logprobs[0]
            common = set(a.top_logprobs[1]) & set(b.top_logprobs[1])
            assert len(common) >= 3
            assert max(abs(a.top_logprobs[1][t] - b.top_logprobs[1][t]) for t in common) < 0.05
    finally:
        plain.close()
        packed.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_tinygemm_multiplies_the_blocks_and_the_runner_measures_it():
    """On a GPU: the CUDA packing (two values a byte, `_convert_weight_to_int4pack`) against the
    blocks' exact product, and a bfloat16 int4 engine measuring and naming its choice per shape."""
    qw = _weight(96, 1536).to("cuda")
    pack = Int4Pack.of(qw)
    x = torch.randn(16, 1536, device="cuda").to(torch.bfloat16)
    exact = x.double() @ qw.dequantize().double().t()
    rounded = (x.float() @ qw.dequantize().to(torch.bfloat16).float().t()).to(torch.bfloat16).double()
    assert (pack(x).double() - exact).abs().max() <= 2.5 * (rounded - exact).abs().max()
    from workers.models import load_model

    lm = load_model("tiny:llama", dtype="bfloat16", device="cuda")
    eng = _engine(lm, device="cuda")
    try:
        # every weight-only shape names its row kernel's shape, the int4 ones tinygemm's rows too
        assert eng.kernels and all(k.split()[0] in ("int4", "int8") for k in eng.kernels), eng.kernels
        assert all("tinygemm" in v for k, v in eng.kernels.items() if k.startswith("int4 ")), eng.kernels
        out = eng.generate([[3, 9, 1]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        eng.close()
