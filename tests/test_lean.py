"""The lean forward on prepacked linears, and the CPU's paged decode kernel: as exact as the paths
they replace."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from support.models import hf_greedy, tiny

from workers.engine import Engine, EngineConfig, attention, cpu_kernels
from workers.engine.linears import Linear, can_pack
from workers.engine.params import SamplingParams


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_f_linear(dtype):
    assert can_pack(dtype, "cpu")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    lin = Linear(w, b, pack=True)
    assert lin.packed is not None and lin.weight is None and lin.own_bytes == w.numel() * w.element_size()
    for rows in (1, 5, 64):
        x = torch.randn(rows, 64, generator=g).to(dtype)
        exact = x.double() @ w.double().T + b.double()
        plain = torch.nn.functional.linear(x, w, b).double()
        packed = lin(x).double()
        # each within its dtype's rounding of the exact product, and as close as the plain call
        assert (packed - exact).abs().max() <= 2 * (plain - exact).abs().max() + 1e-5


def _prompt_logprobs(lm, prompt, prepack: bool) -> torch.Tensor:
    eng = Engine(lm, EngineConfig(max_batch_size=2, max_batch_tokens=64, prepack_weights=prepack))
    assert (eng.runner.lean is not None) == prepack
    out = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    return torch.tensor(out.prompt_logprobs[1:], dtype=torch.float64)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_lean_bf16_logprobs_stay_within_bf16_rounding_of_transformers_modules(arch):
    """Prepacked and fused in bfloat16, the prompt's log-probabilities are as far from the float32
    truth as transformers' own modules in bfloat16 are."""
    rng = random.Random(arch)
    prompt = [rng.randrange(256) for _ in range(40)]
    truth = _prompt_logprobs(tiny(arch, dtype="float32"), prompt, prepack=False)
    lm = tiny(arch, dtype="bfloat16")
    plain_err = (_prompt_logprobs(lm, prompt, prepack=False) - truth).abs().max()
    lean_err = (_prompt_logprobs(lm, prompt, prepack=True) - truth).abs().max()
    assert 0 < plain_err and lean_err <= 2 * plain_err + 1e-3, (float(lean_err), float(plain_err))


def test_lean_fp32_greedy_equals_transformers_and_counts_its_own_memory():
    lm = tiny("llama", dtype="float32")
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=32))
    assert eng.runner.lean is not None
    linears = sum(m.weight.numel() for m in lm.model.modules() if isinstance(m, torch.nn.Linear))
    assert eng.runner.lean.own_bytes == 4 * linears  # every linear packed, the LM head too
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (1, 9, 50, 70)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(lm.model, p, 12)


def _pairs(lengths: list[int], block: int, window: int | None, num_blocks: int, rng: random.Random):
    """A GroupStep for decode rows of these lengths, their blocks scattered over the pool."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    rows, blocks, valid, spans = [], [], [], []
    for r, n in enumerate(lengths):
        lo = max(0, n - window) if window else 0
        first, last = lo // block, (n - 1) // block
        spans.append((len(blocks), last + 1 - first, lo - first * block, n - first * block))
        for b in range(first, last + 1):
            rows.append(r)
            blocks.append(free.pop())
            valid.append([lo <= b * block + i < n for i in range(block)])
    gs = attention.GroupStep(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    gs.pair_rows, gs.pair_blocks, gs.pair_valid = torch.tensor(rows), torch.tensor(blocks), torch.tensor(valid)
    gs.spans = spans
    return gs


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("d", [32, 64])  # 64 in bfloat16: the AVX512-BF16 path where the CPU has it
def test_cpu_decode_kernel_matches_the_pytorch_reference(dtype, tol, window, d):
    assert cpu_kernels.decode_kernel() is not None, cpu_kernels.build_error()
    if "avx512_bf16" in Path("/proc/cpuinfo").read_text():
        assert "bf16_avx512" in cpu_kernels.kernel_paths()
    rng = random.Random(0)
    block, kvh, heads = (8 if d == 32 else 32), 2, 6  # 32: a block of two 16-position chunks
    lengths = [1, 7, 8, 9, 40, 130] + [rng.randint(1, 200) for _ in range(10)]
    num_blocks = sum(-(-n // block) for n in lengths) + 5
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(num_blocks, kvh, block, d, generator=gen).to(dtype)
    value = torch.randn(num_blocks, kvh, block, d, generator=gen).to(dtype)
    q = torch.randn(len(lengths), heads, d, generator=gen).to(dtype)
    gs = _pairs(lengths, block, window, num_blocks, rng)
    ref = attention.decode_attention(gs, q.double(), key.double(), value.double(), 0.2, None)
    out = cpu_kernels.paged_decode_cpu(gs, q, key, value, 0.2, None)
    assert out.dtype == dtype and out.shape == ref.shape
    assert (out.double() - ref).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_cpu_norms_match_torch(dtype, rows):
    norms = cpu_kernels.norm_kernels()
    assert norms is not None, cpu_kernels.build_error()
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 576, generator=gen).to(dtype)
    delta = torch.randn(rows, 576, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    want_h = h + delta
    want = torch.nn.functional.rms_norm(want_h, (576,), w, 1e-5)
    tol = 1e-6 if dtype == torch.float32 else 0  # bfloat16 rounds where torch rounds: the same bits
    assert (norms.rms_norm(want_h, w, 1e-5).float() - want.float()).abs().max() <= tol * want.abs().max()
    got = norms.add_rms_norm(h, delta, w, 1e-5)  # h becomes h + delta
    assert torch.equal(h, want_h)
    assert (got.float() - want.float()).abs().max() <= tol * want.abs().max()
