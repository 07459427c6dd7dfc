"""The first JSON line of every benchmark: when, which commit, and on what machine it ran."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from pathlib import Path

# the CPU features that decide how fast these workloads can run
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni")


def cpu() -> dict:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    from workers.capability import cpu_capability

    # the level the engine decided at (MMFUSION_CPU_ISA may cap it below the CPU's own)
    return {"cpu_model": model, "cpu_flags": [f for f in FLAGS if f in flags], "cores": os.cpu_count(),
            **cpu_capability().describe(),
            **{k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "FBGEMM_ENABLE_INSTRUCTIONS")
               if k in os.environ}}


def commit() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def describe(bench: str, argv: list[str]) -> dict:
    import torch
    import transformers

    return {"bench": bench, "machine": True, "date": datetime.date.today().isoformat(), "commit": commit(),
            **cpu(), "torch": torch.__version__, "transformers": transformers.__version__,
            "command": " ".join(["python", *argv])}


# buffers read by read_rates: one that a large last-level cache holds (Sapphire Rapids class VMs
# report up to 300 MiB of L3 shared with their neighbours), and one no cache holds
READ_SIZES_MIB = (64, 1024)


def read_rates(repeats: int = 5) -> dict:
    """GB/s reading a buffer of each READ_SIZES_MIB size (a sum over bfloat16 values, best of
    `repeats`). A 2-core VM's pace moves with what its neighbours do to the shared cache and memory,
    and a run's figures with it: printed at a run's start and end, these say how far it moved."""
    import torch

    out = {}
    for mib in READ_SIZES_MIB:
        x = torch.ones(mib << 19, dtype=torch.bfloat16)
        x.sum()  # first touch
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        out[f"read_gb_s_{mib}mib"] = round(mib / 1024 / best, 1)
    return out
