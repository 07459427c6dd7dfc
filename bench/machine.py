"""The first JSON line of every benchmark: when, which commit, and on what machine it ran."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
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
