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
CACHE = Path(__file__).resolve().parents[1] / ".cache" / f"test-{version('torch')}-{version('transformers')}"
os.environ["MMFUSION_CACHE"] = str(CACHE)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(CACHE / "inductor")

import pytest  # noqa: E402

from workers.models import load_model  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_fp32():
    return load_model("smollm2-135m", dtype="float32")


@pytest.fixture(scope="session")
def gemma3_fp32():
    return load_model("gemma3-270m", dtype="float32")
