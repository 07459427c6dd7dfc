"""The Triton kernels of the paged ops against their PyTorch reference: block boundaries, sequences
of length 1, windows, grouped query heads and padded rows (length 0, a skipped slot). Without a
GPU they run on the CPU in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET before
Triton is imported); on a GPU, compiled, on CUDA tensors."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from workers.engine.cuda import ops as paged_ops  # noqa: E402
from workers.engine.cuda import (  # noqa: E402
    triton_attention,
    triton_decode,
    triton_fused,
    triton_gemma,
    triton_invariant,
    triton_qlinear,
)
from workers.quant.weight import INT4, INT8, QuantizedWeight, quantize  # noqa: E402

BS = 4  # positions a block: small, so that sequences cross several block boundaries
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("Triton runs its kernels on a GPU, or on the CPU with TRITON_INTERPRET=1", allow_module_level=True)
DEV = "cpu" if INTERPRETED else "cuda"


def _kernel(fn, *args):
    """The kernel on this machine's device, its tensor results back on the CPU."""
    moved = [a.to(DEV) if isinstance(a, (torch.Tensor, QuantizedWeight)) else a for a in args]
    out = fn(*moved)
    for a, m in zip(args, moved):  # the caches it wrote
        if isinstance(a, torch.Tensor) and m is not a:
            a.copy_(m.cpu())
    if isinstance(out, tuple):
        return tuple(o.cpu() for o in out)
    return out.cpu() if isinstance(out, torch.Tensor) else out


def _pool(blocks: int, kvh: int, d: int, dtype, gen) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(blocks, kvh, BS, d, generator=gen).to(dtype),
            torch.randn(blocks, kvh, BS, d, generator=gen).to(dtype))


def _tables(lengths: list[int], width: int, blocks: int, gen) -> torch.Tensor:
    """Each sequence's blocks, scattered over the pool (no two sequences share one)."""
    order = torch.randperm(blocks, generator=gen).tolist()
    rows = []
    for n in lengths:
        need = -(-n // BS)
        rows.append(order[:need] + [0] * (width - need))
        order = order[need:]
    return torch.tensor(rows, dtype=torch.int32)


def _decode_case(lengths: list[int], width: int, blocks: int, heads: int, kvh: int, d: int, dtype, gen):
    """A pool, block tables, one query row a sequence, its rows and lengths; the stale memory past
    each row's length is NaN (at its worst), which the kernels must never read."""
    kc, vc = _pool(blocks, kvh, d, dtype, gen)
    tables = _tables(lengths, width, blocks, gen)
    q = torch.randn(len(lengths), heads, d, generator=gen).to(dtype)
    for r, n in enumerate(lengths):
        if n % BS:
            kc[tables[r, n // BS], :, n % BS:] = float("nan")
            vc[tables[r, n // BS], :, n % BS:] = float("nan")
    return kc, vc, tables, q, torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kvh,d", [(4, 2, 16), (3, 1, 24), (2, 2, 8)])
def test_decode_attention_matches_the_reference(dtype, tol, heads, kvh, d):
    """Decode: one row a sequence, lengths across block boundaries (1, BS, BS + 1, ...) and a
    padded row of length 0, which gives zeros; the query heads of a KV head packed together
    (3 heads over 1 KV head: a group that is not a power of two)."""
    gen = torch.Generator().manual_seed(heads * 100 + d)
    lengths = [1, BS, BS + 1, 3 * BS - 1, 0, 2 * BS]
    width = 4
    kc, vc, tables, q, rows, lens = _decode_case(lengths, width, 32, heads, kvh, d, dtype, gen)
    for window in (0, 3, BS + 2):
        want = paged_ops.reference_attention(q, kc, vc, tables, rows, lens, d ** -0.5, window)
        got = _kernel(triton_attention.paged_attention, q, kc, vc, tables, rows, lens, d ** -0.5, window)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        assert not got[4].any()  # the padded row
    # a row of length 1 sees only its own position: its output is that position's value
    one = paged_ops.reference_attention(q, kc, vc, tables, rows, lens, d ** -0.5, 0)[0]
    own = vc[tables[0, 0], :, 0].float().repeat_interleave(heads // kvh, 0)
    torch.testing.assert_close(one.float(), own, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_extend_attention_matches_the_reference(dtype, tol):
    """Prefill and extend: one row a token, each over its own sequence's prefix (causal by its
    length), for a whole prompt from position 0 and a later chunk of another sequence, with a
    padded token."""
    gen = torch.Generator().manual_seed(5)
    heads, kvh, d = 4, 2, 16
    kc, vc = _pool(24, kvh, d, dtype, gen)
    seq_lengths = [7, 11]
    tables = _tables(seq_lengths, 3, 24, gen)
    # sequence 0 computes positions 0..6 (a whole prompt), sequence 1 a chunk at positions 5..10
    rows = torch.tensor([0] * 7 + [1] * 6 + [0], dtype=torch.int32)
    lens = torch.tensor([p + 1 for p in range(7)] + [p + 1 for p in range(5, 11)] + [0], dtype=torch.int32)
    q = torch.randn(len(rows), heads, d, generator=gen).to(dtype)
    for window in (0, 5):
        want = paged_ops.reference_attention(q, kc, vc, tables, rows, lens, 0.3, window)
        got = _kernel(triton_attention.paged_attention, q, kc, vc, tables, rows, lens, 0.3, window)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        assert not got[-1].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_matches_the_reference(dtype):
    """The write through a slot mapping, across block boundaries, with a skipped slot (< 0) that
    writes nothing."""
    gen = torch.Generator().manual_seed(9)
    kvh, d = 2, 8
    kc, vc = _pool(6, kvh, d, dtype, gen)
    key = torch.randn(5, kvh, d, generator=gen).to(dtype)
    value = torch.randn(5, kvh, d, generator=gen).to(dtype)
    slots = torch.tensor([BS - 1, BS, 2 * BS + 1, -1, 5 * BS + 3])
    want_k, want_v = kc.clone(), vc.clone()
    paged_ops.reference_kv_write(key, value, want_k, want_v, slots)
    _kernel(triton_attention.kv_write, key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert torch.equal(kc[1, :, 0], key[1]) and torch.equal(vc[5, :, 3], value[4])


def test_the_ops_are_custom_ops_that_compile_and_check():
    """The registered ops (the reference off CUDA) pass torch's op checks and compile whole."""
    gen = torch.Generator().manual_seed(1)
    kc, vc = _pool(8, 2, 8, torch.float32, gen)
    tables = _tables([5, 2], 2, 8, gen)
    q = torch.randn(2, 4, 8, generator=gen)
    args = (q, kc, vc, tables, torch.arange(2, dtype=torch.int32), torch.tensor([5, 2], dtype=torch.int32), 0.5, 0)
    torch.library.opcheck(torch.ops.mmfusion.paged_attention.default, args)
    key, value = torch.randn(2, 2, 8, generator=gen), torch.randn(2, 2, 8, generator=gen)
    torch.library.opcheck(torch.ops.mmfusion.kv_write.default, (key, value, kc.clone(), vc.clone(),
                                                                 torch.tensor([3, 9])))

    def step(q, k, v, kc, vc, tables, rows, lens, slots):
        torch.ops.mmfusion.kv_write(k, v, kc, vc, slots)
        return torch.ops.mmfusion.paged_attention(q, kc, vc, tables, rows, lens, 0.5, 0)

    slots = torch.tensor([tables[0, 1].item() * BS, tables[1, 0].item() * BS + 1])
    eager_kc, eager_vc = kc.clone(), vc.clone()
    want = step(q, key, value, eager_kc, eager_vc, *args[3:6], slots)
    got = torch.compile(step, fullgraph=True)(q, key, value, kc, vc, *args[3:6], slots)
    assert torch.equal(got, want) and torch.equal(kc, eager_kc)


@pytest.mark.parametrize("kind", [INT8, INT4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_linear_matches_the_reference(kind, dtype):
    """The weight-only quantized linear (workers.engine.cuda.triton_qlinear) against the blocks' float32
    values multiplied in float32: one row (decode), rows and output sizes that leave partial tiles,
    with and without a bias. bfloat16 results agree to their last bit or one rounding apart (the
    sums' order differs)."""
    gen = torch.Generator().manual_seed(3)
    for rows, n, k in ((1, 96, 64), (5, 130, 96), (37, 64, 128)):
        qw = quantize(torch.randn(n, k, generator=gen), kind)
        x = torch.randn(rows, k, generator=gen).to(dtype)
        for bias in (None, torch.randn(n, generator=gen)):
            want = paged_ops.reference_qlinear(x, qw, bias)
            got = _kernel(triton_qlinear.qlinear, x, qw, bias)
            assert got.dtype == dtype and got.shape == (rows, n)
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
            else:
                torch.testing.assert_close(got.float(), want.float(), atol=0.0, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_kernels_give_a_row_the_same_bits_in_any_batch(dtype):
    """`deterministic` on a GPU (workers.engine.cuda.triton_invariant, triton_qlinear.qlinear_invariant):
    a row computed alone, among 5 rows and among 37 has the same bits, and is within rounding of
    the reference."""
    gen = torch.Generator().manual_seed(4)
    k, n = 96, 80
    w = (0.1 * torch.randn(n, k, generator=gen)).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    qw = quantize(torch.randn(n, k, generator=gen), INT4)
    norm_w = torch.randn(k, generator=gen).to(dtype)
    x = torch.randn(37, k, generator=gen).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for fn, args, ref in ((triton_invariant.linear, (w, bias), torch.nn.functional.linear),
                          (triton_qlinear.qlinear_invariant, (qw, None), paged_ops.reference_qlinear),
                          (triton_fused.rms_norm, (norm_w, 1e-6), paged_ops.reference_rms_norm)):
        full = _kernel(fn, x, *args)
        for rows in (x[3:4], x[:5]):
            part = _kernel(fn, rows, *args)
            assert torch.equal(part, full[: part.shape[0]] if rows.shape[0] == 5 else full[3:4]), fn.__name__
        torch.testing.assert_close(full.float(), ref(x, *args).float(), atol=tol, rtol=tol)


def test_every_measured_shape_keeps_a_row_s_bits_and_the_reference():
    """The shapes workers.engine.cuda.tile_choice times (triton_invariant.CANDIDATES, triton_qlinear.
    GEMV_CANDIDATES), those whose inputs are split in ranges (added by triton_splits) included: a row
    alone, among 5 and among 9 has the same bits under each, within rounding of the reference. 512
    inputs make 2 to 4 ranges of them; 80 outputs leave every tile width a partial tile. In
    bfloat16, the tensor cores' dtype on a GPU (the candidates differ from the default tiles, which
    the test above runs in both dtypes, only in their tile sizes and ranges)."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(6)
    k, n = 512, 80
    w = (0.05 * torch.randn(n, k, generator=gen)).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(9, k, generator=gen).to(dtype)
    tol = 2e-2
    cases = [(f"{t}", triton_invariant.linear, (w, bias), dict(tiles=t), torch.nn.functional.linear)
             for t in triton_invariant.CANDIDATES]
    qw = {kind: quantize(torch.randn(n, k, generator=gen), kind) for kind in (INT4, INT8)}
    cases += [(f"{g} {kind}", triton_qlinear.qlinear_invariant, (qw[kind], bias), dict(gemv=g),
               paged_ops.reference_qlinear) for g in triton_qlinear.GEMV_CANDIDATES for kind in (INT4, INT8)]
    for name, fn, args, shape, ref in cases:
        def run(*a, fn=fn, shape=shape):
            return fn(*a, **shape)

        full = _kernel(run, x, *args)
        assert torch.equal(_kernel(run, x[:5], *args), full[:5]), name
        assert torch.equal(_kernel(run, x[3:4], *args), full[3:4]), name
        torch.testing.assert_close(full.float(), ref(x, *args).float(), atol=tol, rtol=tol, msg=name)


SEGMENT = 4 * BS  # the split decode kernel's segment in these tests (its smallest): four blocks


# both dtypes on one head layout, the other layout (one KV head for three, a head size not a power
# of two) in float32: each case runs the kernel a dozen times in Triton's interpreter
@pytest.mark.parametrize("dtype,tol,heads,kvh,d", [(torch.float32, 2e-5, 4, 2, 16), (torch.bfloat16, 2e-2, 4, 2, 16),
                                                   (torch.float32, 2e-5, 3, 1, 24)])
def test_split_decode_attention_matches_the_reference_and_ignores_the_batch(dtype, tol, heads, kvh, d):
    """Decode split over the context (workers.engine.cuda.triton_decode) in segments of four blocks:
    lengths of 1, a segment -1, +0 and +1, several segments, a padded row (zeros), windows that
    start inside a segment or leave whole segments out. A row alone, among the others, with a
    wider block table (more segments) or with one program a row walking every segment has the
    same bits."""
    gen = torch.Generator().manual_seed(heads * 10 + d)
    lengths = [1, SEGMENT - 1, SEGMENT, SEGMENT + 1, 0, 3 * SEGMENT + 2, 2 * SEGMENT]
    width = 13
    kc, vc, tables, q, rows, lens = _decode_case(lengths, width, 48, heads, kvh, d, dtype, gen)
    for window in (0, 3, SEGMENT + 3):
        want = paged_ops.reference_attention(q, kc, vc, tables, rows, lens, d ** -0.5, window)
        got = _kernel(triton_decode.decode_attention, q, kc, vc, tables, rows, lens, d ** -0.5, window, SEGMENT)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        assert not got[4].any()
        if window == 3:  # the batch's independence once without a window, once with one past a segment
            continue
        alone = _kernel(triton_decode.decode_attention, q[5:6], kc, vc, tables, rows[5:6], lens[5:6], d ** -0.5,
                        window, SEGMENT)
        wider = torch.cat([tables, torch.zeros(len(lengths), 5, dtype=tables.dtype)], 1)
        spread = _kernel(triton_decode.decode_attention, q, kc, vc, wider, rows, lens, d ** -0.5, window, SEGMENT)
        one = _kernel(triton_decode.decode_attention, q, kc, vc, tables, rows, lens, d ** -0.5, window, SEGMENT, 1)
        assert torch.equal(alone[0], got[5]) and torch.equal(spread, got) and torch.equal(one, got)
    assert triton_decode.segments_for(width, BS, SEGMENT) == 4 and triton_decode.segments_for(1, 16) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layer_kernels_match_their_references(dtype):
    """The residual add with the RMS norm, the rotary embedding with the KV write (a skipped slot
    writes nothing) and SiLU x up (workers.engine.cuda.triton_fused) against the PyTorch
    references the CPU runs: within one rounding of the activations' dtype, and the cache written
    where the reference writes it."""
    gen = torch.Generator().manual_seed(11)
    n, heads, kvh, d, width, inter = 5, 4, 2, 16, 48, 40
    # bfloat16: Triton's interpreter rounds a float32 to bfloat16 towards zero where a GPU rounds to
    # nearest, and a norm rounds three times: a few places apart
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2 ** -5)
    x, res = (torch.randn(n, width, generator=gen).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    want_x, want_h = paged_ops.reference_add_rms_norm(x, res, w, 1e-6)
    got_x, got_h = _kernel(triton_fused.add_rms_norm, x, res, w, 1e-6)
    assert got_x.dtype == want_x.dtype and got_h.dtype == want_h.dtype
    torch.testing.assert_close(got_h.float(), want_h.float(), **tol)
    torch.testing.assert_close(got_x.float(), want_x.float(), **tol)
    torch.testing.assert_close(_kernel(triton_fused.rms_norm, x, w, 1e-6).float(),
                               paged_ops.reference_rms_norm(x, w, 1e-6).float(), **tol)

    angles = torch.arange(32)[:, None] * (1e-2 ** (torch.arange(d // 2) / (d // 2)))[None]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    qkv = torch.randn(n, (heads + 2 * kvh) * d, generator=gen).to(dtype)
    positions = torch.tensor([0, 3, 4, 17, 31])
    slots = torch.tensor([BS - 1, BS, -1, 2 * BS + 1, 5 * BS + 3])
    kc, vc = _pool(6, kvh, d, dtype, gen)
    want_kc, want_vc = kc.clone(), vc.clone()
    want_q = paged_ops.reference_rope_kv_write(qkv, cos, sin, positions, want_kc, want_vc, slots, heads, kvh)
    got_q = _kernel(triton_fused.rope_kv_write, qkv, cos, sin, positions, kc, vc, slots, heads, kvh)
    torch.testing.assert_close(got_q.float(), want_q.float(), **tol)
    torch.testing.assert_close(kc.float(), want_kc.float(), **tol)
    assert torch.equal(vc, want_vc)

    gu = torch.randn(n, 2 * inter, generator=gen).to(dtype)
    torch.testing.assert_close(_kernel(triton_fused.silu_mul, gu).float(),
                               paged_ops.reference_silu_mul(gu).float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_layer_kernels_match_their_references(dtype):
    """Gemma 3's norms (float32 inside, scaled by 1 + w, rounded once), the sublayer's output normed
    and added to the residual stream with the next norm in one, the q/k heads' norms (v copied as it
    is) and GELU x up (workers.engine.cuda.triton_gemma), against the references the CPU runs."""
    gen = torch.Generator().manual_seed(12)
    n, heads, kvh, d, width, inter = 5, 4, 2, 16, 48, 40
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2 ** -5)
    x, res = (torch.randn(n, width, generator=gen).to(dtype) for _ in range(2))
    w_out, w_next = (1 + 0.1 * torch.randn(width, generator=gen) for _ in range(2))  # (1 + w) in float32
    want_x, want_h = paged_ops.reference_sandwich_norm(x, res, w_out, w_next, 1e-6)
    got_x, got_h = _kernel(triton_gemma.sandwich_norm, x, res, w_out, w_next, 1e-6)
    assert got_x.dtype == dtype and got_h.dtype == dtype
    torch.testing.assert_close(got_h.float(), want_h.float(), **tol)
    torch.testing.assert_close(got_x.float(), want_x.float(), **tol)
    torch.testing.assert_close(_kernel(triton_gemma.gemma_rms_norm, x, w_next, 1e-6).float(),
                               paged_ops.reference_gemma_rms_norm(x, w_next, 1e-6).float(), **tol)

    qkv = torch.randn(n, (heads + 2 * kvh) * d, generator=gen).to(dtype)
    qw, kw = (1 + 0.1 * torch.randn(d, generator=gen) for _ in range(2))
    got = _kernel(triton_gemma.qk_norm, qkv, qw, kw, heads, kvh, 1e-6)
    torch.testing.assert_close(got.float(), paged_ops.reference_qk_norm(qkv, qw, kw, heads, kvh, 1e-6).float(), **tol)
    assert torch.equal(got[:, (heads + kvh) * d:], qkv[:, (heads + kvh) * d:])

    gu = (3 * torch.randn(n, 2 * inter, generator=gen)).to(dtype)
    torch.testing.assert_close(_kernel(triton_gemma.gelu_mul, gu).float(),
                               paged_ops.reference_gelu_mul(gu).float(), **tol)
