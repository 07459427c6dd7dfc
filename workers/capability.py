"""What this machine's CPU can do, decided once per process. Every capability decision reads here:
the serving dtype of `auto`, which linears are prepacked and how, and how the C++ kernels are built.

CPUs of one machine type differ: some have AVX512-BF16 (native bf16 dot products) or AMX, some
AVX-512 without bf16, and some only AVX2/FMA/F16C (AMD Zen 3). The level is the highest of

    baseline < avx2 < avx512 < avx512_bf16 < amx

that the CPU's flags allow (amx: AMX tiles with bf16, as on Intel Sapphire Rapids). `MMFUSION_CPU_ISA=avx2`
(or `avx512`, `avx512_bf16`) caps it, so that an AVX-512 machine decides and builds its kernels as
an AVX2 one would, and an AMX machine as one with AVX512-BF16 and no AMX. Run it together with
torch's and its libraries' own switches, which they read when they start:

    MMFUSION_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2
    MMFUSION_CPU_ISA=avx512_bf16 ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16

(`AVX2_ENV` and `AVX512_BF16_ENV` below). Some of torch's checks read the CPU's flags, not those variables: oneDNN's
bf16 support is therefore asked of oneDNN and capped by the level here.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

ISA_ENV = "MMFUSION_CPU_ISA"
LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
# the environment that makes torch, oneDNN, FBGEMM and this project behave as on an AVX2-only CPU
AVX2_ENV = {ISA_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}
# and as on a CPU with AVX512-BF16 but no AMX (an AMX machine testing the paths without it)
AVX512_BF16_ENV = {ISA_ENV: "avx512_bf16", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
# the compiler's target for the kernels at a capped level (native: the CPU's own, -march=native);
# Cooper Lake is AVX512-BF16 without AMX
MARCH = {"baseline": "x86-64", "avx2": "x86-64-v3", "avx512": "x86-64-v4", "avx512_bf16": "cooperlake"}


def _cpuinfo(*fields: str) -> str | None:
    """The value of the first of `fields` in /proc/cpuinfo (the first CPU's), or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(fields):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (/proc/cpuinfo); empty where unreadable."""
    return frozenset((_cpuinfo("flags", "Features") or "").split())


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (/proc/cpuinfo), or the architecture where
    unreadable: machines of one kind differ in it, and a kernel choice measured on one is not
    taken on another."""
    return _cpuinfo("model name") or platform.machine()


def machine_tag() -> str:
    """What a figure measured on this machine depends on besides the model: the CPU's model, its
    level and flags (cpu_capability().tag) and torch."""
    return f"{cpu_model()}|{cpu_capability().tag()}|{torch.__version__}"


def native_level(flags: frozenset[str]) -> str:
    """The highest level these flags support."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        if {"amx_tile", "amx_bf16"} <= flags:
            return "amx"
        return "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "baseline"


@dataclass(frozen=True, slots=True)
class CpuCapability:
    """This process's CPU as the engine uses it."""

    native: str  # the level the CPU's flags allow
    level: str  # the level decisions are made at: native, or lower under MMFUSION_CPU_ISA
    bf16_arith: bool  # native bf16 dot products (AVX512-BF16 or AMX): bfloat16 computes fast
    onednn_bf16: bool  # oneDNN packs and multiplies bfloat16 linears
    fp16_gemm: bool  # FBGEMM's fp16-weight linear (float32 math over float16 weights) is at hand
    cflags: tuple[str, ...]  # the kernels' compiler flags for this level

    @property
    def capped(self) -> bool:
        return self.level != self.native

    def at_least(self, level: str) -> bool:
        return LEVELS.index(self.level) >= LEVELS.index(level)

    def tag(self) -> str:
        """What the kernels' build depends on: the architecture, the level, the flags and, at the
        native level, the CPU's own flags (a build for one CPU is not reused on another)."""
        own = " ".join(sorted(cpu_flags())) if not self.capped else ""
        return f"{platform.machine()}|{self.level}|{' '.join(self.cflags)}|{own}"

    def describe(self) -> dict:
        return {"cpu_isa": self.level, "native_isa": self.native, "bf16_arith": self.bf16_arith,
                "onednn_bf16": self.onednn_bf16, "fp16_gemm": self.fp16_gemm}


def _onednn_bf16() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _fbgemm_fp16() -> bool:
    return ("fbgemm" in torch.backends.quantized.supported_engines
            and hasattr(torch.ops.quantized, "linear_prepack_fp16"))


def decide(flags: frozenset[str], requested: str | None, machine: str | None = None) -> CpuCapability:
    """The capability for CPU flags and a requested cap (MMFUSION_CPU_ISA's value, or None)."""
    machine = machine or platform.machine()
    x86 = machine in ("x86_64", "AMD64", "i686", "i386")
    native = native_level(flags) if x86 else "baseline"
    level = native
    if requested:
        req = requested.strip().lower()
        if req not in LEVELS and req != "native":
            raise ValueError(f"{ISA_ENV}={requested!r}: use one of {', '.join(LEVELS)} or native")
        if req != "native" and LEVELS.index(req) < LEVELS.index(native):
            level = req
    at_least = LEVELS.index(level)
    if level == native:
        cflags = ("-march=native",) if x86 else ()
    else:
        cflags = (f"-march={MARCH[level]}", "-mtune=native")
    return CpuCapability(
        native=native, level=level,
        bf16_arith=at_least >= LEVELS.index("avx512_bf16"),
        # oneDNN's bf16 reorder wants AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; capped below AVX-512 it is off
        onednn_bf16=(_onednn_bf16() and (at_least >= LEVELS.index("avx512") or (level == native and not x86))),
        fp16_gemm=_fbgemm_fp16() and at_least >= LEVELS.index("avx2"),
        cflags=cflags)


@functools.cache
def cpu_capability() -> CpuCapability:
    """This process's capability: the CPU's flags under MMFUSION_CPU_ISA, decided once."""
    return decide(cpu_flags(), os.environ.get(ISA_ENV))
