"""How a model is held and computed on this machine: the dtype of its weights, the dtype it
computes in (activations, KV cache, logits), and how its linears run. The rules for a CPU live here,
decided from the requested dtype and the CPU's capability (workers.capability); the platform
(workers.platform) applies them, or a device's own, once at load.

On a CPU without bf16 arithmetic a decode step is bound by the bytes of weights it reads, so the
lean forward keeps 16-bit weights (half the bytes of float32) and computes in float32 through
FBGEMM's fp16-weight linear, as vLLM's CPU build runs bfloat16 weights with float32 math there.
Models that run transformers' own modules (without a lean forward, or `prepack_weights: false`)
compute in their weights' dtype.

    requested    CUDA       CPU with AVX512-BF16/AMX     CPU without (AVX2, AVX-512 without bf16)
    auto         bfloat16   bfloat16, oneDNN packed      float16 weights, float32 math (lean forward);
                            (Gemma 3: as without)        float32 for other models
    bfloat16     bfloat16   bfloat16, oneDNN packed      bfloat16 weights, float32 math (lean forward;
                                                         AVX-512: bfloat16 through oneDNN); bfloat16
                                                         for other models
    float16      float16    float16 weights, float32 math (lean forward); float16 for other models
    float32      float32    float32, oneDNN packed (lean forward)

Gemma 3's lean forward computes only in float32: where its weights would compute in bfloat16, it
runs transformers' modules (workers.engine.cpu.lean), so its `auto` is the float32-math choice of a
CPU without bf16 arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.capability import cpu_capability

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
HALF = (torch.bfloat16, torch.float16)
ONEDNN, FP16, PLAIN = "onednn", "fp16", "plain"  # how the lean forward's linears run
FUSED = "fused"  # on a GPU: q/k/v and gate/up each one linear over the weights laid out side by side
# the lean forward's linears as weight-only quantized blocks (workers.quant), or not
NO_QUANTIZATION = "none"


@dataclass(frozen=True, slots=True)
class Precision:
    weights: torch.dtype  # the parameters as loaded (shared between copies)
    compute: torch.dtype  # activations, the KV cache and logits
    # the lean forward's linears: "onednn" prepacked for oneDNN in the compute dtype; "fp16" FBGEMM's
    # packed float16 weights with float32 math; "fused" (GPU) F.linear on q/k/v and gate/up side by side; "plain"
    # F.linear on the weights
    linears: str
    # "int8" or "int4": the lean forward's linears read weight-only quantized blocks (a GGUF file's
    # own where it has them) and multiply them in float32, whatever `linears` says; "none": not
    quantization: str = NO_QUANTIZATION
    # `quantization: auto` on a GGUF file of kept blocks: only linears whose every part is one of the
    # file's kept blocks run quantized, the rest as loaded; `quantization` is the kind of most of
    # the layers' linears (workers.weights.gguf_blocks.file_class)
    file_classes: bool = False

    @property
    def mixed(self) -> bool:
        return self.weights != self.compute

    @property
    def quantized(self) -> bool:
        return self.quantization != NO_QUANTIZATION

    @property
    def quantized_key(self) -> str:
        """What names a set of quantized linears apart (the shared file of them, the catalog, a GPU's
        weight owner): `none` where there are none."""
        return "auto" if self.file_classes else self.quantization

    def describe(self) -> str:
        name = str(self.weights).removeprefix("torch.")
        linears = f"{self.quantization} weight-only linears" if self.quantized else f"{self.linears} linears"
        if self.file_classes:
            linears = f"weight-only linears of the GGUF file's classes (mostly {self.quantization})"
        if self.mixed:
            return f"{name} weights, {str(self.compute).removeprefix('torch.')} math ({linears})"
        return f"{name} ({linears})"


def named_dtype(dtype: str | torch.dtype) -> torch.dtype | None:
    """A dtype setting as torch's dtype; None for `auto`, which the platform decides
    (workers.platform). A name that is neither is a ValueError naming the choices."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def cpu_auto_weights(lean: bool, float32_lean: bool = False) -> torch.dtype:
    """`auto` on this CPU: bfloat16 with bf16 arithmetic; else float16 for the lean forward
    (16-bit weights, float32 math) where FBGEMM has its fp16 linear, float32 otherwise.
    `float32_lean`: the model's lean forward computes only in float32 (Gemma 3), so it takes the
    16-bit weights with float32 math even where bfloat16 would compute in bfloat16: bfloat16 there
    would leave it transformers' modules, four times slower a token."""
    cap = cpu_capability()
    if cap.bf16_arith and not (lean and float32_lean):
        return torch.bfloat16
    return torch.float16 if lean and cap.fp16_gemm else torch.float32


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks CPU linears of this dtype here: float32, and bfloat16 where oneDNN
    has a bf16 path on this CPU (workers.capability)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_capability().onednn_bf16)


def cpu_precision(weights: torch.dtype, lean: bool) -> Precision:
    """How a model loaded with `weights` computes on this CPU; `lean`: it runs the lean forward."""
    if not lean:
        return Precision(weights, weights, PLAIN)
    cap = cpu_capability()
    if weights in HALF and cap.fp16_gemm and not (weights == torch.bfloat16 and cap.onednn_bf16):
        return Precision(weights, torch.float32, FP16)
    return Precision(weights, weights, ONEDNN if onednn_packs(weights) else PLAIN)
