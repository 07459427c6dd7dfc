"""The CUDA runner's decode step, counted: the operations it dispatches a layer with the Triton ops
(here in Triton's interpreter on the CPU), so that the number of kernels a layer launches on a GPU
cannot creep back up where no GPU is there to see it. Views and allocations launch nothing and are
not counted. On a GPU, bench/gpu.py's census counts the kernels themselves (torch.profiler)."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("Triton runs its kernels on a GPU, or on the CPU with TRITON_INTERPRET=1", allow_module_level=True)

from workers.engine import attention  # noqa: E402
from workers.engine.cuda.ops import triton_ops  # noqa: E402
from workers.engine.cuda.runner import CudaRunner  # noqa: E402
from workers.engine.kv_cache import CacheLayout  # noqa: E402
from workers.engine.runners.base import kv_dims  # noqa: E402
from workers.models import load_model  # noqa: E402
from workers.platform import CudaPlatform  # noqa: E402

# what ~10 kernels a layer means here: the three linears of the fused q/k/v, o, gate/up and down
# (four), two norms with their residual adds, the rotary embedding with the KV write, the two
# kernels of the split attention counted as one op, SiLU x up: 9
LAYER_BUDGET = 12
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}  # allocations


class Census(TorchDispatchMode):
    """Counts the ops dispatched under it by name, but views (an output that aliases an input it
    does not write) and allocations."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        if func.__name__.split(".")[0] not in FREE and not view:
            self.ops[schema.name] += 1
        return func(*args, **(kwargs or {}))


# the Triton ops' device: the CPU under the interpreter, else the GPU
DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")


def _runner(arch: str) -> CudaRunner:
    """The CUDA runner of a tiny model with the Triton ops: what the engine builds on a GPU."""
    lm = load_model(f"tiny:{arch}", dtype="float32", device=str(DEVICE))
    prec = CudaPlatform.quantized(CudaPlatform.compute(lm.dtype, True), "none", True, "tiny")
    platform = CudaPlatform(DEVICE, prec, lean=True, deterministic=False)
    holder = attention.install(lm.model)
    groups = holder.groups if len(holder.groups.layers) == 1 else holder.groups.as_one()  # as the engine does
    layout = CacheLayout.sized(platform, groups, kv_dims(lm), 16, 4 << 20, 4, 64, lm.max_model_len,
                               prefix_caching=True)
    return CudaRunner(lm, platform, holder, layout, max_batch_size=4, ops=triton_ops())


def _count(runner: CudaRunner, rows: int, greedy: bool) -> Counter[str]:
    """The ops of one decode step of `rows` padded rows (what a graph's capture runs)."""
    host = runner.buffers.next_host()
    runner._fill(host, [], rows)
    runner.buffers.device_inputs.copy_(host.inputs)
    with torch.inference_mode(), Census() as census:
        runner._decode_body(rows, greedy)
    return census.ops


def _per_layer(runner: CudaRunner) -> tuple[float, Counter[str]]:
    """(ops a layer, the ops of a whole greedy step of 4 rows)."""
    lean = runner.device_lean
    layers = list(lean.layers)
    assert len(layers) >= 2
    whole = _count(runner, 4, greedy=True)
    lean.layers = layers[:1]
    try:
        one = _count(runner, 4, greedy=True)
    finally:
        lean.layers = layers
    return (sum(whole.values()) - sum(one.values())) / (len(layers) - 1), whole


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_decode_layer_dispatches_about_ten_ops_and_a_greedy_step_sorts_nothing(arch):
    runner = _runner(arch)
    layers = runner.device_lean.layers
    per_layer, whole = _per_layer(runner)
    assert per_layer <= LAYER_BUDGET, (per_layer, whole)
    # the Triton ops run, each once a layer
    for op in ("triton_rope_kv_write", "triton_decode_attention", "triton_silu_mul"):
        assert whole[f"mmfusion::{op}"] == len(layers), op
    assert whole["mmfusion::triton_add_rms_norm"] == 2 * len(layers) and whole["mmfusion::triton_rms_norm"] == 1
    assert "aten::sort" not in whole and "aten::cumsum" not in whole  # greedy: the argmax only
    sampled = _count(runner, 4, greedy=False)
    assert "aten::sort" in sampled  # the graph of a step with a sampled row still samples


def test_a_gemma3_decode_layer_dispatches_about_ten_ops_too():
    """Gemma 3's layer: the four linears, the q/k norms, the rotary embedding with the KV write, the
    attention, GELU x up, and each of its two joins to the residual stream (the sublayer's norm, the
    add, the next norm) one op."""
    runner = _runner("gemma3")
    layers = runner.device_lean.layers
    per_layer, whole = _per_layer(runner)
    assert per_layer <= LAYER_BUDGET, (per_layer, whole)
    for op in ("triton_qk_norm", "triton_rope_kv_write", "triton_decode_attention", "triton_gelu_mul"):
        assert whole[f"mmfusion::{op}"] == len(layers), op
    assert whole["mmfusion::triton_sandwich_norm"] == 2 * len(layers) and whole["mmfusion::triton_gemma_rms_norm"] == 1
