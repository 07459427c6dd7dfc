"""The house rules a reader relies on to find the room for a change: small classes and files, a
device's code in its room with the device decided in a few places, a quantization format named
only where formats live, and no repeated code inside the C++ kernels."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("wire", "workers", "routing", "fusion")
MAX_METHODS = 20
MAX_LINES = 800
# where a device's name may be compared against: the CUDA room asks whether its tensors are on a
# GPU (graphs, Triton) or on the CPU's stand-in; everything else asks workers.devices' kinds
DEVICE_BRANCHES = {"workers/engine/cuda/runner.py", "workers/engine/cuda/ops.py"}
DEVICE_NAMES = ("cpu", "cuda")
FORMAT_NAMES = ("int4", "int8", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0")


def product_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_class_has_more_than_twenty_methods():
    big = []
    for path in product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                n = sum(isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef)) for x in node.body)
                if n > MAX_METHODS:
                    big.append(f"{path.relative_to(ROOT)}: {node.name} has {n} methods")
    assert not big, big


def test_no_source_file_is_longer_than_800_lines():
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.cpp", "*.h"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked
    long = [f"{name}: {n} lines" for name in tracked
            if (ROOT / name).exists() and (n := len((ROOT / name).read_text().splitlines())) > MAX_LINES]
    assert not long, long


def test_device_branches_stay_in_the_cuda_room():
    found = set()
    for path in product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in DEVICE_NAMES
                                                     for c in [node.left, *node.comparators]):
                found.add(str(path.relative_to(ROOT)))
    assert found <= DEVICE_BRANCHES, sorted(found - DEVICE_BRANCHES)
    assert len(DEVICE_BRANCHES) <= 3


def test_a_quantization_format_is_named_only_where_formats_live():
    """Every other module asks workers.quant.formats' rows (bytes, GGUF types, devices, kernels)."""
    named = []
    for path in product_files():
        if path.is_relative_to(ROOT / "workers" / "quant"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in FORMAT_NAMES:
                named.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
    assert not named, named
