"""The quantized linears' kernel picked by the step's row count (workers.engine.cpu.row_kernels): the
picking on stand-in timings (the fastest wins its buckets through one crossover, the same timings
give the same choice, the cache is keyed by the machine), the widened GEMM against the blocks'
reference, and an engine whose linears take it answering as the blocks do."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import yaml
from support.models import tiny

from workers import capability, files
from workers.engine import Engine, EngineConfig
from workers.engine.cpu import calibrate, extension, row_kernels
from workers.engine.cpu.decode_layers import FusedDecode
from workers.engine.cpu.linears import (
    Linear,
    float32_fits,
    lay_out,
    pack_for_tiles,
    tiles_fit,
    widen_to_float32,
)
from workers.engine.cpu.row_kernels import (
    BLOCKS,
    BUCKETS,
    FLOAT32,
    PACKED,
    WIDENED,
    RowChoice,
    batch_way,
    pick,
)
from workers.engine.params import SamplingParams
from workers.quant.weight import INT4, INT8, quantize
from workers.weights import quantized_cache

KERNELS = extension.kernel_module()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason=f"no C++ kernels: {extension.build_error()}")


def _timings(blocks: dict[int, float], widened: dict[int, float]) -> dict[int, dict[str, float]]:
    return {r: {BLOCKS: blocks[r], WIDENED: widened[r]} for r in blocks}


def test_the_fastest_stand_in_takes_its_buckets_through_one_crossover():
    flat = dict.fromkeys(BUCKETS, 1.0)
    # the blocks win everywhere: no crossover
    assert pick(_timings(flat, dict.fromkeys(BUCKETS, 2.0))) == RowChoice(None)
    # the GEMM wins from 64 rows on: rows above the 16-row bucket take it
    gemm = {1: 9.0, 4: 5.0, 16: 1.5, 64: 0.5, 256: 0.4, 512: 0.3}
    choice = pick(_timings(flat, gemm))
    assert choice == RowChoice(17)
    assert [choice.way(r) for r in (1, 16, 17, 64, 100, 512, 4096)] == [BLOCKS] * 2 + [WIDENED] * 5
    assert choice.describe() == "blocks up to 16 rows, widened from 17"
    # everywhere: from one row on
    assert pick(_timings(flat, dict.fromkeys(BUCKETS, 0.5))).way(1) == WIDENED
    # a bucket where the GEMM wins but a larger one where it does not: no flip back and forth
    noisy = {1: 9.0, 4: 0.5, 16: 1.5, 64: 0.5, 256: 0.4, 512: 0.3}
    assert pick(_timings(flat, noisy)) == RowChoice(17)
    # within the margin the blocks stay (they hold a quarter of the bytes)
    near = dict.fromkeys(BUCKETS, 1 - row_kernels.MARGIN / 2)
    assert pick(_timings(flat, near)) == RowChoice(None)
    # the same timings, the same choice
    assert all(pick(_timings(flat, gemm)) == choice for _ in range(5))
    # the buckets below the largest one where the blocks won are not timed: the same choice
    assert pick({r: t for r, t in _timings(flat, gemm).items() if r >= 16}) == choice
    assert pick({512: {BLOCKS: 1.0, WIDENED: 2.0}}) == RowChoice(None)
    # fewer buckets measured (a small max_batch_tokens): the last measured holds beyond it
    assert row_kernels.bucket_rows(64) == (1, 4, 16, 64) and row_kernels.bucket_rows(65) == BUCKETS[:5]
    assert row_kernels.bucket_rows(10_000) == BUCKETS
    with pytest.raises(ValueError, match="widened_from must be a row count of at least 1"):
        RowChoice(0)


def test_a_choice_is_measured_once_per_machine_and_again_on_another(tmp_path, monkeypatch):
    """Stand-in kernels that take a set time: the blocks 1 ms up to 16 rows and 6 ms above, the
    GEMM 3 ms at any rows. Measured through the real timer; read back from the cache after."""
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path))
    calls: list[str] = []

    def way(name: str, small: float, large: float):
        def run(x: torch.Tensor, layers: int) -> None:
            calls.append(name)
            time.sleep(small if x.shape[0] <= 16 else large)
        return run

    ways = {BLOCKS: way(BLOCKS, 0.001, 0.006), WIDENED: way(WIDENED, 0.003, 0.003)}
    choice = row_kernels.choose(INT4, (64, 32), torch.float32, ways, 512, "build-a")
    assert choice == RowChoice(17) and {BLOCKS, WIDENED} <= set(calls)
    calls.clear()
    assert row_kernels.choose(INT4, (64, 32), torch.float32, ways, 512, "build-a") == choice and calls == []
    # another CPU model, another kernel build or another shape: measured again
    for change in ("cpu", "build", "shape"):
        calls.clear()
        if change == "cpu":
            monkeypatch.setattr(capability, "cpu_model", lambda: "Another CPU")
        build, shape = ("build-b", (64, 32)) if change == "build" else ("build-a", (64, 64) if change == "shape" else (64, 32))
        assert row_kernels.choose(INT4, shape, torch.float32, ways, 512, build) == choice
        assert calls, change
    # a step never has more rows than max_batch_tokens: the buckets above it are not measured;
    # timed from the largest down, the first bucket where the blocks win is the last timed
    calls.clear()
    sizes: list[int] = []
    ways_small = {name: (lambda x, n, fn=fn: (sizes.append(x.shape[0]), fn(x, n))) for name, fn in ways.items()}
    row_kernels.choose(INT8, (64, 32), torch.float32, ways_small, 64, "build-a")
    assert max(sizes) == 64 and min(sizes) == 16  # 64 went to the GEMM, 16 to the blocks: 4 and 1 untimed


def test_8_bit_activations_are_taken_unless_the_blocks_beat_them_at_a_few_rows(tmp_path, monkeypatch):
    """Stand-in kernels through the real timer: ACT8 (the blocks with 8-bit activations, which are
    the blocks above ACT8_ROWS rows) taken up to the largest of the 1- and 4-row buckets, from the
    smallest up, where the blocks do not beat it by MARGIN, and the crossover then measured against
    the blocks as chosen. Both kept in the choice the cache holds."""
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path))
    seen: dict[str, set[int]] = {}

    def way(name: str, seconds):
        def run(x: torch.Tensor, layers: int) -> None:
            seen.setdefault(name, set()).add(x.shape[0])
            time.sleep(seconds(x.shape[0]))
        return run

    blocks = way(BLOCKS, lambda r: 0.004 if r <= 16 else 0.012)
    gemm = way(WIDENED, lambda r: 0.006 if r == 1 else 0.003)  # beats the blocks' bfloat16 from 4 rows
    act8 = way(row_kernels.ACT8, lambda r: 0.001 if r <= row_kernels.ACT8_ROWS else 0.004 if r <= 16 else 0.012)
    ways = {BLOCKS: blocks, WIDENED: gemm, row_kernels.ACT8: act8}
    choice = row_kernels.choose(INT4, (64, 32), torch.bfloat16, ways, 512, "build-a")
    # the crossover against act8's timings: the GEMM from 5 rows, where it starts at 2 against the blocks
    assert choice == RowChoice(5, act8=4) and seen[row_kernels.ACT8] == {1, 4}  # above 4 rows: the blocks
    assert choice.describe() == "act8 up to 4 rows, widened from 5"
    assert [choice.way(r) for r in (1, 4, 5)] == [BLOCKS, BLOCKS, WIDENED]
    seen.clear()
    assert row_kernels.choose(INT4, (64, 32), torch.bfloat16, ways, 512, "build-a") == choice and not seen  # kept
    # about level with the blocks at 4 rows (5% faster, within the margin): kept; beaten there: dropped
    level_at_4 = way(row_kernels.ACT8, lambda r: 0.001 if r == 1 else 0.0038 if r <= 4 else 0.004 if r <= 16 else 0.012)
    assert row_kernels.choose(INT4, (64, 48), torch.bfloat16, {**ways, row_kernels.ACT8: level_at_4}, 512,
                              "build-a").act8 == 4
    loses_at_4 = way(row_kernels.ACT8, lambda r: 0.001 if r == 1 else 0.006 if r <= 4 else 0.004 if r <= 16 else 0.012)
    choice = row_kernels.choose(INT4, (64, 64), torch.bfloat16, {**ways, row_kernels.ACT8: loses_at_4}, 512, "build-a")
    # one row on it, four on the blocks: the GEMM beats those from 4 rows (the crossover at 2)
    assert choice == RowChoice(2, act8=1) and choice.describe() == "act8 up to 1 rows, widened from 2"
    loses_at_1 = way(row_kernels.ACT8, lambda r: 0.006 if r == 1 else 0.001 if r <= 4 else 0.004 if r <= 16 else 0.012)
    assert row_kernels.choose(INT4, (64, 80), torch.bfloat16, {**ways, row_kernels.ACT8: loses_at_1}, 512,
                              "build-a").act8 == 0  # from the smallest bucket up
    with pytest.raises(ValueError, match="act8 must be a row count from 0 to 4"):
        RowChoice(act8=5)
    # a step of one row at most (max_batch_size 1): the 1-row bucket alone decides
    assert row_kernels.choose(INT4, (64, 96), torch.bfloat16, {**ways, row_kernels.ACT8: loses_at_4}, 1,
                              "build-a").act8 == 1


def test_long_calls_are_timed_fewer_times():
    """A call that takes BUDGET_SECONDS already (many rows over every layer) is timed once after its
    warm-up; a quick one the best of calibrate.REPEATS."""
    calls = {BLOCKS: 0, WIDENED: 0}

    def way(name: str, seconds: float):
        def run(x: torch.Tensor, layers: int) -> None:
            calls[name] += 1
            time.sleep(seconds)
        return run

    slow = row_kernels.BUDGET_SECONDS * 1.2
    row_kernels.measure({BLOCKS: way(BLOCKS, slow), WIDENED: way(WIDENED, slow)}, 8, torch.float32, (512,))
    assert calls == {BLOCKS: 2, WIDENED: 2}
    calls.update(dict.fromkeys(calls, 0))
    row_kernels.measure({BLOCKS: way(BLOCKS, 0.001), WIDENED: way(WIDENED, 0.001)}, 8, torch.float32, (512,))
    assert calls == dict.fromkeys(calls, 1 + calibrate.REPEATS)


def test_many_rows_are_timed_over_fewer_layers():
    """Up to STREAM_ROWS rows every layer's weights stream as in a step; above, the layers timed
    shrink with the rows (the call is bound by arithmetic), never below MIN_LAYERS nor above all."""
    assert [row_kernels.layers_timed(r, 30) for r in BUCKETS] == [30, 30, 30, 8, 2, 2]
    assert [row_kernels.layers_timed(r, 1) for r in BUCKETS] == [1] * len(BUCKETS)
    seen: dict[int, set[int]] = {}

    def way(x: torch.Tensor, layers: int) -> None:
        seen.setdefault(x.shape[0], set()).add(layers)
        time.sleep(0.001 if x.shape[0] <= 16 else 0.004)

    gemm = {512: 0.001, 256: 0.001, 64: 0.001, 16: 0.01}

    def widened(x: torch.Tensor, layers: int) -> None:
        seen.setdefault(x.shape[0], set()).add(layers)
        time.sleep(gemm.get(x.shape[0], 0.01))

    got = row_kernels.measure({BLOCKS: way, WIDENED: widened}, 8, torch.float32, BUCKETS, layers=30)
    assert seen == {512: {2}, 256: {2}, 64: {8}, 16: {30}} and pick(got) == RowChoice(17)


def test_copies_measuring_together_measure_once(tmp_path, monkeypatch):
    """Four threads stand for copies starting together (the lock is a file's: threads that open it
    apart exclude each other as processes do): one measures, the others wait and read its figure."""
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path))
    measured: list[int] = []

    def slow() -> int:
        measured.append(1)
        time.sleep(0.3)
        return 257

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: files.remembered("a key", slow), range(4)))
    assert got == [257] * 4 and len(measured) == 1


@needs_kernels
@pytest.mark.parametrize("kind", [INT4, INT8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_widened_gemm_takes_the_blocks_values(kind, dtype):
    gen = torch.Generator().manual_seed(0)
    qw = quantize(torch.randn(80, 96, generator=gen), kind)
    bias = torch.randn(80, generator=gen)
    for rows in (0, 1, 5, 130):
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        got = KERNELS.qlinear_widened(x, qw.qs, qw.scales, qw.offsets, bias)
        w = qw.dequantize().to(dtype)  # the values the blocks' kernels widen to
        want = (x.double() @ w.double().T + bias.to(dtype).double())
        assert got.dtype == dtype and got.shape == (rows, 80)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 10)
    with pytest.raises(RuntimeError, match="int4 blocks take offsets, int8 blocks none"):
        KERNELS.qlinear_widened(x, qw.qs, qw.scales, None if kind == INT4 else qw.scales, None)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        KERNELS.qlinear_widened(x.half(), qw.qs, qw.scales, qw.offsets, None)


def _greedy(eng: Engine) -> list[list[int]]:
    prompts = [[5, 6, 7, 8], [9] * 13, [3, 100, 42], list(range(10, 40))]
    outs = eng.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@needs_kernels
@pytest.mark.parametrize("kind", [INT4, INT8])
def test_an_engine_whose_linears_take_the_widened_gemm_answers_as_the_blocks(kind, tmp_path, monkeypatch):
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path))
    lm = tiny("llama", dtype="float32")
    blocks = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, quantization=kind))
    # measured at load for every layer linear and the LM head, shown by shape
    # (int4: a part whose blocks would be int8 makes its fused linear int8)
    assert blocks.kernels and any(k.startswith(f"{kind} ") for k in blocks.kernels)
    lean = blocks.runner.lean
    assert all(lin.rows is not None for lin in lean.linears())
    head = lean.lm_head
    assert f"{head.quant.kind} {head.shape[0]}x{head.shape[1]}" in blocks.kernels
    want = _greedy(blocks)
    widened = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, quantization=kind))
    wl = widened.runner.lean
    for layer in wl.layers:
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            lin.rows = RowChoice(1)
    wl.decode_layers.widened_from = 1
    assert _greedy(widened) == want
    assert wl.decode_layers._position is None  # no decode step took the C++ layers: their linears are the blocks'
    # a decode step below the crossover still takes them
    fused = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, quantization=kind))
    fused.runner.lean.decode_layers.widened_from = 64
    assert _greedy(fused) == want and fused.runner.lean.decode_layers._position is not None


@needs_kernels
def test_deterministic_keeps_one_kernel_for_every_row_count():
    lm = tiny("llama", dtype="float32")
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, quantization=INT4, deterministic=True))
    assert eng.kernels == {}
    assert all(lin.rows is None for lin in eng.runner.lean.linears())
    assert isinstance(eng.runner.lean.decode_layers, FusedDecode) and eng.runner.lean.decode_layers.widened_from is None


@needs_kernels
def test_validate_only_shows_what_a_load_on_this_machine_picked(tmp_path, monkeypatch, capsys):
    from fusion.cli import main

    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path / "cache"))
    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({
        "variants": {"llama": {"model": {"source": "tiny:llama", "dtype": "float32", "quantization": "int4",
                                         "max_batch_size": 4, "max_batch_tokens": 64}}},
        "runconfig": {"threads_per_worker": 1, "devices": "cpu"}}))
    argv = ["--mode", "validate_only", "--params", str(params), "--variants", "llama,1"]
    assert main(argv) == 0
    assert "worker 0: measured at its first load on this CPU" in capsys.readouterr().out
    threads = torch.get_num_threads()
    try:  # the worker's load: one thread, the planned batch
        eng = Engine(tiny("llama", dtype="float32"), EngineConfig(max_batch_size=4, max_batch_tokens=64,
                                                                   quantization="int4", num_threads=1))
    finally:
        torch.set_num_threads(threads)
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert all(f"{k}: {v}" in shown for k, v in eng.kernels.items()), shown


def test_each_bucket_above_the_crossover_takes_its_fastest_many_rows_way():
    """With the AMX tiles' way beside the widened GEMM, the blocks keep the few rows and each larger
    bucket takes whichever of the two is faster there, as one choice that says so."""
    seconds = {1: {BLOCKS: 1.0, WIDENED: 3.0, PACKED: 2.0}, 4: {BLOCKS: 1.0, WIDENED: 2.0, PACKED: 0.5},
               16: {BLOCKS: 4.0, WIDENED: 2.0, PACKED: 1.0}, 64: {BLOCKS: 16.0, WIDENED: 2.0, PACKED: 3.0},
               512: {BLOCKS: 99.0, WIDENED: 9.0, PACKED: 5.0}}
    choice = pick(seconds)
    assert choice == RowChoice(2, PACKED, ((17, WIDENED), (65, PACKED)))
    assert [choice.way(r) for r in (1, 2, 16, 17, 64, 65, 600)] == [BLOCKS, PACKED, PACKED, WIDENED, WIDENED,
                                                                     PACKED, PACKED]
    assert choice.uses(PACKED) and choice.uses(BLOCKS) and not RowChoice().uses(PACKED)
    assert (choice.first(BLOCKS), choice.first(PACKED), choice.first(WIDENED)) == (1, 2, 17)
    assert RowChoice().first(BLOCKS) == 1 and RowChoice(1, PACKED).first(BLOCKS) is None
    assert RowChoice(5).first(PACKED) is None
    assert choice.describe() == "blocks up to 1 rows, packed from 2, widened from 17, packed from 65"
    with pytest.raises(ValueError, match="many-rows ways"):
        RowChoice(4, BLOCKS)


def test_the_tiles_keep_a_bucket_the_widened_gemm_wins_by_less_than_the_margin():
    """Level timings of the two 16-bit ways give the tiles, whichever came out ahead by a hair, so
    two loads on one machine choose alike; a clear win still takes the widened GEMM."""
    near = {64: {BLOCKS: 9.0, WIDENED: 0.97, PACKED: 1.0}, 512: {BLOCKS: 99.0, WIDENED: 0.95, PACKED: 1.0}}
    assert pick(near) == RowChoice(17, PACKED)
    clear = {64: {BLOCKS: 9.0, WIDENED: 0.97, PACKED: 1.0}, 512: {BLOCKS: 99.0, WIDENED: 0.8, PACKED: 1.0}}
    assert pick(clear) == RowChoice(17, PACKED, ((65, WIDENED),))
    assert batch_way({BLOCKS: 1.0, WIDENED: 0.5}) == WIDENED  # no tiles on this CPU


def test_the_amx_tiles_way_multiplies_as_the_widened_values_do():
    """The blocks' values packed in the AMX tiles' layout and multiplied there (or by vdpbf16ps without
    the tiles) give x @ W.T + bias of the values
    rounded to bfloat16 (summed in float32, rounded once), for row counts across a block of rows,
    in panels of 64 output rows where they divide into them and of 32 where they do not."""
    kernels = extension.kernel_module()
    if not tiles_fit(kernels):
        pytest.skip("this CPU has no bfloat16 dot products for the packed values (AMX or AVX512-BF16), or the level is capped below them: the way is not offered")
    gen = torch.Generator().manual_seed(0)
    for kind, out in ((INT4, 96), (INT8, 96), (INT4, 128), (INT8, 192)):
        qw = quantize(torch.randn(out, 128, generator=gen), kind)
        bias = torch.randn(out, generator=gen).to(torch.bfloat16)
        packed = pack_for_tiles(kernels, {"w": qw})["w"]
        panel = 64 if out % 64 == 0 else 32
        assert packed.shape == (out // panel, 128, panel)
        w = qw.dequantize().to(torch.bfloat16).float()
        for rows in (1, 5, 32, 33, 100):
            x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
            got = kernels.bf16_packed_linear(x, packed, bias).float()
            want = x.float() @ w.T + bias.float()
            assert torch.allclose(got, want, rtol=2 ** -7, atol=1e-2), (kind, out, rows, (got - want).abs().max())
    # an input size that is no multiple of 32: the last pairs fill part of a tile
    w = torch.randn(64, 130, generator=gen).to(torch.bfloat16)
    for rows in (3, 40):
        x = torch.randn(rows, 130, generator=gen).to(torch.bfloat16)
        got = kernels.bf16_packed_linear(x, kernels.bf16_pack(w), None).float()
        want = x.float() @ w.float().T
        assert torch.allclose(got, want, rtol=2 ** -7, atol=1e-2), (rows, (got - want).abs().max())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.bf16_pack(torch.zeros(40, 128, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x has 64 features, the weights 130"):
        kernels.bf16_packed_linear(torch.zeros(2, 64, dtype=torch.bfloat16), kernels.bf16_pack(w), None)


def test_packed_linears_are_written_once_and_mapped_by_every_copy(tmp_path, monkeypatch):
    """The copies' packed values live in one file of the cache, keyed by the machine: a second copy
    maps it without packing again, and a copy wanting a key the file lacks writes it again."""
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path))
    built = []

    def build(keys):
        built.append(keys)
        return {k: torch.full((2, 64), float(i), dtype=torch.bfloat16) for i, k in enumerate(keys)}

    first = quantized_cache.shared_packed("tiny:llama", torch.bfloat16, "int4", ["a", "b"], lambda: build(["a", "b"]))
    again = quantized_cache.shared_packed("tiny:llama", torch.bfloat16, "int4", ["b"], lambda: build(["b"]))
    assert built == [["a", "b"]] and torch.equal(first["b"], again["b"]) and again["b"][0, 0].item() == 1.0
    assert quantized_cache.packed_path("tiny:llama", torch.bfloat16, "int4").parent == tmp_path / "quantized"
    quantized_cache.shared_packed("tiny:llama", torch.bfloat16, "int4", ["c"], lambda: build(["c"]))
    assert built[-1] == ["c"]


def test_a_later_load_lays_out_only_the_values_its_kept_choice_takes(tmp_path, monkeypatch):
    """A choice kept from an earlier load on this machine decides which linears get their values laid
    out for a many-rows way (packed for AMX tiles, or widened to float32 on a bfloat16 CPU without
    them): none of those whose choice does not take it, each of those whose choice does."""
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path))
    lm = tiny("llama", dtype="bfloat16")
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, quantization=INT4))
    lean = eng.runner.lean
    ways = {way: values for way, values, offered in ((PACKED, "packed16", lean.compute == torch.bfloat16
                                                      and tiles_fit(lean.norms)),
                                                     (FLOAT32, "wide32", float32_fits(lean.norms, lean.compute)))
            if offered}
    if not ways:
        pytest.skip(f"this CPU (level {capability.cpu_capability().level}) computes the model in "
                    f"{lean.compute}: no way of the row kernels reads laid-out values here")
    asked: dict[str, set[str]] = {}

    def packs(asked_way, weights):
        assert asked_way in ways and asked_way not in asked
        asked[asked_way] = set(weights)
        return lay_out(lean.norms, asked_way, weights)

    again = lean.pick_row_kernels(64, packs)
    assert again == eng.kernels  # read back, not measured anew
    quantized = [lin for lin in lean.linears() if lin.quant is not None]
    for way, values in ways.items():
        takes = [lin for lin in quantized if lin.rows.uses(way)]
        assert len(asked.get(way, ())) == len(takes)
        assert asked.get(way, set()) <= set(lean.quantized_weights())
        assert all((getattr(lin, values) is not None) == (lin in takes) for lin in quantized)


def test_a_first_load_writes_only_the_values_its_choice_takes(tmp_path, monkeypatch):
    """On a bfloat16 CPU without AMX tiles, a load that measures times the float32 way on values
    widened in its own memory, and the bfloat16 pairs on values packed there, and asks for each
    file's only for the linears whose choice takes its way (none at all where none does), so a CPU
    where the blocks or bfloat16 win writes no float32 file."""
    lm = tiny("llama", dtype="bfloat16")
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path / "first"))
    eng = Engine(lm, EngineConfig(max_batch_size=4, max_batch_tokens=64, quantization=INT4))
    lean = eng.runner.lean
    if not float32_fits(lean.norms, lean.compute):
        pytest.skip(f"the float32 way is offered on a CPU computing in bfloat16 without AMX tiles; this one is at "
                    f"level {capability.cpu_capability().level}, computing in {lean.compute}")
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path / "again"))  # nothing kept: measured anew
    asked: dict[str, set[str]] = {}

    def packs(way, weights):
        asked[way] = set(weights)
        return lay_out(lean.norms, way, weights)

    lean.pick_row_kernels(64, packs)
    quantized = [lin for lin in lean.linears() if lin.quant is not None]
    # the bfloat16 pairs (vdpbf16ps) likewise: measured on values packed here, the file's asked for the chosen
    for way, values in ((FLOAT32, "wide32"), (PACKED, "packed16")):
        takes = {key for key, lin in lean._keyed.items() if lin.quant is not None and lin.rows.uses(way)}
        assert asked.get(way) == (takes or None)
        assert all((getattr(lin, values) is not None) == lin.rows.uses(way) for lin in quantized)


def test_a_way_that_wins_few_rows_and_draws_many_takes_them_all():
    """A many-rows way that beats the blocks by the margin at a small bucket and draws with them (within
    the margin either way) at the larger ones starts there and keeps every larger bucket; where the
    blocks beat it by the margin at a larger bucket, only a bucket above that one it wins can start it."""
    seconds = {4: {BLOCKS: 1.0, WIDENED: 3.0, PACKED: 1.5}, 16: {BLOCKS: 2.0, WIDENED: 3.0, PACKED: 1.0},
               64: {BLOCKS: 5.0, WIDENED: 6.0, PACKED: 4.3}, 256: {BLOCKS: 20.0, WIDENED: 22.0, PACKED: 19.0},
               512: {BLOCKS: 40.0, WIDENED: 44.0, PACKED: 41.0}}
    assert pick(seconds) == RowChoice(5, PACKED)
    seconds[256][PACKED] = 23.0  # the blocks win 256 rows by the margin: 256 rows and fewer keep them
    assert pick(seconds) == RowChoice()  # 512 rows only drew
    seconds[512][PACKED] = 30.0
    assert pick(seconds) == RowChoice(257, PACKED)


def test_the_float32_way_takes_the_buckets_it_wins_and_says_so():
    """On a CPU whose bfloat16 GEMMs lose many rows to float32 ones, the float32 way takes the
    buckets it wins by the margin, and the choice names it."""
    seconds = {4: {BLOCKS: 1.0, WIDENED: 3.0, FLOAT32: 2.0}, 16: {BLOCKS: 2.0, WIDENED: 3.0, FLOAT32: 1.9},
               64: {BLOCKS: 8.0, WIDENED: 9.0, FLOAT32: 5.0}, 512: {BLOCKS: 60.0, WIDENED: 50.0, FLOAT32: 30.0}}
    choice = pick(seconds)
    assert choice == RowChoice(17, FLOAT32)
    assert [choice.way(r) for r in (1, 16, 17, 600)] == [BLOCKS, BLOCKS, FLOAT32, FLOAT32]
    assert choice.describe() == "blocks up to 16 rows, float32 from 17" and choice.first(FLOAT32) == 17
    # the widened GEMM still takes a bucket it wins
    seconds[512][WIDENED] = 20.0
    assert pick(seconds) == RowChoice(17, FLOAT32, ((65, WIDENED),))


@needs_kernels
@pytest.mark.parametrize("kind", [INT4, INT8])
def test_the_float32_way_multiplies_the_blocks_values_in_float32(kind):
    """The blocks' values widened once to float32 and multiplied there give x @ W.T + bias of the
    exact values (no bfloat16 rounding of the weights), rounded once to the activations' dtype, at
    the rows its choice gives it; fewer rows keep the blocks."""
    gen = torch.Generator().manual_seed(0)
    qw = quantize(torch.randn(96, 128, generator=gen), kind)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    lin = Linear.quantized(qw, bias, torch.bfloat16, KERNELS, "plain")
    lin.wide32 = widen_to_float32({"w": qw})["w"]
    lin.rows = RowChoice(5, FLOAT32)
    w = qw.dequantize().double()
    for rows in (1, 4, 5, 33):
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
        got = lin(x)
        want = x.double() @ w.T + bias.double()
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        if rows >= 5:  # float32 sums of exact values, rounded once to bfloat16
            assert torch.equal(got, want.to(torch.bfloat16)) or torch.allclose(
                got.double(), want, rtol=2 ** -8, atol=1e-5), (kind, rows, (got.double() - want).abs().max())
        torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=0.3)


def test_float32_values_are_a_file_of_their_own(tmp_path, monkeypatch):
    """The values widened to float32 go to a file beside the tiles' packing, not into it, and a copy
    maps them without widening again."""
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path))
    built = []

    def build(keys, dtype):
        built.append(dtype)
        return {k: torch.full((2, 64), float(i), dtype=dtype) for i, k in enumerate(keys)}

    wide = quantized_cache.shared_packed("tiny:llama", torch.bfloat16, "int4", ["a"],
                                         lambda: build(["a"], torch.float32), FLOAT32)
    tiles = quantized_cache.shared_packed("tiny:llama", torch.bfloat16, "int4", ["a"],
                                          lambda: build(["a"], torch.bfloat16))
    again = quantized_cache.shared_packed("tiny:llama", torch.bfloat16, "int4", ["a"],
                                          lambda: build(["a"], torch.float32), FLOAT32)
    assert built == [torch.float32, torch.bfloat16]
    assert again["a"].dtype == torch.float32 and tiles["a"].dtype == torch.bfloat16 and torch.equal(wide["a"], again["a"])
    paths = {quantized_cache.packed_path("tiny:llama", torch.bfloat16, "int4", w) for w in (PACKED, FLOAT32)}
    assert len(paths) == 2 and all(p.exists() for p in paths)
