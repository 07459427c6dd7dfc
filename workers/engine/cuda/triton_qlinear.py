"""A Triton kernel for weight-only quantized linears (workers.quant's blocks of 32) on a GPU:
y = x @ W.T + bias with W read as int4 or int8 blocks and widened in registers, so a decode step
reads a quarter (int4) or half (int8) of bfloat16's weight bytes.

Two kernels:
- a few rows (decode): one program a row and BLOCK_N outputs, walking the input CHUNK blocks at a
  time with products and sums in float32 registers (a [16, 64] tile's dot at one row would spend
  sixteen times the multiplies, and the GPU's float32 dot is multiply-adds), over all the blocks
  or over one of SPLIT ranges whose sums a second kernel adds in order
  (workers.engine.cuda.triton_splits); or, two-dimensional, over [BLOCK_N, 32 x CHUNK] tiles of the
  weights widened with their blocks' scales, the products summed per lane and across the lanes
  once at the end. The shape (`Gemv`) is the weight's, measured at load
  (workers.engine.cuda.tile_choice), never the step's: a row's sums take one order whatever the
  number of rows, so `deterministic` takes this kernel for every row count.
- many rows: one program a [BLOCK_M, BLOCK_N] tile of y. It walks the input in blocks of 32:
  each block's scale (and offset, int4) per output row, its values widened to float32 as
  `QuantizedWeight.dequantize` gives them (the GGUF file's own values), and two dots of 16 inputs.
  float32 activations: the dots run in float32 at IEEE precision (not TF32), the float32 product
  of the activations and the file's values, as on the CPU. bfloat16 activations: on the tensor
  cores, each float32 weight split into three bfloat16 whose sum is exactly it, so the products
  are the same (two bfloat16, the leading 16 bits, part a sum of many terms by up to 2^-17 of each
  weight: past the output's rounding where the terms cancel).
An int4 block holds value j in the low nibble of byte j and value j + 16 in its high nibble, so
the low nibbles meet the block's first 16 inputs and the high nibbles its last 16, without
interleaving.

Set TRITON_INTERPRET before this module is imported: Triton reads it when the kernels are defined
(the tests run it on the CPU in Triton's interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from workers.engine.cuda import triton_splits
from workers.engine.cuda.triton_common import INTERPRETED
from workers.quant.formats import BLOCK
from workers.quant.weight import INT4, QuantizedWeight

HALF = BLOCK // 2


@triton.jit
def _split_dot(acc, x, w, EMULATE: tl.constexpr):
    """acc + x @ w.T for bfloat16 x [M, k] and float32 w [N, k] on the tensor cores: w as the sum of
    three bfloat16 (its leading 8 bits, the next 8, the rest), which is w exactly, so the products
    are x times w's own values, exact in the float32 sums. EMULATE: the same parts multiplied in
    float32 (Triton's interpreter multiplies 16-bit dots as raw bits)."""
    a = w.to(tl.bfloat16)
    rest = w - a.to(tl.float32)
    b = rest.to(tl.bfloat16)
    c = (rest - b.to(tl.float32)).to(tl.bfloat16)
    if EMULATE:
        xf = x.to(tl.float32)
        acc += tl.dot(xf, tl.trans(a.to(tl.float32)), input_precision="ieee")
        acc += tl.dot(xf, tl.trans(b.to(tl.float32)), input_precision="ieee")
        acc += tl.dot(xf, tl.trans(c.to(tl.float32)), input_precision="ieee")
    else:
        x16 = x.to(tl.bfloat16)
        acc += tl.dot(x16, tl.trans(a))
        acc += tl.dot(x16, tl.trans(b))
        acc += tl.dot(x16, tl.trans(c))
    return acc


@triton.jit
def _qlinear_kernel(x_ptr, qs_ptr, scales_ptr, offsets_ptr, bias_ptr, out_ptr, M, N, K,
                    stride_xm, stride_qn, stride_sn, stride_om,
                    INT4_BLOCKS: tl.constexpr, HAS_BIAS: tl.constexpr, HALF_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT16: tl.constexpr,
                    EMULATE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in range(0, K // (2 * HALF_K)):
        k0 = b * 2 * HALF_K
        x_rows = x_ptr + offs_m[:, None] * stride_xm + k0 + offs_h[None, :]
        x_lo = tl.load(x_rows, mask=mask_m[:, None], other=0.0)
        x_hi = tl.load(x_rows + HALF_K, mask=mask_m[:, None], other=0.0)
        scale = tl.load(scales_ptr + offs_n * stride_sn + b, mask=mask_n, other=0.0).to(tl.float32)
        if INT4_BLOCKS:
            offset = tl.load(offsets_ptr + offs_n * stride_sn + b, mask=mask_n, other=0.0).to(tl.float32)
            q = tl.load(qs_ptr + offs_n[:, None] * stride_qn + b * HALF_K + offs_h[None, :], mask=mask_n[:, None],
                        other=0)
            w_lo = (q & 15).to(tl.float32) * scale[:, None] + offset[:, None]
            w_hi = (q >> 4).to(tl.float32) * scale[:, None] + offset[:, None]
        else:
            w_rows = qs_ptr + offs_n[:, None] * stride_qn + k0 + offs_h[None, :]
            w_lo = tl.load(w_rows, mask=mask_n[:, None], other=0).to(tl.float32) * scale[:, None]
            w_hi = tl.load(w_rows + HALF_K, mask=mask_n[:, None], other=0).to(tl.float32) * scale[:, None]
        if SPLIT16:
            acc = _split_dot(acc, x_lo, w_lo, EMULATE)
            acc = _split_dot(acc, x_hi, w_hi, EMULATE)
        else:
            acc += tl.dot(x_lo.to(tl.float32), tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(x_hi.to(tl.float32), tl.trans(w_hi), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _qgemv_kernel(x_ptr, qs_ptr, scales_ptr, offsets_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, B_RANGE,
                  stride_xm, stride_qn, stride_sn, stride_om,
                  INT4_BLOCKS: tl.constexpr, HAS_BIAS: tl.constexpr, HALF_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, SPLIT: tl.constexpr):
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.arange(0, CHUNK)
    offs_h = tl.arange(0, HALF_K)
    mask_n = offs_n < N
    blocks = K // (2 * HALF_K)
    b_lo = tl.program_id(2) * B_RANGE
    b_hi = tl.minimum(b_lo + B_RANGE, blocks)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in range(b_lo, b_hi, CHUNK):
        b = c + offs_b
        mask_b = b < blocks
        x_at = x_ptr + m * stride_xm + b[:, None] * (2 * HALF_K) + offs_h[None, :]
        x_lo = tl.load(x_at, mask=mask_b[:, None], other=0.0).to(tl.float32)  # [CHUNK, HALF_K]
        x_hi = tl.load(x_at + HALF_K, mask=mask_b[:, None], other=0.0).to(tl.float32)
        nb = mask_n[:, None] & mask_b[None, :]
        scale = tl.load(scales_ptr + offs_n[:, None] * stride_sn + b[None, :], mask=nb,
                        other=0.0).to(tl.float32)[:, :, None]  # [BLOCK_N, CHUNK, 1]
        if INT4_BLOCKS:
            offset = tl.load(offsets_ptr + offs_n[:, None] * stride_sn + b[None, :], mask=nb,
                             other=0.0).to(tl.float32)[:, :, None]
            q = tl.load(qs_ptr + offs_n[:, None, None] * stride_qn + b[None, :, None] * HALF_K + offs_h[None, None, :],
                        mask=nb[:, :, None], other=0)
            w_lo = (q & 15).to(tl.float32) * scale + offset
            w_hi = (q >> 4).to(tl.float32) * scale + offset
        else:
            w_at = qs_ptr + offs_n[:, None, None] * stride_qn + b[None, :, None] * (2 * HALF_K) + offs_h[None, None, :]
            w_lo = tl.load(w_at, mask=nb[:, :, None], other=0).to(tl.float32) * scale
            w_hi = tl.load(w_at + HALF_K, mask=nb[:, :, None], other=0).to(tl.float32) * scale
        acc += tl.sum(tl.sum(w_lo * x_lo[None, :, :] + w_hi * x_hi[None, :, :], axis=2), axis=1)
    triton_splits.store_row(acc, bias_ptr, out_ptr, part_ptr, m, M, N, offs_n, mask_n, stride_om, HAS_BIAS, SPLIT)


@triton.jit
def _qgemv_flat_kernel(x_ptr, qs_ptr, scales_ptr, offsets_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, B_RANGE,
                       stride_xm, stride_qn, stride_sn, stride_om,
                       INT4_BLOCKS: tl.constexpr, HAS_BIAS: tl.constexpr, HALF_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    """The row kernel over [BLOCK_N, BLOCK_K] tiles of the inputs in order, each weight widened with
    its own block's scale (and offset), products summed per lane and across the lanes once at the
    end: two-dimensional, where the kernel above reduces [outputs, blocks, 16] tiles every step."""
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    k_lo = tl.program_id(2) * B_RANGE * (2 * HALF_K)
    k_hi = tl.minimum(k_lo + B_RANGE * (2 * HALF_K), K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        nk = mask_n[:, None] & mask_k[None, :]
        x = tl.load(x_ptr + m * stride_xm + k, mask=mask_k, other=0.0).to(tl.float32)
        b = k // (2 * HALF_K)
        scale = tl.load(scales_ptr + offs_n[:, None] * stride_sn + b[None, :], mask=nk, other=0.0).to(tl.float32)
        if INT4_BLOCKS:  # value j of a block in byte j's low nibble, value j + 16 in its high one
            byte = tl.load(qs_ptr + offs_n[:, None] * stride_qn + (b * HALF_K + k % HALF_K)[None, :], mask=nk, other=0)
            q = (byte >> ((k % (2 * HALF_K)) // HALF_K * 4)[None, :]) & 15
            offset = tl.load(offsets_ptr + offs_n[:, None] * stride_sn + b[None, :], mask=nk, other=0.0).to(tl.float32)
            w = q.to(tl.float32) * scale + offset
        else:
            w = tl.load(qs_ptr + offs_n[:, None] * stride_qn + k[None, :], mask=nk, other=0).to(tl.float32) * scale
        acc += w * x[None, :]
    triton_splits.store_row(tl.sum(acc, axis=1), bias_ptr, out_ptr, part_ptr, m, M, N, offs_n, mask_n, stride_om,
                            HAS_BIAS, SPLIT)


GEMV_ROWS = 16  # up to this many rows, qlinear takes the kernel of one program a row


@dataclass(frozen=True, slots=True)
class Gemv:
    """The row kernel's shape for a weight: `n` outputs a program, `chunk` blocks of 32 inputs an
    iteration, the blocks in `split` ranges (1: one program walks them all)."""

    n: int = 32
    chunk: int = 8
    split: int = 1
    flat: bool = False  # the two-dimensional kernel (_qgemv_flat_kernel)

    def __post_init__(self):
        if self.n < 1 or self.chunk < 1 or self.split < 1 or (self.n & (self.n - 1)) or (self.chunk & (self.chunk - 1)):
            raise ValueError(f"the row kernel needs n and chunk powers of two and split >= 1, got {self}")

    @property
    def name(self) -> str:
        return (f"{'flat ' if self.flat else ''}rows of {self.n} outputs, {self.chunk} blocks a step"
                + (f", {self.split} ranges" if self.split > 1 else ""))


DEFAULT_GEMV = Gemv()
# what tile_choice times against DEFAULT_GEMV (each a compile a row-count class on a GPU's first load,
# so few): fewer outputs a program (twice the programs, half the values in a program's registers),
# fewer blocks a step, the blocks in four ranges; the two-dimensional kernel, alone and in ranges
GEMV_CANDIDATES = (Gemv(16, 8), Gemv(32, 4), Gemv(32, 8, 4), Gemv(16, 4, flat=True), Gemv(8, 4, 4, flat=True))


def _qgemv(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, out: torch.Tensor,
           gemv: Gemv = DEFAULT_GEMV) -> torch.Tensor:
    m, k = x.shape
    n = weight.out_features
    int4 = weight.kind == INT4
    blocks = k // BLOCK
    split, b_range = triton_splits.ranges(blocks, gemv.chunk, gemv.split)
    part = triton_splits.partials(split, m, n, x.device) if split > 1 else out
    args = (x, weight.qs, weight.scales, weight.offsets if int4 else weight.scales, bias if bias is not None else x,
            out, part, m, n, k, b_range, x.stride(0), weight.qs.stride(0), weight.scales.stride(0), out.stride(0))
    grid = (m, triton.cdiv(n, gemv.n), split)
    if gemv.flat:
        _qgemv_flat_kernel[grid](*args, INT4_BLOCKS=int4, HAS_BIAS=bias is not None, HALF_K=HALF, BLOCK_N=gemv.n,
                                 BLOCK_K=gemv.chunk * BLOCK, SPLIT=split)
    else:
        _qgemv_kernel[grid](*args, INT4_BLOCKS=int4, HAS_BIAS=bias is not None, HALF_K=HALF, BLOCK_N=gemv.n,
                            CHUNK=gemv.chunk, SPLIT=split)
    return triton_splits.sum_splits(part, bias, out) if split > 1 else out


def qlinear_invariant(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                      gemv: Gemv = DEFAULT_GEMV) -> torch.Tensor:
    """qlinear with the kernel of one program a row for every number of rows (`deterministic`): a
    row's sums do not depend on the rows beside it (`gemv` is the weight's, never the step's)."""
    return qlinear(x, weight, bias, block_m=1, gemv=gemv)


def qlinear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
            block_m: int | None = None, gemv: Gemv = DEFAULT_GEMV) -> torch.Tensor:
    """ops.reference_qlinear's contract: x [M, K] -> [M, N] in x's dtype. `block_m`: the
    rows a tile, 1 for the kernel of one program a row (None: by the number of rows); `gemv`: that
    kernel's shape for this weight (workers.engine.cuda.tile_choice measures it)."""
    m, k = x.shape
    n = weight.out_features
    if k != weight.in_features:
        raise ValueError(f"qlinear: x has {k} inputs, the weight {weight.in_features}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x = x.contiguous()
    if block_m == 1 or (block_m is None and m <= GEMV_ROWS):
        return _qgemv(x, weight, bias, out, gemv)
    int4 = weight.kind == INT4
    block_m = block_m or (32 if m <= 32 else 64)
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _qlinear_kernel[grid](
        x, weight.qs, weight.scales, weight.offsets if int4 else weight.scales, bias if bias is not None else x, out,
        m, n, k, x.stride(0), weight.qs.stride(0), weight.scales.stride(0), out.stride(0),
        INT4_BLOCKS=int4, HAS_BIAS=bias is not None, HALF_K=HALF, BLOCK_M=block_m, BLOCK_N=block_n,
        SPLIT16=x.dtype == torch.bfloat16, EMULATE=INTERPRETED)
    return out
