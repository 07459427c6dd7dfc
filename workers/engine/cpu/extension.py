"""The CPU's own attention and norm kernels (kernels/), built once per machine.

Decode attention in PyTorch operations costs a few dozen small operations per layer, and their
dispatch, not their arithmetic, is most of a decode step's attention time. The C++ kernel
does one pass per (row, KV head) over only the positions the row sees, as vLLM's CPU paged
attention does. It is compiled with torch's extension builder under a hash of the source, its
folder, torch and the CPU capability (about half a minute, once): by `make install` (`python -m
workers.engine.cpu.extension`), as a package's native code is built when it is installed, else at
first use. It goes beside the sources (`kernels/build/`, as an in-place build would put it), where
that folder is writable, else under `$MMFUSION_CACHE/kernels`; `$MMFUSION_KERNEL_CACHE` names
another place. It is built for the level workers.capability decides:
`-march=native` at the CPU's own level, an ISA target such as x86-64-v3 (AVX2, FMA, F16C) under
MMFUSION_CPU_ISA, and an engine on CPU hands it to its model's attention
(workers.engine.cpu.backend). Where it cannot be built (no compiler) or does not apply
(float64, softcapped scores), attention.decode_attention serves.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from workers.capability import cpu_capability
from workers.engine import attention
from workers.files import cache_root

log = logging.getLogger("mmfusion.kernels")
KERNELS = Path(__file__).with_name("kernels")
# two translation units, compiled side by side: the kernels (kernels.cpp includes each source) and
# their Python bindings
SOURCES = [KERNELS / "kernels.cpp", KERNELS / "bindings.cpp"]
# part of the build's hash: a change rebuilds
INCLUDED = sorted(path for path in KERNELS.iterdir() if path.suffix in (".cpp", ".h") and path not in SOURCES)
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# query rows of one KV head in one pass of the prefill kernel (kernels/paged_prefill.cpp), per dtype
PREFILL_LANES = {torch.bfloat16: 16, torch.float32: 8}
PREFILL_HEAD_DIMS = (64, 128, 256)  # the head sizes it has a path for
PREFILL_PATHS = {torch.bfloat16: "bf16_avx512", torch.float32: "f32_avx2"}  # the build's path for each dtype
# the compiler flags besides the level's target. Fast-math and OpenMP (at::parallel_for, omp simd):
# the dot products and exponentials vectorize (glibc's libmvec holds the vector exp)
CFLAGS = ("-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp")
LDFLAGS = ("-lmvec", "-fopenmp")
# where built kernels go, when not beside the sources (build_root)
KERNEL_CACHE_ENV = "MMFUSION_KERNEL_CACHE"
# a build takes under a minute: a lock older than this was left by a process killed while building
STALE_BUILD_LOCK_S = 900.0


@functools.cache
def _built() -> tuple[object | None, str | None]:
    """(the built extension module, None) or (None, why it could not be built): tried once per process."""
    try:
        return _build(), None
    except Exception as exc:  # no compiler, no ninja: the PyTorch path serves
        error = f"{type(exc).__name__}: {exc}"
        log.warning("paged decode kernel not built (%s): decode attention runs in PyTorch operations", error)
        return None, error


def _build():
    cap = cpu_capability()
    src = b"".join(path.read_bytes() for path in [*SOURCES, *INCLUDED])
    # the sources' folder too: torch's builder writes their paths into build.ninja, so two checkouts
    # sharing one folder rebuilt it for each other in turn; the flags, so that a change rebuilds
    # also where the built module is loaded as it is (below)
    flags = " ".join([*CFLAGS, *cap.cflags, *LDFLAGS])
    tag = hashlib.sha1(src + torch.__version__.encode() + cap.tag().encode() + str(KERNELS).encode()
                       + flags.encode()).hexdigest()[:16]
    name = f"mmfusion_paged_decode_{tag}"
    build = build_root() / tag
    built = load_built(name, build)
    if built is not None:
        return built
    from torch.utils import cpp_extension

    build.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(build / "lock")
    return cpp_extension.load(name=name, sources=[str(path) for path in SOURCES], build_directory=str(build),
                              extra_cflags=[*CFLAGS, *cap.cflags], extra_ldflags=list(LDFLAGS), verbose=False)


def load_built(name: str, build: Path):
    """The module built before under this tag (it names the sources, torch, the CPU level and the
    flags), loaded as it is; None where there is none yet, or a build holds its lock. torch's
    builder would check it again through ninja, and importing the builder imports setuptools: over
    a second of CPU in every process that starts a model, for a module that cannot be stale."""
    so = build / f"{name}.so"
    if not so.is_file() or (build / "lock").exists() or not whole_elf(so):
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:  # a half-written file (a build killed while linking): build again
        log.warning("built kernels %s unusable (%s): building them again", so, exc)
        return None
    return module


def whole_elf(path: Path) -> bool:
    """Whether `path` is a 64-bit ELF file as long as its header says (its section table, written
    last, ends inside it): a link killed halfway leaves a shorter file, which the loader would map
    past its end and the process die of SIGBUS on the first read there."""
    with open(path, "rb") as f:
        head = f.read(64)
        size = os.fstat(f.fileno()).st_size
    if len(head) < 64 or head[:5] != b"\x7fELF\x02":
        return False
    shoff = int.from_bytes(head[0x28:0x30], "little")
    entsize, count = int.from_bytes(head[0x3A:0x3C], "little"), int.from_bytes(head[0x3C:0x3E], "little")
    return 0 < shoff and shoff + entsize * count <= size


def build_root() -> Path:
    """Where builds go: $MMFUSION_KERNEL_CACHE, else beside the sources where that is writable
    (a read-only install), else under the cache."""
    if os.environ.get(KERNEL_CACHE_ENV):
        return Path(os.environ[KERNEL_CACHE_ENV])
    beside = KERNELS / "build"
    try:
        beside.mkdir(exist_ok=True)
        if os.access(beside, os.W_OK):
            return beside
    except OSError:
        pass
    return cache_root() / "kernels"


def clear_stale_lock(lock: Path, max_age: float = STALE_BUILD_LOCK_S) -> bool:
    """Remove a build lock older than any build takes: a process killed while it built left it,
    and torch's extension builder would wait on it forever. True when one was removed."""
    try:
        if time.time() - lock.stat().st_mtime > max_age:
            lock.unlink()
            log.warning("removed a stale kernel build lock %s (a build was killed)", lock)
            return True
    except FileNotFoundError:
        pass
    return False


def paged_decode_cpu(gs: attention.GroupStep, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float, softcap: float | None) -> torch.Tensor:
    """attention.decode_attention's contract, through the C++ kernel where it applies."""
    module = _built()[0] if key.dtype in KERNEL_DTYPES and softcap is None and gs.spans else None
    if module is None:
        return attention.decode_attention(gs, q, key, value, scaling, softcap)
    if gs.span_table is None:
        gs.span_table = torch.tensor(gs.spans, dtype=torch.long)
    return module.paged_decode(q, key, value, gs.pair_blocks, gs.span_table, scaling).to(q.dtype)


def build_error() -> str | None:
    """Why the kernel could not be built (after a try), or None."""
    return _built()[1]


def kernel_paths() -> list[str]:
    """The paths the built kernel has ("generic"; "f32_avx2", float32 decode attention, where built
    for AVX2 or above; and "bf16_avx512" at the avx512_bf16 level)."""
    module = _built()[0]
    return list(module.paths()) if module is not None else []


def kernel_module():
    """The built module, whose rms_norm(x, w, eps), add_rms_norm(h, delta, w, eps) and
    rope_write(qkv, cos, sin, key, value, blocks, offsets, heads, kvh) the lean forward runs on
    CPU, or None when it could not be built."""
    return _built()[0]


def paged_prefill_cpu(out: torch.Tensor, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, gs: attention.GroupStep,
                      window: int | None, scaling: float) -> bool:
    """Every prefill chunk of the step for one layer, into `out`'s rows; False where the kernel
    cannot take these tensors (a dtype or a layout prefill_kernel did not foresee) and attention's
    PyTorch path must serve."""
    return _built()[0].paged_prefill(out, q, key, value, gs.prefill_blocks, gs.prefill_table, window or 0, scaling)


def prefill_kernel(dtype: torch.dtype, head_dim: int) -> Callable | None:
    """The CPU prefill kernel (built once) for a model of this dtype and head size, or None where
    it has no path: bfloat16 needs the AVX512-BF16 build, float32 the AVX2 one, heads of 64, 128 or
    256, and a compiler. Decided once per model, so a model it does not serve builds no tables and
    makes no calls each step."""
    if dtype not in PREFILL_PATHS or head_dim not in PREFILL_HEAD_DIMS:
        return None
    return paged_prefill_cpu if PREFILL_PATHS[dtype] in kernel_paths() else None


def decode_kernel() -> Callable | None:
    """The CPU decode kernel (built once), or None when it could not be built."""
    return paged_decode_cpu if _built()[0] is not None else None


if __name__ == "__main__":  # `make install`: build the kernels for this CPU now, not at the first load
    started = time.perf_counter()
    if kernel_module() is None:  # not an install error: the PyTorch paths serve without them
        print(f"the C++ kernels could not be built ({build_error()}); PyTorch's operations will serve",
              file=sys.stderr)
        raise SystemExit(0)
    print(f"C++ kernels for this CPU ({cpu_capability().level}) in {build_root()}: {', '.join(kernel_paths())} "
          f"({time.perf_counter() - started:.1f} s)")
