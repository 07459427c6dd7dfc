"""The device decided once: the device kinds a deployment knows (workers.devices), the platform
each gives a model (workers.platform), and the structure that keeps the decision in one place."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from support.models import tiny

from workers.devices import CPU, CUDA, check_device, device_kind, resolve_devices
from workers.engine import Engine, EngineConfig
from workers.engine.cpu.runner import CpuRunner
from workers.engine.runners import CompatRunner
from workers.platform import CpuPlatform, CudaPlatform, for_model, for_source, platform_class

ROOT = Path(__file__).resolve().parents[1]


def test_device_kinds_and_their_checks():
    assert device_kind("cpu") is CPU and device_kind("cuda:3") is CUDA and device_kind(torch.device("cuda")) is CUDA
    with pytest.raises(ValueError, match="is not one of cpu, cuda"):
        device_kind("tpu:0")
    assert check_device("cuda:1") == "cuda:1" and check_device("cpu") == "cpu"
    for bad in ("cpu:0", "cuda:x", "gpu", 3):
        with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda:N'"):
            check_device(bad)
    with pytest.raises(ValueError, match="'cuda:a' is not 'cpu' or 'cuda:N'"):
        resolve_devices("cpu,cuda:a")
    assert CPU.ray_bundle(3, 0.5) == {"CPU": 3.0} and CUDA.ray_bundle(None, 0.5) == {"GPU": 0.5, "CPU": 1.0}
    assert CPU.actor_device("cpu") == "cpu" and CUDA.actor_device("cuda:2") == "cuda:0"
    assert CUDA.owner_shares_weights and not CPU.owner_shares_weights and CPU.host and not CUDA.host


def test_the_platform_is_decided_once_and_the_engine_runs_what_it_says():
    assert platform_class("cpu") is CpuPlatform and platform_class("cuda:0") is CudaPlatform
    for arch, runner in (("llama", CpuRunner), ("gpt2", CpuRunner), ("bloom", CompatRunner)):
        lm = tiny(arch, dtype="float32")
        eng = Engine(lm, EngineConfig(max_batch_size=2, max_batch_tokens=16))
        assert eng.platform == for_model(lm, True) == for_source(f"tiny:{arch}", "float32", "cpu", True), arch
        assert type(eng.runner) is runner and eng.runner.platform is eng.platform
        lean = isinstance(eng.runner, CpuRunner) and eng.runner.lean is not None
        assert lean == eng.platform.lean == (arch == "llama"), arch
    # on CUDA, Gemma 3 and the Llama family run the device's lean forward, in bfloat16 too (on the CPU
    # Gemma 3's computes in float32 only)
    assert for_source("tiny:gemma3", "bfloat16", "cuda:0", True).precision.linears == "fused"
    assert for_source("tiny:llama", "bfloat16", "cuda:0", True).precision.linears == "fused"
    on_cpu = for_source("tiny:gemma3", "bfloat16", "cpu", True)
    assert on_cpu.lean == (on_cpu.precision.compute == torch.float32)  # float32 math where the CPU has no bf16


# what compares device names (the measure): the device kinds, the CUDA runner's own checks,
# and the custom ops' choice of kernels; everything else asks workers.devices or workers.platform
DEVICE_BRANCH = re.compile(r'device\.type|is_cuda|"cuda"|== "cpu"')


def test_device_branches_stay_in_a_few_files():
    files = sorted(str(p.relative_to(ROOT)) for pkg in ("fusion", "routing", "workers") for p in (ROOT / pkg).rglob("*.py")
                   if DEVICE_BRANCH.search(p.read_text()))
    assert len(files) <= 8, files


def test_the_engine_never_probes_its_runner():
    for name in ("workers/engine/engine.py", "workers/engine/compiled.py"):
        text = (ROOT / name).read_text()
        assert "getattr(" not in text and "hasattr(" not in text, name
