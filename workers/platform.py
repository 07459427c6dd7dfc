"""The device decided once: one Platform per model and device answers everything that depends on
the device, so that nothing else works it out again.

A platform is made from (source, dtype, device, prepack_weights, quantization, deterministic):
before loading, from the source alone (`for_source`: the plan, the weight loader), and at load
from the model itself (`for_model`: the engine). It says
- the precision: the weights' dtype, the compute dtype (activations, KV cache, logits), how the
  linears run (workers.precision);
- whether the lean forward on packed weights runs (workers.engine.cpu.lean);
- the KV budget where none is given, and the share of the pool the prefix cache keeps touched;
- the runner: its kind's room (workers.engine.runners.ROOMS), whose kernel chooser picks the
  attention and linear kernels;
- whether compiled graphs are captured as CUDA graphs, and what else they are keyed by.

A new device is a Platform here, named in PLATFORMS, a room of its own (workers/engine/<kind>/,
with its runner and kernel chooser) named in workers.engine.runners.ROOMS, and a DeviceKind
(workers.devices) for the deployment.

The platform imports nothing of the engine: the planner decides precision without loading
transformers, and the engine's modules may all ask it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch

from workers.config_keys import FLOAT32_LEAN, KV_AUTO_SHARE, LEAN_ARCHITECTURES, QUANTIZATIONS
from workers.devices import CPU, CUDA, DeviceKind, device_kind
from workers.precision import (
    FUSED,
    NO_QUANTIZATION,
    PLAIN,
    Precision,
    cpu_auto_weights,
    cpu_precision,
    named_dtype,
)
from workers.quant.formats import quant_format

if TYPE_CHECKING:
    from pathlib import Path

    from workers.weights.loaded_model import LoadedModel

# on CPU, the prefix cache keeps this share of the pool's blocks (at least one step's) before a
# never-used block is touched (workers.engine.block_manager): pages become resident as first used
CACHE_RESERVE_SHARE = 64


@dataclass(frozen=True, slots=True)
class Platform(ABC):
    device: torch.device
    precision: Precision
    lean: bool  # the lean forward on packed weights runs the model
    # `deterministic`: the runner builds its batch-invariant kernel set (else the usual one)
    deterministic: bool = False
    kind: ClassVar[DeviceKind]
    # each bucket's compiled layer graph is captured and replayed as a CUDA graph
    # (workers.engine.compiled.GraphReplay)
    cuda_graphs: ClassVar[bool] = False
    # the model classes whose lean forward this device runs (prepack_weights)
    lean_architectures: ClassVar[tuple[str, ...]] = ()
    # the device's lean forward holds every layer in one cache group, for the whole context (each
    # layer attends its own window in it)
    lean_one_group: ClassVar[bool] = False
    # the model classes whose lean forward here computes in float32 only
    float32_lean: ClassVar[tuple[str, ...]] = ()
    # `quantization: auto` keeps a GGUF file's blocks here (else auto is none)
    auto_keeps_blocks: ClassVar[bool] = False
    # what `deterministic: true` asks of a model here, when the lean forward does not run it
    deterministic_needs: ClassVar[str] = ""

    # --- the rules, before anything loads --------------------------------------------------------
    @staticmethod
    @abstractmethod
    def auto_weights(lean: bool, float32_lean: bool = False) -> torch.dtype:
        """The weights' dtype for `dtype: auto`; `lean`: the model will run the lean forward;
        `float32_lean`: its lean forward computes only in float32."""

    @staticmethod
    @abstractmethod
    def compute(weights: torch.dtype, lean: bool) -> Precision:
        """How weights of this dtype compute here, on the lean forward or transformers' modules."""

    @classmethod
    def quantized(cls, prec: Precision, quantization: str, lean: bool, model: str, gguf: Path | None = None) -> Precision:
        """`prec` with the `quantization` setting applied. `auto`: a GGUF file (`gguf`) whose layers
        are mostly blocks a format keeps (workers.quant.formats) keeps them where this device's `auto`
        does (auto_keeps_blocks) and the lean forward runs (`Precision.file_classes`); anything else is
        none. A format needs this device's kernels (its row's `devices`) and the lean forward, and a
        model that cannot have them is refused here, by name."""
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
        if quantization == "auto":
            if not (cls.auto_keeps_blocks and lean and gguf is not None):
                return prec
            from workers.weights.gguf_blocks import file_class

            kind = file_class(gguf)
            return prec if kind is None else replace(prec, quantization=kind, file_classes=True)
        if quantization == NO_QUANTIZATION:
            return prec
        if cls.kind.name not in quant_format(quantization).devices:
            raise ValueError(f"quantization {quantization!r} is not available on {cls.kind.name} yet: "
                             "set quantization: none (or auto)")
        if not lean:
            raise ValueError(f"quantization {quantization!r} runs on the lean forward, which {model} does not run here "
                             "(the Llama family, or Gemma 3 computing in float32, with prepack_weights: true): "
                             "set quantization: none (or auto)")
        return replace(prec, quantization=quantization)

    # --- at load ---------------------------------------------------------------------------------
    @abstractmethod
    def free_bytes(self) -> int:
        """The memory available now for an engine without a planned KV budget."""

    def kv_budget(self, useful_bytes: int) -> int:
        """The pool when no kv_cache_memory is given: what the engine's limits can use, up to a
        share of the memory available now (a deployment's plan gives each worker its budget)."""
        return max(1, min(useful_bytes, int(self.free_bytes() * KV_AUTO_SHARE)))

    def cache_reserve(self, num_blocks: int, step_blocks: int) -> int | None:
        """Blocks the prefix cache keeps before a never-used block is touched; None: no reserve."""
        return None

    def compile_isa(self) -> str:
        """What compiled graphs depend on besides the device type and dtype ('' for nothing)."""
        return ""

    def release(self) -> None:  # noqa: B027 - the host's memory goes back with the process
        """After an engine let go of its tensors: hand the device's memory back now."""


@dataclass(frozen=True, slots=True)
class CpuPlatform(Platform):
    kind: ClassVar[DeviceKind] = CPU
    auto_keeps_blocks: ClassVar[bool] = True
    lean_architectures: ClassVar[tuple[str, ...]] = LEAN_ARCHITECTURES
    float32_lean: ClassVar[tuple[str, ...]] = FLOAT32_LEAN
    deterministic_needs: ClassVar[str] = "a Llama-family model, or Gemma 3 in float32, with prepack_weights: true"

    @staticmethod
    def auto_weights(lean: bool, float32_lean: bool = False) -> torch.dtype:
        return cpu_auto_weights(lean, float32_lean)

    @staticmethod
    def compute(weights: torch.dtype, lean: bool) -> Precision:
        return cpu_precision(weights, lean)

    def free_bytes(self) -> int:
        import psutil

        return psutil.virtual_memory().available

    def cache_reserve(self, num_blocks: int, step_blocks: int) -> int | None:
        # a CPU pool becomes resident as its blocks are first used: reuse touched blocks first
        return max(num_blocks // CACHE_RESERVE_SHARE, step_blocks)

    def compile_isa(self) -> str:
        from workers.capability import cpu_capability

        return cpu_capability().level  # graphs built for one ISA are not another's


@dataclass(frozen=True, slots=True)
class CudaPlatform(Platform):
    """Not yet run on a GPU in this form (docs/operations.md): the Llama family and Gemma 3 run the
    device's lean forward with each decode step one CUDA graph (workers.engine.cuda.runner); other
    models run transformers' modules with piecewise CUDA graphs, on the PyTorch attention path."""

    kind: ClassVar[DeviceKind] = CUDA
    cuda_graphs: ClassVar[bool] = True
    # the formats' Triton kernel (workers.engine.cuda.triton_qlinear) is not yet measured against
    # cuBLAS, so `auto` keeps 16-bit weights here
    # the Llama family and Gemma 3 (workers.engine.cuda.lean) in the weights' dtype, one cache group
    lean_architectures: ClassVar[tuple[str, ...]] = LEAN_ARCHITECTURES
    lean_one_group: ClassVar[bool] = True
    deterministic_needs: ClassVar[str] = "a Llama-family model or Gemma 3 with prepack_weights: true"

    @staticmethod
    def auto_weights(lean: bool, float32_lean: bool = False) -> torch.dtype:
        return torch.bfloat16

    @staticmethod
    def compute(weights: torch.dtype, lean: bool) -> Precision:
        return Precision(weights, weights, FUSED if lean else PLAIN)

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def release(self) -> None:
        # every kernel done with the tensors, then the cached blocks and the references to a weight
        # owner's tensors (CUDA IPC) given back while the owner still runs: it then exits clean. The
        # CUDA platform on a CPU device (the tests' stand-in for the CUDA runner) has none to give
        if device_kind(self.device).host:
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()


# the one place a device kind picks its platform
PLATFORMS: dict[str, type[Platform]] = {CPU.name: CpuPlatform, CUDA.name: CudaPlatform}


def platform_class(device: torch.device | str) -> type[Platform]:
    return PLATFORMS[device_kind(device).name]


def weights_dtype(dtype: str | torch.dtype, device: torch.device | str, lean: bool = False,
                  float32_lean: bool = False) -> torch.dtype:
    """The dtype a model's weights load in on `device`. `lean`: the model will run the lean forward
    (which is what lets `auto` keep float16 weights on a CPU without bf16 arithmetic);
    `float32_lean`: that lean forward computes only in float32."""
    named = named_dtype(dtype)
    if named is not None:
        return named
    cls = platform_class(device)
    return cls.auto_weights(lean and bool(cls.lean_architectures), float32_lean)


def load_dtype(dtype: str | torch.dtype, device: torch.device | str, prepack: bool, source: str | None) -> torch.dtype:
    """The dtype `source`'s weights load in: `auto` counts the lean forward where the source is
    known to be of its family."""
    from workers.weights.sources import architecture

    arch = architecture(source) if source is not None else None
    lean = prepack and arch is not None and arch in platform_class(device).lean_architectures
    return weights_dtype(dtype, device, lean, arch in platform_class(device).float32_lean)


def for_source(source: str, dtype: str | torch.dtype, device: torch.device | str, prepack: bool,
               quantization: str = NO_QUANTIZATION, deterministic: bool = False) -> Platform:
    """The platform a worker of `source` will have, decided before loading it. A source whose
    family is unknown before loading counts as the lean forward's: the plan errs high (packed
    linears counted)."""
    from workers.weights.sources import architecture, source_gguf

    cls = platform_class(device)
    weights = load_dtype(dtype, device, prepack, source)
    arch = architecture(source)
    lean = prepack and bool(cls.lean_architectures) and (arch is None or arch in cls.lean_architectures)
    prec = cls.compute(weights, lean)
    if lean and prec.compute != torch.float32 and arch in cls.float32_lean:
        lean, prec = False, cls.compute(weights, False)  # that family's lean forward is float32 only
    return cls(torch.device(device), cls.quantized(prec, quantization, lean, source, source_gguf(source)), lean,
               deterministic)


def for_model(lm: LoadedModel, prepack: bool, quantization: str = NO_QUANTIZATION,
              deterministic: bool = False, cls: type[Platform] | None = None) -> Platform:
    """The platform of a loaded model: the lean forward runs where `prepack` asks, the device has
    it, and the model's own class and config allow it (workers.lean_rules.unsupported). A setting
    the model cannot have here (`quantization`, `deterministic`) is a ValueError that says why.
    `cls`: another device's rules for the model where it is (a test of them off that device)."""
    from workers.lean_rules import unquantizable, unsupported

    cls = cls or platform_class(lm.device)
    why = None if prepack else "prepack_weights is false"
    if why is None and not getattr(lm.model, "_supports_attention_backend", False):
        why = f"{type(lm.model).__name__} keeps an attention of its own"
    if why is None and type(lm.model).__name__ not in cls.lean_architectures:
        why = f"{type(lm.model).__name__} has no lean forward on {cls.kind.name}"
    if why is None:
        why = unsupported(lm.model, cls.compute(lm.dtype, True).compute, cls.float32_lean)
    lean = why is None
    if deterministic and not lean:
        raise ValueError(f"deterministic: true runs on {cls.kind.name} through the lean forward, which does not run "
                         f"this copy ({why}): use {cls.deterministic_needs}")
    from workers.weights.sources import source_gguf

    name = f"{lm.source} ({type(lm.model).__name__})"
    base = cls.compute(lm.dtype, lean)
    prec = cls.quantized(base, quantization, lean, name, source_gguf(lm.source))
    if prec.quantized and (why := unquantizable(lm.model)) is not None:
        if not prec.file_classes:
            raise ValueError(f"quantization {quantization!r} cannot run {name}: {why}; set quantization: none")
        prec = base  # auto: what cannot be quantized runs as it loaded
    return cls(lm.device, prec, lean, deterministic)
