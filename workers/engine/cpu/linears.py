"""Linear layers with their weights prepacked once, in the layout the machine's GEMM wants.

Two packings, chosen per model at load (workers.precision):
- "onednn": `torch.ops.mkldnn._reorder_linear_weight` lays a float32 or bfloat16 weight out once
  in oneDNN's blocked format and `_linear_pointwise` multiplies against it, as vLLM's CPU backend
  does. A plain `F.linear` hands oneDNN a row-major weight on every call, and a decode step's
  matmuls (a few rows against every weight) then read the weights at about half the memory's speed.
- "fp16": FBGEMM's fp16-weight linear (`quantized.linear_prepack_fp16` / `linear_dynamic_fp16`):
  float16 weights, float32 activations and float32 math, packed in slices of rows (PACK_ROWS). On a CPU without bf16 arithmetic a decode
  step is bound by the weight bytes it reads, and this reads half of float32's. A bfloat16 weight
  goes in as float16 when every value converts exactly (7 mantissa bits fit in 10 over float16's
  range); one that does not is multiplied in float32 through oneDNN instead.

- weight-only int8 or int4 blocks (workers.quant, `quantization`): the C++ kernels
  (kernels/qlinear.cpp) widen each block to float32 in registers and multiply the activations in
  float32, reading a third (int4) or a half (int8) of bfloat16's bytes. A step of many rows may
  instead take ATen's GEMM on the blocks widened to the compute dtype, where the machine measured
  it faster for that row count (`rows`, workers.engine.cpu.row_kernels), or, on a CPU with AMX
  tiles, the blocks' values packed once in bfloat16 for the tiles (`packed16`, a view of a file
  the copies share) multiplied by ATen's batch-reduce GEMM, or, on a CPU that computes in bfloat16
  without AMX tiles, the values widened once to float32 (`wide32`, a shared file's view too)
  multiplied by ATen's float32 GEMM. Where the kernels could
  not be built, the blocks' float32 values are multiplied as a dense weight (`linears`' way).

Packed weights are tensors of this process (an opaque layout, not a plain buffer), so they cannot
live in the shared-weights file: each process that packs holds its own copy, which the plan counts
(`own_bytes`). Other devices and dtypes (CUDA, float64) keep `F.linear`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from workers.capability import cpu_capability
from workers.engine.cpu.invariant import in_tiles, invariant_any, invariant_rows
from workers.engine.cpu.row_kernels import BLOCKS, FLOAT32, PACKED, WIDENED
from workers.engine.lean_parts import fused_bias
from workers.precision import FP16, ONEDNN, PLAIN
from workers.quant.fuse import quantized_weight
from workers.quant.weight import QuantizedWeight

# FBGEMM packs a float16 weight of a few thousand rows at ~50M values/s on one thread here, and
# a taller one at ~12M/s (a 262,144-token LM head: 12 s; SmolLM2's: 2.5 s). Slices of PACK_ROWS
# rows pack at the fast rate, and multiply as fast as the whole (Zen 3, 1 to 8 rows of input).
PACK_ROWS = 8192
# the AMX tiles' packing (kernels/amx_linear.cpp) takes output rows in panels of 64, or of 32 where 64
# does not divide them, so a linear's output rows must divide into TILE_PANEL; inputs go in pairs
TILE_PANEL = 32
# (way, quantized weights by key) -> their values laid out for that way (row_kernels' PACKED: packed
# for the tiles; FLOAT32: widened to float32), by key
Packs = Callable[[str, dict[str, QuantizedWeight]], dict[str, torch.Tensor]]


def fp16_fits(weight: torch.Tensor) -> bool:
    """Whether a 16-bit weight goes into float16 without overflow. A bfloat16 weight converts
    exactly over float16's normal range (its 7 mantissa bits fit in 10); values below 2^-14 round
    to float16's subnormal grid, an absolute error under 3e-8, far below bfloat16's own rounding
    of the weight's larger values."""
    if weight.dtype == torch.float16:
        return True
    return bool(weight.abs().max() < torch.finfo(torch.float16).max) if weight.numel() else True


class Linear:
    """y = x @ weight.T + bias over rows x [M, in], in the way `kind` names ("onednn", "fp16",
    "plain"); the result is in the compute dtype (float32 for "fp16")."""

    __slots__ = ("weight", "bias", "packed", "fp16", "own_bytes", "quant", "kernels", "shape", "rows_per_call",
                 "strips", "dense", "rows", "packed16", "wide32")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kind: str | bool, own: bool = False,
                 compute: torch.dtype | None = None):
        """`own`: the weight is a tensor of this process already (not the model's parameter);
        `compute`: the activations' dtype, when it is not the weight's (the "fp16" kind's float32).
        A bool kind is oneDNN packing on (True) or off (False)."""
        kind = {True: ONEDNN, False: PLAIN}.get(kind, kind) if isinstance(kind, bool) else kind
        weight = weight.detach()
        self.shape = (weight.shape[0], weight.shape[1])  # (out, in)
        self.rows_per_call = 0  # any number (make_invariant fixes one)
        self.strips = False
        self.dense = None  # the weight the C++ strips read (make_invariant)
        self.rows = None  # quantized: the kernel by the step's row count (row_kernels.RowChoice; None: the blocks')
        self.packed16 = None  # quantized: its values packed in the AMX tiles' layout (the PACKED way), where chosen
        self.wide32 = None  # quantized: its values in float32 (the FLOAT32 way), where chosen
        compute = compute or weight.dtype
        self.bias = None if bias is None else bias.detach().to(compute)
        self.packed = self.fp16 = self.quant = self.kernels = None
        self.weight = None
        if kind == FP16 and fp16_fits(weight):
            self.fp16 = tuple(torch.ops.quantized.linear_prepack_fp16(
                weight[i:i + PACK_ROWS].float(), None if self.bias is None else self.bias[i:i + PACK_ROWS])
                for i in range(0, weight.shape[0], PACK_ROWS))
            self.own_bytes = weight.numel() * 2
        elif kind == FP16 or (kind == ONEDNN and weight.dtype != compute):
            # a weight beyond float16's range: float32 math over it, through oneDNN
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(compute))
            self.own_bytes = weight.numel() * torch.finfo(compute).bits // 8
        elif kind == ONEDNN:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            self.own_bytes = weight.numel() * weight.element_size()
        else:
            self.weight = weight if weight.dtype == compute else weight.to(compute)
            self.own_bytes = self.weight.numel() * self.weight.element_size() if own or weight.dtype != compute else 0

    @classmethod
    def quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None, compute: torch.dtype, kernels,
                  dense: str) -> Linear:
        """A linear over weight-only quantized blocks, through the C++ kernels' module `kernels`;
        None there: the blocks' values as a dense weight run the `dense` way (a kind above)."""
        if kernels is None:
            return cls(qw.dequantize().to(compute), bias, dense, own=True, compute=compute)
        lin = cls.__new__(cls)
        lin.weight = lin.packed = lin.fp16 = None
        lin.bias = None if bias is None else bias.detach().to(compute)
        lin.quant, lin.kernels, lin.own_bytes = qw, kernels, qw.nbytes
        lin.shape, lin.rows_per_call, lin.strips, lin.dense = (qw.out_features, qw.in_features), 0, False, None
        lin.rows = lin.packed16 = lin.wide32 = None
        return lin

    @property
    def path(self) -> str:
        """Which multiplication serves it: int4, int8, fp16, onednn or plain."""
        if self.quant is not None:
            return self.quant.kind
        return FP16 if self.fp16 is not None else ONEDNN if self.packed is not None else PLAIN

    @property
    def act8(self) -> int:
        """The most rows a call of the blocks takes with its activations rounded to 8 bits (its choice's)."""
        return self.rows.act8 if self.rows is not None else 0

    def blocks(self, x: torch.Tensor, act8: int | None = None) -> torch.Tensor:
        """A quantized linear through its format's C++ kernel on the blocks (workers.quant.formats);
        `act8`: calls of up to this many rows (at most 4) round the activations to 8 bits (None: as
        chosen, self.act8; 0: none)."""
        q = self.quant
        return getattr(self.kernels, q.format.cpu_kernel)(x, q.qs, q.scales, q.offsets, self.bias, self.strips,
                                                          self.act8 if act8 is None else act8)

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """A quantized linear through ATen's GEMM on its blocks widened to x's dtype (row_kernels)."""
        q = self.quant
        return self.kernels.qlinear_widened(x, q.qs, q.scales, q.offsets, self.bias)

    def tiles(self, x: torch.Tensor) -> torch.Tensor:
        """A quantized linear on its values packed in bfloat16 pairs: AMX tiles, else vdpbf16ps (row_kernels)."""
        return self.kernels.bf16_packed_linear(x, self.packed16, self.bias)

    def float32(self, x: torch.Tensor) -> torch.Tensor:
        """A quantized linear through ATen's float32 GEMM on its values widened to float32 (row_kernels)."""
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.wide32, bias).to(x.dtype)

    def make_invariant(self, compute: torch.dtype, like: int | None = None, kernels=None,
                       weight: torch.Tensor | None = None, own: bool = False) -> int:
        """Multiply each row the same way whatever rows come with it, from now on (`deterministic`).
        The C++ kernels' strips sum each row in one order for any number of rows: the quantized
        kernels' own, and for a dense linear `kernels.dense_strips` over `weight` (its [out, in]
        values; `own`: a tensor of this process, not a view of the model's), which then replaces
        the packed copy. They serve where invariant.invariant_any finds them so here;
        otherwise fixed tiles of rows (invariant.invariant_rows). `compute`: the activations'
        dtype; `like`: what this returned for a linear of the same path and shape, taken without
        checking again. Returns the rows a call (0: any number)."""
        if self.quant is not None and not like:
            self.strips = True
            if like == 0 or invariant_any(self.multiply, self.shape[1], compute):
                return 0
            self.strips = False
        if self.quant is None and not like and weight is not None and dense_strips_fit(kernels, weight):
            weight = weight.detach().contiguous()

            def strips(x: torch.Tensor) -> torch.Tensor:
                return kernels.dense_strips(x, weight, self.bias)

            if like == 0 or invariant_any(strips, self.shape[1], compute):
                self.dense, self.kernels = weight, kernels
                self.packed = self.fp16 = None  # the strips read `weight`: the packed copy goes
                self.weight = None
                self.own_bytes = weight.numel() * weight.element_size() if own else 0
                return 0
        self.rows_per_call = like or invariant_rows(self.multiply, self.shape[1], compute)
        return self.rows_per_call

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_per_call:
            return in_tiles(self.multiply, x, self.rows_per_call)
        return self.multiply(x)

    def multiply(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T + bias, for any number of rows."""
        if self.dense is not None:
            return self.kernels.dense_strips(x, self.dense, self.bias)
        if self.quant is not None:
            way = self.rows.way(x.shape[0]) if self.rows is not None else BLOCKS
            if way == WIDENED:
                return self.widened(x)
            if way == PACKED:
                return self.tiles(x)
            if way == FLOAT32:
                return self.float32(x)
            return self.blocks(x)
        if self.fp16 is not None:
            if len(self.fp16) == 1:
                return torch.ops.quantized.linear_dynamic_fp16(x, self.fp16[0])
            return torch.cat([torch.ops.quantized.linear_dynamic_fp16(x, part) for part in self.fp16], dim=-1)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def dense_strips_fit(kernels, weight: torch.Tensor) -> bool:
    """Whether the C++ strips can multiply by this dense weight: built at this CPU level, whole
    vectors of 16 output rows, blocks of 32 inputs, a 16- or 32-bit float."""
    return (kernels is not None and hasattr(kernels, "dense_strips") and kernels.dense_strips_built()
            and weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0
            and weight.dtype in (torch.bfloat16, torch.float16, torch.float32))


def fused(modules: list[torch.nn.Linear], kind: str | bool, compute: torch.dtype | None = None) -> Linear:
    """One Linear computing the outputs of `modules` side by side (q, k, v; gate, up): one weight
    read and one call instead of several. Its weight is a new tensor of this process."""
    weight = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight
    return Linear(weight, fused_bias(modules), kind, len(modules) > 1, compute)


def quantized(modules: list[torch.nn.Linear], kind: str, blocks: dict[int, QuantizedWeight], compute: torch.dtype,
              kernels, dense: str, built: QuantizedWeight | None = None) -> Linear:
    """One weight-only quantized Linear computing the outputs of `modules` side by side. `built`:
    its blocks as made before (a shared file's views); else `blocks`: a GGUF file's own blocks by
    id(module), used where every module has them, of one kind; otherwise the modules' weights are
    quantized afresh to `kind`, or to int8 where a part's blocks are int8 (the wider of its parts':
    a Q4_K file's q and k beside its Q6_K v)."""
    qw = built if built is not None else quantized_weight(modules, kind, blocks)
    lin = Linear.quantized(qw, fused_bias(modules), compute, kernels, dense)
    if built is not None and lin.quant is not None:
        lin.own_bytes = 0  # a shared file's views: the copies hold them once (the plan counts them so)
    return lin


def tiles_fit(kernels, shape: tuple[int, int] | None = None) -> bool:
    """Whether the packed values' way can serve: a CPU with bfloat16 dot products (AMX tiles, or
    AVX512-BF16's vdpbf16ps over the same layout; as the capability level allows), the kernels built
    with them, and (with `shape`, (out, in)) whole panels of output rows and pairs of inputs."""
    if (kernels is None or not hasattr(kernels, "bf16_pack_supported")
            or not cpu_capability().at_least("avx512_bf16")):
        return False
    if not kernels.bf16_pack_supported():
        return False
    return shape is None or (shape[0] % TILE_PANEL == 0 and shape[1] % 2 == 0)


def float32_fits(kernels, compute: torch.dtype) -> bool:
    """Whether the float32 way may serve: bfloat16 math through the kernels on a CPU without AMX
    tiles (as the capability level allows), where bfloat16 dot products may not outrun float32's."""
    return kernels is not None and compute == torch.bfloat16 and not cpu_capability().at_least("amx")


def widen_to_float32(weights: dict[str, QuantizedWeight]) -> dict[str, torch.Tensor]:
    """Each quantized weight's values in float32 (the FLOAT32 way's), by key."""
    return {key: qw.dequantize().float().contiguous() for key, qw in weights.items()}


def lay_out(kernels, way: str, weights: dict[str, QuantizedWeight]) -> dict[str, torch.Tensor]:
    """The values of `weights` as `way` (PACKED or FLOAT32) reads them, by key."""
    return pack_for_tiles(kernels, weights) if way == PACKED else widen_to_float32(weights)


def pack_for_tiles(kernels, weights: dict[str, QuantizedWeight]) -> dict[str, torch.Tensor]:
    """Each quantized weight's values (as the widened GEMM takes them: rounded to bfloat16) packed
    in the AMX tiles' layout, by key."""
    return {key: kernels.bf16_pack(qw.dequantize().to(torch.bfloat16)) for key, qw in weights.items()}
