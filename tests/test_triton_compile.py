"""The CUDA room's Triton kernels compile for a Hopper GPU (sm_90) on this machine, GPU or not:
Triton's compiler runs to machine code here (its package carries ptxas), so a kernel that the
interpreter runs but a GPU's compiler refuses fails here, before a GPU is at hand
(tests/support/triton_aot.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def _ptxas() -> bool:
    nvidia = Path(triton.__file__).parent / "backends" / "nvidia"
    return (nvidia / "bin" / "ptxas").exists() or shutil.which("ptxas") is not None


@pytest.mark.skipif(not _ptxas(), reason="this Triton has no NVIDIA backend with ptxas to compile for a GPU")
def test_every_cuda_kernel_compiles_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "triton_aot.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    compiled = out.stdout.split()
    for kernel in ("_segment_kernel", "_merge_kernel", "_paged_attention_kernel", "_kv_write_kernel",
                   "_add_rms_norm_kernel", "_rope_kv_write_kernel", "_act_mul_kernel", "_qgemv_kernel",
                   "_qgemv_flat_kernel", "_sum_splits_kernel", "_sandwich_kernel", "_qk_norm_kernel"):
        assert kernel in compiled, kernel
    for kernel in ("_linear_kernel", "_qlinear_kernel"):  # bfloat16 and float32
        assert {"bf16", "fp32"} <= {compiled[i + 1] for i, w in enumerate(compiled) if w == kernel}, kernel
