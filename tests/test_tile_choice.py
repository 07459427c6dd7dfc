"""The Triton linears' shapes measured at load (workers.engine.cuda.tile_choice): the rule that
picks one from timings, and the CUDA runner giving every linear the shape measured for its weight,
here with the Triton ops in Triton's interpreter on the CPU and a clock that makes the last
candidate the fastest. On a GPU the engine times them with CUDA events (bench/gpu.py's `kernels`
lines name what it chose)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton runs its kernels on a GPU, or on the CPU with TRITON_INTERPRET=1", allow_module_level=True)

from workers.engine import attention  # noqa: E402
from workers.engine.cuda import tile_choice  # noqa: E402
from workers.engine.cuda.ops import batch_invariant, triton_ops  # noqa: E402
from workers.engine.cuda.runner import CudaRunner  # noqa: E402
from workers.engine.cuda.triton_invariant import CANDIDATES  # noqa: E402
from workers.engine.cuda.triton_qlinear import GEMV_CANDIDATES  # noqa: E402
from workers.engine.kv_cache import CacheLayout  # noqa: E402
from workers.engine.runners.base import kv_dims  # noqa: E402
from workers.models import load_model  # noqa: E402
from workers.platform import CudaPlatform  # noqa: E402

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


def test_a_candidate_replaces_the_default_only_where_it_is_faster_on_average_by_the_margin():
    times = {("d", 1): 1.0, ("d", 8): 2.0, ("a", 1): 0.5, ("a", 8): 2.2, ("b", 1): 0.97, ("b", 8): 1.94}
    shape, ratios = tile_choice.choose("d", ["a", "b"], lambda c, r: times[c, r], [1, 8])
    assert shape == "a" and ratios == pytest.approx({"a": 0.8, "b": 0.97})  # a: (0.5 + 1.1) / 2
    # b alone is 3% faster: within the margin, the default stays
    assert tile_choice.choose("d", ["b"], lambda c, r: times[c, r], [1, 8])[0] == "d"
    assert tile_choice.choose("d", [], lambda c, r: times[c, r], [1, 8])[0] == "d"


def _runner(quantization: str, deterministic: bool) -> CudaRunner:
    """The CUDA runner of a tiny Llama with the Triton ops (their batch-invariant set under
    `deterministic`)."""
    lm = load_model("tiny:llama", dtype="float32", device=str(DEVICE))
    prec = CudaPlatform.quantized(CudaPlatform.compute(lm.dtype, True), quantization, True, "tiny")
    platform = CudaPlatform(DEVICE, prec, lean=True, deterministic=deterministic)
    holder = attention.install(lm.model)
    layout = CacheLayout.sized(platform, holder.groups, kv_dims(lm), 16, 4 << 20, 2, 64, lm.max_model_len,
                               prefix_caching=True)
    ops = batch_invariant(triton_ops()) if deterministic else triton_ops()
    return CudaRunner(lm, platform, holder, layout, max_batch_size=2, ops=ops, graphs=False)


def _logits(runner: CudaRunner, rows: int) -> torch.Tensor:
    host = runner.buffers.next_host()
    runner._fill(host, [], rows)
    runner.buffers.device_inputs.copy_(host.inputs)
    with torch.inference_mode():
        runner._decode_body(rows, greedy=True)
    return runner.buffers.logits[:rows].clone()


# weight-only blocks with the usual Triton set (timed at the row kernel's few rows); dense weights
# under `deterministic`, timed at a fixed any-rows set, whatever the engine's limits
@pytest.mark.parametrize("quantization,deterministic,last,rows", [
    ("int8", False, GEMV_CANDIDATES[-1], tile_choice.FEW_ROWS),
    ("none", True, CANDIDATES[-1], tile_choice.ANY_ROWS)])
def test_every_linear_takes_the_shape_measured_fastest_for_its_weight(quantization, deterministic, last, rows,
                                                                       tmp_path, monkeypatch):
    """Weight-only blocks get the row kernel's shape, dense weights under `deterministic` the
    invariant linear's tiles: here the last candidate (the clock runs down), whose ranges the
    split kernel adds. The kernel notes name each shape's choice, and the step's logits stay
    within rounding of the default shapes'. The next runner on the machine, of other batch limits,
    reads the kept choices and times nothing, so its bits are the first's."""
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path))
    before = _logits(_runner(quantization, deterministic), 2)
    runner = _runner(quantization, deterministic)
    clock = itertools.count()
    calls = []

    def timer(fn) -> float:
        tick = next(clock)
        if tick % len(rows) == 0:  # each shape runs, on its inputs of the fewest rows (the interpreter is slow)
            fn()
        calls.append(tick)
        return 1.0 / (1 + tick)

    notes = runner.pick_kernels(max_rows=64, timer=timer)
    linears = runner.device_lean.linears()
    shapes = {(lin.quant.kind, lin.quant.out_features, lin.quant.in_features) if lin.quant is not None
              else tuple(lin.weight.shape) for lin in linears}
    assert len(notes) == len(shapes) and set(notes.values()) == {last.name}, notes
    assert len(calls) == len(shapes) * len(rows) * (1 + len(CANDIDATES if quantization == "none" else GEMV_CANDIDATES))
    for lin in linears:
        chosen = lin.qlinear if lin.quant is not None else lin.dense
        assert chosen.keywords == ({"gemv": last} if lin.quant is not None else {"tiles": last})
    got = _logits(runner, 2)
    torch.testing.assert_close(got, before, atol=1e-4, rtol=1e-4)

    def no_timer(fn) -> float:
        raise AssertionError("a kept choice was timed again")

    again = _runner(quantization, deterministic)
    assert again.pick_kernels(max_rows=8, timer=no_timer) == notes  # other limits, the same choice
    assert torch.equal(_logits(again, 2), got)
