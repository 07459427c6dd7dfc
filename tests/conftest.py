"""Test settings: offline, and a hermetic cache under the checkout; the real models, once per session.

Helpers live in tests/support/. The cache is `.cache/test-<torch>-<transformers>/` in the
checkout, never ~/.cache: a rerun finds its converted weights and compiled kernels again, and a
new torch or transformers gets a fresh one. Tests of a cold path set their own empty directory.
"""

from __future__ import annotations

import os
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two pytest-xdist processes (and the workers their tests start) share the machine's cores: an
# OpenMP thread that waits for work sleeps instead of spinning on a core another process needs
# (on 2 cores, spinning made the in-process engine tests take ~1.6x as long). libgomp reads this
# when torch loads it, so it is set before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
CACHE = Path(__file__).resolve().parents[1] / ".cache" / f"test-{version('torch')}-{version('transformers')}"
os.environ["MMFUSION_CACHE"] = str(CACHE)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(CACHE / f"inductor-{os.environ.get('MMFUSION_CPU_ISA', 'native')}")
# the C++ kernels are not in that cache: they live beside their sources (built by `make install`, or
# at the first load), also for tests that start from an empty cache
# Without a GPU, Triton's kernels (workers.engine.cuda.triton_attention) run in its interpreter on the CPU.
# Triton reads this when its language is defined, and importing the engine imports Triton (torch's
# compiler does), so it is set here, before anything imports either.
if not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from workers.gc_pause import import_paused  # noqa: E402

import_paused("workers.models")  # as a worker does: seconds less of each test process's start
from workers.files import one_at_a_time  # noqa: E402
from workers.models import load_model  # noqa: E402
from workers.weights.hf_loader import write_gguf_cache  # noqa: E402
from workers.weights.sources import embedded_gguf, gguf_cache_dir  # noqa: E402


def embedded(name: str):
    """An embedded model in float32. The first to ask (in any test process: a lock orders them)
    loads it from its GGUF file and converts it into the test cache, as compile_only does; every
    later load, in this process or in a worker a test starts, reads the conversion in seconds."""
    gguf = embedded_gguf(name)
    with one_at_a_time(CACHE / name):
        if gguf_cache_dir(gguf) is None:
            lm = load_model(name, dtype="float32", use_cache=False)
            write_gguf_cache(lm.model, lm.tokenizer, gguf)
            return lm
    return load_model(name, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_fp32():
    return embedded("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_fp32():
    return embedded("gemma3-270m")


@pytest.fixture(scope="session")
def embedded_models(smollm2_fp32, gemma3_fp32) -> None:
    """For tests whose subprocesses load the embedded models: converted in the test cache first."""


# The modules that take longest, first (their tests' summed time, measured on 2 AVX2 cores): pytest-xdist hands whole modules
# (--dist loadscope, in collection order: --no-loadscope-reorder) to its workers, so the long ones
# start at once and the short ones fill in after.
LONGEST_FIRST = ["test_ray.py", "test_batch_modes.py", "test_batch_integrity.py", "test_quantized.py", "test_parity.py",
                 "test_integrity.py", "test_weight_owner.py", "test_crash_recovery.py", "test_gguf_stream.py",
                 "test_models_runtime.py", "test_gil.py", "test_predict.py", "test_shared_weights.py", "test_compiled.py",
                 "test_fuzz.py", "test_precision.py", "test_triton_kernels.py", "test_lean.py", "test_http_lm_eval.py",
                 "test_http.py", "test_models.py", "test_cuda_runner.py", "test_imports.py", "test_serve.py",
                 "test_gpu_sharing.py", "test_security.py", "test_faults.py", "test_router_lifecycle.py", "test_routing.py",
                 "test_deterministic.py", "test_detok.py", "test_census.py", "test_scheduler.py"]


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
