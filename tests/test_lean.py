"""The lean forward on prepacked linears, and the CPU's paged decode kernel: as exact as the paths
they replace."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from support.models import hf_greedy, tiny
from support.prefill import CHUNKS, reference_chunk, scattered_pool

from workers.capability import cpu_capability
from workers.engine import Engine, EngineConfig, attention
from workers.engine.attention_backend import AttentionBackend
from workers.engine.cpu import extension
from workers.engine.cpu.linears import PACK_ROWS, Linear
from workers.engine.params import SamplingParams
from workers.models import load_model
from workers.precision import onednn_packs

ONEDNN_BF16 = pytest.mark.skipif(not cpu_capability().onednn_bf16,
                                 reason=f"oneDNN has no bf16 path at CPU level {cpu_capability().level}")
FP16_GEMM = pytest.mark.skipif(not cpu_capability().fp16_gemm, reason="FBGEMM's fp16 linear is not available")
AVX512_BF16 = pytest.mark.skipif(not cpu_capability().bf16_arith,
                                 reason=f"the AVX512-BF16 kernels need that level; this run is at {cpu_capability().level}")


@pytest.mark.parametrize("dtype,kind", [(torch.float32, "onednn"), pytest.param(torch.bfloat16, "onednn", marks=ONEDNN_BF16),
                                        pytest.param(torch.float16, "fp16", marks=FP16_GEMM),
                                        pytest.param(torch.bfloat16, "fp16", marks=FP16_GEMM)])
def test_packed_linear_matches_f_linear(dtype, kind):
    """Each packing is within its arithmetic's rounding of the exact product: oneDNN in the weight's
    dtype; FBGEMM's fp16 in float32 over the 16-bit weight (a bfloat16 weight converts exactly)."""
    compute = torch.float32 if kind == "fp16" else dtype
    assert onednn_packs(dtype) or kind == "fp16"
    g = torch.Generator().manual_seed(0)
    out = PACK_ROWS + 96 if kind == "fp16" else 96  # FBGEMM's: packed in two slices of rows
    w = (0.1 * torch.randn(out, 64, generator=g)).to(dtype)
    b = torch.randn(out, generator=g).to(compute)
    lin = Linear(w, b, kind, compute=compute)
    assert (lin.packed is not None or lin.fp16 is not None) and lin.weight is None
    assert kind != "fp16" or len(lin.fp16) == 2
    assert lin.own_bytes == w.numel() * (2 if kind == "fp16" else w.element_size())
    for rows in (1, 5, 64):
        x = torch.randn(rows, 64, generator=g).to(compute)
        exact = x.double() @ w.double().T + b.double()
        plain = torch.nn.functional.linear(x, w.to(compute), b).double()
        packed = lin(x)
        assert packed.dtype == compute
        # each within its dtype's rounding of the exact product, and as close as the plain call
        assert (packed.double() - exact).abs().max() <= 2 * (plain - exact).abs().max() + 1e-5


@FP16_GEMM
def test_a_bfloat16_weight_beyond_float16s_range_is_multiplied_in_float32():
    w = torch.tensor([[1e-30, 1.0], [3e38, 2.0]], dtype=torch.bfloat16)  # beyond float16's range
    lin = Linear(w, None, "fp16", compute=torch.float32)
    assert lin.fp16 is None and lin.packed is not None and lin.own_bytes == 4 * 4
    x = torch.tensor([[1.0, 1.0]])
    assert torch.equal(lin(x), torch.nn.functional.linear(x, w.float()))


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


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_lean_fp32_greedy_equals_transformers_and_counts_its_own_memory(arch):
    """Gemma 3's prompts run past its sliding window (32 tokens) on its sliding layers, and its
    norms (1 + w, initialised to w = 0) get weights of their own."""
    lm = tiny(arch, dtype="float32")
    gen = torch.Generator().manual_seed(3)
    for m in lm.model.modules():
        if arch == "gemma3" and type(m).__name__ == "Gemma3RMSNorm":
            m.weight.data = torch.randn(m.weight.shape, generator=gen) * 0.5
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
@pytest.mark.parametrize("d", [16, 32, 64, 80, 128, 256])
@pytest.mark.parametrize("rows", [2, 16])
# 64, 128, 256: the AVX512-BF16 path in bfloat16 where the CPU has it; the AVX2 path in float32 at
# every size (16 and 32: tiny models; 80: some small ones); the generic path for the rest;
# 16 rows: a work item takes a row's KV heads together, 2 rows: one KV head each
def test_cpu_decode_kernel_matches_the_pytorch_reference(dtype, tol, window, d, rows):
    assert extension.decode_kernel() is not None, extension.build_error()
    assert ("bf16_avx512" in extension.kernel_paths()) == cpu_capability().bf16_arith
    assert ("f32_avx2" in extension.kernel_paths()) == cpu_capability().at_least("avx2")
    rng = random.Random(0)
    block, kvh, heads = (8 if d <= 32 else 32), 2, 6  # 16, 32: blocks of 8 positions, tiles crossing them
    lengths = ([1, 7, 8, 9, 40, 130] + [rng.randint(1, 200) for _ in range(10)])[-rows:]
    num_blocks = sum(-(-n // block) for n in lengths) + 5
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(num_blocks, kvh, block, d, generator=gen).to(dtype)
    value = torch.randn(num_blocks, kvh, block, d, generator=gen).to(dtype)
    q = torch.randn(len(lengths), heads, d, generator=gen).to(dtype)
    gs = _pairs(lengths, block, window, num_blocks, rng)
    ref = attention.decode_attention(gs, q.double(), key.double(), value.double(), 0.2, None)
    out = extension.paged_decode_cpu(gs, q, key, value, 0.2, None)
    assert out.dtype == dtype and out.shape == ref.shape
    assert (out.double() - ref).abs().max() < tol


@pytest.mark.parametrize("window", [None, 20])
def test_cpu_decode_kernel_gives_a_row_the_same_result_alone_and_in_a_batch(window):
    """Each (row, KV head) is walked in two halves of its positions, merged at the end: how a row's
    positions are cut depends on the row alone, so its output is bit-equal whether it runs alone
    (3 KV heads, 6 halves over the threads) or beside 15 other rows (a work item per row)."""
    rng = random.Random(2)
    block, kvh, heads, d = 16, 3, 9, 64
    lengths = [1, 16, 17, 33, 100, 129] + [rng.randint(1, 300) for _ in range(10)]
    num_blocks = sum(-(-n // block) for n in lengths) + 5
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(num_blocks, kvh, block, d, generator=gen)
    value = torch.randn(num_blocks, kvh, block, d, generator=gen)
    q = torch.randn(len(lengths), heads, d, generator=gen)
    batch = _pairs(lengths, block, window, num_blocks, random.Random(4))
    together = extension.paged_decode_cpu(batch, q, key, value, 0.125, None)
    table = torch.tensor(batch.spans)
    for r in range(len(lengths)):
        first, count = table[r, 0].item(), table[r, 1].item()
        alone = attention.GroupStep(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        alone.pair_blocks = batch.pair_blocks[first: first + count]
        alone.pair_rows = torch.zeros(count, dtype=torch.long)
        alone.pair_valid = batch.pair_valid[first: first + count]
        alone.spans = [(0, count, table[r, 2].item(), table[r, 3].item())]
        got = extension.paged_decode_cpu(alone, q[r: r + 1], key, value, 0.125, None)
        assert torch.equal(got[0], together[r]), (r, lengths[r])


# the AVX512-BF16 paths: each source defines its macro where the target has AVX512F and AVX512-BF16
BF16_PATHS = ("MMFUSION_BF16_DOT", "MMFUSION_PREFILL_BF16", "MMFUSION_NORM_BF16", "MMFUSION_ROPE_BF16",
              "MMFUSION_SILU_BF16")


@pytest.mark.any_isa
def test_the_avx512_bf16_paths_compile_on_any_cpu(tmp_path):
    """A CPU below AVX512-BF16 builds the kernels without those paths, so a change made on one could
    break them unseen: they are compiled here for a target that has them (Cooper Lake, the
    avx512_bf16 level's target), with the build's own flags; syntax and types only, nothing runs.
    The sources test no feature that Sapphire Rapids adds (AMX, AVX512-FP16), so its build takes
    the same paths; a path that does test one needs that target here too."""
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    sources = [p.read_text() for p in extension.KERNELS.iterdir() if p.suffix in (".cpp", ".h")]
    assert not any(m in src for src in sources for m in ("__AMX", "__AVX512FP16__")), "compile for sapphirerapids too"
    check = tmp_path / "avx512_bf16.cpp"
    missing = " || ".join(f"!defined({m})" for m in BF16_PATHS)
    check.write_text(f'#include "{extension.KERNELS / "kernels.cpp"}"\n#if {missing}\n'
                     '#error "an AVX512-BF16 path was left out"\n#endif\n')
    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    cmd = [cpp_extension.get_cxx_compiler(), "-std=c++20", "-fsyntax-only", "-march=cooperlake",
           *extension.CFLAGS, *includes, str(check)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]


def _prefill_kernel(head_dim: int, dtype: torch.dtype = torch.bfloat16):
    """The CPU prefill kernel for heads of this size, which this run must have at its level:
    bfloat16 at avx512_bf16, float32 at avx2 and above."""
    need = "avx512_bf16" if dtype == torch.bfloat16 else "avx2"
    if not cpu_capability().at_least(need):
        pytest.skip(f"the {dtype} prefill kernel needs the {need} level; this run is at {cpu_capability().level}")
    kernel = extension.prefill_kernel(dtype, head_dim)
    assert kernel is not None, extension.build_error()
    return kernel


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("block,heads,kvh,d", [(16, 6, 2, 64), (8, 4, 1, 128), (32, 9, 3, 64)])
def test_cpu_prefill_kernel_matches_a_float64_reference(dtype, tol, window, block, heads, kvh, d):
    """Whole prompts and later chunks of one step, their blocks scattered over the pool, read in
    place by the kernel: as exact as the dtype's inputs allow."""
    kernel = _prefill_kernel(d, dtype)
    gen = torch.Generator().manual_seed(2)
    chunks = CHUNKS
    free = scattered_pool(chunks, block)
    key = torch.zeros(len(free), kvh, block, d, dtype=dtype)
    value = torch.zeros_like(key)
    n = 3 + sum(c for _, c in chunks)  # three decode rows first, which the kernel leaves alone
    q = torch.randn(n, heads + kvh, d, generator=gen).to(dtype)[:, :heads]  # strided, as lean's
    out = torch.full((n, heads, d), 7.0, dtype=dtype)
    blocks, table, refs, t0 = [], [], [], 3
    for start, c in chunks:
        k = torch.randn(start + c, kvh, d, generator=gen).to(dtype)
        v = torch.randn(start + c, kvh, d, generator=gen).to(dtype)
        own = [free.pop() for _ in range(-(-(start + c) // block))]
        for pos in range(start + c):
            key[own[pos // block], :, pos % block] = k[pos]
            value[own[pos // block], :, pos % block] = v[pos]
        first = max(0, start - window + 1) // block if window else 0
        table.append((t0, c, start, len(blocks), first * block))
        blocks.extend(own[first:])
        refs.append(reference_chunk(q[t0: t0 + c], k, v, start, window, 0.125))
        t0 += c
    gs = attention.GroupStep(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    gs.prefill_blocks, gs.prefill_table = torch.tensor(blocks), torch.tensor(table)
    assert kernel(out, q, key, value, gs, window, 0.125)
    assert (out[:3].float() == 7.0).all()
    got = out[3:].double()
    want = torch.cat(refs)
    assert (got - want).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cpu_rope_write_is_bit_equal_to_torch_and_fills_the_cache(dtype):
    """The C++ rotation of q and k equals torch's `x * cos + roll(x) * sin` bit for bit, and each
    token's rotated k and its v land in its (block, offset) of the cache."""
    kernels = extension.kernel_module()
    assert kernels is not None, extension.build_error()
    gen = torch.Generator().manual_seed(3)
    n, heads, kvh, d, block, num_blocks = 7, 6, 2, 64, 4, 9
    qkv = torch.randn(n, (heads + 2 * kvh) * d, generator=gen).to(dtype)
    angle = torch.rand(n, d // 2, generator=gen, dtype=torch.float64) * 100
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(dtype)
    sin = torch.cat((-angle.sin(), angle.sin()), -1).to(dtype)  # first half negated, as lean passes it
    blocks, offsets = torch.tensor([3, 3, 8, 0, 5, 5, 5]), torch.tensor([0, 1, 3, 2, 0, 1, 2])
    key = torch.zeros(num_blocks, kvh, block, d, dtype=dtype)
    value = torch.zeros_like(key)
    qk = qkv[:, : (heads + kvh) * d].view(n, heads + kvh, d)
    want = qk * cos[:, None] + qk.roll(d // 2, -1) * sin[:, None]
    v = qkv[:, (heads + kvh) * d:].view(n, kvh, d).clone()
    kernels.rope_write(qkv, cos, sin, key, value, blocks, offsets, heads, kvh)
    assert torch.equal(qkv[:, : (heads + kvh) * d].view(n, heads + kvh, d), want)
    assert torch.equal(qkv[:, (heads + kvh) * d:].view(n, kvh, d), v)  # v is not rotated
    assert torch.equal(key[blocks, :, offsets], want[:, heads:]) and torch.equal(value[blocks, :, offsets], v)
    untouched = torch.ones(num_blocks, block, dtype=torch.bool)
    untouched[blocks, offsets] = False
    assert not key.transpose(1, 2)[untouched].any() and not value.transpose(1, 2)[untouched].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 576), (5, 100), (64, 576)])  # 100: a part-vector tail
def test_cpu_norms_match_torch(dtype, rows, width):
    norms = extension.kernel_module()
    assert norms is not None, extension.build_error()
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, width, generator=gen).to(dtype)
    delta = torch.randn(rows, width, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    want_h = h + delta
    want = torch.nn.functional.rms_norm(want_h, (width,), w, 1e-5)
    tol = 1e-6 if dtype == torch.float32 else 0  # bfloat16 rounds where torch rounds: the same bits
    assert (norms.rms_norm(want_h, w, 1e-5).float() - want.float()).abs().max() <= tol * want.abs().max()
    got = norms.add_rms_norm(h, delta, w, 1e-5)  # h becomes h + delta
    assert torch.equal(h, want_h)
    assert (got.float() - want.float()).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 1000), (64, 1536)])  # 1000: a part-vector tail
def test_cpu_silu_mul_rounds_as_torch(dtype, rows, inter):
    kernels = extension.kernel_module()
    assert kernels is not None, extension.build_error()
    gen = torch.Generator().manual_seed(rows)
    gu = (4 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype)
    gu[0, :6] = torch.tensor([-200.0, 200.0, 0.0, -0.0, -88.0, 89.0])  # exp's overflow and the zeros
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    got = kernels.silu_mul(gu)
    assert got.shape == want.shape and got.dtype == dtype
    # the same roundings as torch: only the exponential's last float bit may tip one result by
    # one unit in the last place of the dtype
    differ = got != want
    assert differ.float().mean() < 1e-3
    unit = 2 ** -22 if dtype == torch.float32 else 2 ** -7
    assert ((got.float() - want.float()).abs()[differ] <= want.float().abs()[differ] * unit).all()
    if dtype == torch.float32 and kernels.silu_mul_f32_exact():
        # torch's own exponential: the same bits, but where ATen's loop ends a row in scalar expf
        # (its last values short of two vectors: 16 lanes on AVX2, 32 on AVX-512)
        whole = inter - inter % 32
        assert torch.equal(got[:, :whole], want[:, :whole])


@pytest.mark.any_isa
def test_cpu_silu_mul_float32_claims_torchs_bits_only_where_aten_vectorizes():
    """float32 silu * up is bit-equal to F.silu's only while ATen's silu calls SLEEF's exponential
    too: under ATEN_CPU_CAPABILITY=default ATen's loop rounds its own way, and the claim is off (the
    lean forward then keeps torch's own silu and mul)."""
    code = "from workers.engine.cpu import extension; print(extension.kernel_module().silu_mul_f32_exact())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"


def _chunked_prompt_logprobs(lm, prompt, prefill_kernel: bool) -> torch.Tensor:
    """Prompt log-probabilities with the prompt computed in chunks of 96: later chunks read the
    earlier ones from the cache's blocks."""
    # without the prefill kernel: the C++ decode kernel beside the PyTorch prefill path
    backend = None if prefill_kernel else AttentionBackend("cpu-decode", extension.decode_kernel())
    eng = Engine(lm, EngineConfig(max_batch_size=2, max_batch_tokens=96), attention=backend)
    out = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    return torch.tensor(out.prompt_logprobs[1:], dtype=torch.float64)


@pytest.mark.slow
def test_bf16_prefill_kernel_is_as_close_to_float32_as_the_pytorch_path(smollm2_fp32):
    """SmolLM2 (heads of 64) in bfloat16, a 300-token prompt in chunks: with the C++ prefill kernel
    its log-probabilities are as far from the float32 truth as with the PyTorch path."""
    _prefill_kernel(64)
    rng = random.Random(7)
    prompt = [rng.randrange(1000, 40000) for _ in range(300)]
    truth = _chunked_prompt_logprobs(smollm2_fp32, prompt, prefill_kernel=False)
    lm = load_model("smollm2-135m", dtype="bfloat16")
    plain_err = (_chunked_prompt_logprobs(lm, prompt, prefill_kernel=False) - truth).abs()
    kernel_err = (_chunked_prompt_logprobs(lm, prompt, prefill_kernel=True) - truth).abs()
    assert 0 < plain_err.max()
    assert kernel_err.mean() <= 1.2 * plain_err.mean() and kernel_err.max() <= 2 * plain_err.max() + 1e-3, \
        (float(kernel_err.mean()), float(plain_err.mean()), float(kernel_err.max()), float(plain_err.max()))


@pytest.mark.slow
def test_blocks_are_left_unzeroed_only_while_the_cpp_kernels_serve(embedded_models):
    """bf16 SmolLM2 on the C++ kernels: new blocks are not zeroed (the kernels read only a row's
    own positions). A PyTorch attention path would read whole blocks under a mask, so it is
    refused with an error instead of reading stale memory."""
    _prefill_kernel(64)
    lm = load_model("smollm2-135m", dtype="bfloat16")
    eng = Engine(lm, EngineConfig(max_batch_size=2, max_batch_tokens=64))
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eng.runner.cache.keys.fill_(float("nan"))  # stale memory at its worst
    eng.runner.cache.values.fill_(float("nan"))
    out = eng.generate([list(range(100, 190))], greedy)[0]  # 90 tokens: two chunks, then decode
    assert eng.runner.unzeroed
    fresh = Engine(lm, EngineConfig(max_batch_size=2, max_batch_tokens=64)).generate([list(range(100, 190))], greedy)
    assert out.outputs[0].token_ids == fresh[0].outputs[0].token_ids  # the NaNs were never read
    # as if the kernel declined a layout
    eng.runner.backend = replace(eng.attention_backend, prefill=lambda *args: False)
    eng.add_request("x", list(range(300, 340)), greedy)
    with pytest.raises(RuntimeError, match="not zeroed"):
        eng.step()


def test_a_build_lock_left_by_a_killed_build_is_cleared(tmp_path):
    """torch's extension builder waits forever on the lock of a build whose process was killed."""
    import os
    import time

    lock = tmp_path / "lock"
    assert extension.clear_stale_lock(lock) is False  # none
    lock.write_text("")
    assert extension.clear_stale_lock(lock) is False and lock.exists()  # a build may be running
    old = time.time() - extension.STALE_BUILD_LOCK_S - 60
    os.utime(lock, (old, old))
    assert extension.clear_stale_lock(lock) is True and not lock.exists()


def test_built_kernels_load_as_they_are_and_a_broken_file_is_built_again(tmp_path):
    """A process loads the kernels built before without torch's builder (which imports setuptools
    and runs ninja: over a second of CPU in every process that starts a model); a missing file, a
    build in progress (its lock) or a half-written file goes through the builder instead."""
    import shutil
    from pathlib import Path

    built = extension.kernel_module()
    if built is None:
        pytest.skip(f"no kernels here: {extension.build_error()}")
    so = Path(built.__file__)
    name = so.stem
    assert extension.load_built(name, tmp_path) is None  # nothing built there
    shutil.copy(so, tmp_path / so.name)
    again = extension.load_built(name, tmp_path)
    assert again is not None and sorted(again.paths()) == sorted(built.paths())
    (tmp_path / "lock").write_text("")
    assert extension.load_built(name, tmp_path) is None  # a build holds the folder
    broken = tmp_path / "broken"  # a file of its own: the one loaded above stays mapped
    broken.mkdir()
    (broken / so.name).write_bytes(so.read_bytes()[:4096])
    assert extension.load_built(name, broken) is None
