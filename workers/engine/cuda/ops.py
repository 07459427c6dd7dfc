"""Paged attention and the KV write as tensor ops whose shapes never depend on the step's layout,
for the CUDA runner's captured decode graph (workers.engine.cuda.runner) and its eager steps.

Every argument is a tensor of a fixed shape: the step's layout is data (block tables, lengths,
slots), never Python lists or branches, so one graph serves every step of a bucket.
- `kv_write`: this step's keys and values into the pool through a slot mapping (block x
  block_size + offset); a slot < 0 is skipped.
- `paged_attention`: each query row attends over the cache positions [max(0, len - window), len)
  of the sequence its block-table row names (`len` counts the row's own position, whose key is
  already written). Decode is one row a sequence; prefill and extend are one row a token (its
  position + 1 as `len`). A row of length 0 (a padded row) gives zeros.

Two implementations, chosen once into a PagedOps object: the Triton kernels
(workers.engine.cuda.triton_attention: the query heads of a KV head packed together, float32
accumulation, an online softmax over the row's blocks), and the PyTorch reference below, which
the kernels are tested against (on the CPU under TRITON_INTERPRET=1) and which serves where Triton
is not installed. Both are registered as torch custom ops (`mmfusion::paged_attention`,
`mmfusion::kv_write`) that run the kernels on CUDA tensors and the reference elsewhere.

The same object carries the device lean forward's weight-only quantized linear (`qlinear`): the
Triton kernel of workers.engine.cuda.triton_qlinear, or `reference_qlinear` (the blocks' values
widened to float32, then one matmul).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from workers.quant.weight import QuantizedWeight


def reference_kv_write(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slots: torch.Tensor) -> None:
    """key/value: [N, kvh, d]; key_cache/value_cache: one layer's pool [blocks, kvh, block_size, d];
    slots: [N] (block x block_size + offset; < 0: skipped)."""
    bs = key_cache.shape[2]
    valid = slots >= 0
    slots = slots[valid].long()
    key_cache[slots // bs, :, slots % bs] = key[valid].to(key_cache.dtype)
    value_cache[slots // bs, :, slots % bs] = value[valid].to(value_cache.dtype)


def reference_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, scale: float,
                        window: int) -> torch.Tensor:
    """query: [T, H, d]; block_tables: [S, M]; rows: [T] (each query row's block-table row);
    lengths: [T]; window: 0 for none. Returns [T, H, dv] in the query's dtype, float32 inside."""
    t, heads, _ = query.shape
    bs, kvh = key_cache.shape[2], key_cache.shape[1]
    span = block_tables.shape[1] * bs  # every position a table can name: a static shape
    pos = torch.arange(span, device=query.device)
    blocks = block_tables.long()[rows.long()][:, pos // bs]  # [T, span]
    k = key_cache[blocks, :, pos % bs].float()  # [T, span, kvh, d]
    v = value_cache[blocks, :, pos % bs].float()
    lengths = lengths.long()[:, None]
    visible = pos[None, :] < lengths
    if window > 0:
        visible = visible & (pos[None, :] >= lengths - window)
    # positions a row does not see may hold anything (a block's stale memory, NaN among it): never read
    k = torch.where(visible[:, :, None, None], k, 0.0)
    v = torch.where(visible[:, :, None, None], v, 0.0)
    q = query.float().view(t, kvh, heads // kvh, -1)
    scores = torch.einsum("tkgd,tskd->tkgs", q, k) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row of length 0: every score -inf
    out = torch.einsum("tkgs,tskd->tkgd", probs, v)
    return out.reshape(t, heads, v.shape[-1]).to(query.dtype)


def reference_qlinear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ the blocks' float32 values [N, K].T (+ bias), in float32, returned in x's dtype."""
    y = F.linear(x.float(), weight.dequantize(), None if bias is None else bias.float())
    return y.to(x.dtype)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As LlamaRMSNorm: in float32, rounded to the input's dtype before the weight's scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@dataclass(frozen=True, slots=True)
class PagedOps:
    """The paged ops a runner calls, chosen once at load, and its weight-only quantized linear."""

    name: str
    kv_write: Callable[..., None]
    attention: Callable[..., torch.Tensor]
    qlinear: Callable[..., torch.Tensor]  # reference_qlinear's contract
    # a dense linear (F.linear's contract) and an RMS norm (rows, weight, eps): under
    # `deterministic` (batch_invariant), ones that compute each row in one order
    linear: Callable[..., torch.Tensor] = F.linear
    rms_norm: Callable[..., torch.Tensor] = reference_rms_norm
    invariant: bool = False


REFERENCE = PagedOps("reference", reference_kv_write, reference_attention, reference_qlinear)


def _each_row(fn: Callable[..., torch.Tensor], rows: tuple[torch.Tensor, ...], *args) -> torch.Tensor:
    """fn(row i of each of `rows`, *args) for each i alone, stacked: a row's result cannot depend on
    the others."""
    n = rows[0].shape[0]
    if n == 0:
        return fn(*rows, *args)
    return torch.cat([fn(*(t[i:i + 1] for t in rows), *args) for i in range(n)])


def _attention_each_row(query, key_cache, value_cache, block_tables, rows, lengths, scale, window):
    return _each_row(lambda q, r, length: reference_attention(q, key_cache, value_cache, block_tables, r, length,
                                                              scale, window), (query, rows, lengths))


def batch_invariant(ops: PagedOps) -> PagedOps:
    """`deterministic`: the same ops, every row computed in an order that does not depend on the
    other rows of the call. The Triton kernels: fixed tiles for the linears (weight-only and dense)
    and one program a row for the norm; the paged attention kernel walks each row's own positions
    already. The reference: each row in a call of its own (slow; it is the CPU's stand-in)."""
    if ops.invariant:
        return ops
    if ops.name == "triton":
        from workers.engine.cuda import triton_invariant, triton_qlinear

        return replace(ops, name="triton-invariant", qlinear=triton_qlinear.qlinear_invariant,
                       linear=triton_invariant.linear, rms_norm=triton_invariant.rms_norm, invariant=True)
    return replace(ops, name=f"{ops.name}-invariant", attention=_attention_each_row,
                   qlinear=lambda x, w, b=None: _each_row(ops.qlinear, (x,), w, b),
                   linear=lambda x, w, b=None: _each_row(ops.linear, (x,), w, b),
                   rms_norm=lambda x, w, eps: _each_row(ops.rms_norm, (x,), w, eps), invariant=True)


def have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def triton_ops() -> PagedOps:
    """The Triton kernels (imported here, once: TRITON_INTERPRET is read when they are defined)."""
    from workers.engine.cuda import triton_attention, triton_qlinear

    return PagedOps("triton", triton_attention.kv_write, triton_attention.paged_attention, triton_qlinear.qlinear)


def select_ops(device: torch.device, invariant: bool = False) -> PagedOps:
    """The CUDA room's kernel chooser: the Triton kernels on a CUDA device where Triton is installed,
    the reference elsewhere; `invariant` (`deterministic`): their batch-invariant set."""
    ops = triton_ops() if device.type == "cuda" and have_triton() else REFERENCE
    return batch_invariant(ops) if invariant else ops


@torch.library.custom_op("mmfusion::kv_write", mutates_args=("key_cache", "value_cache"))
def kv_write_op(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                slots: torch.Tensor) -> None:
    select_ops(key.device).kv_write(key, value, key_cache, value_cache, slots)


@kv_write_op.register_fake
def _(key, value, key_cache, value_cache, slots):
    return None


@torch.library.custom_op("mmfusion::paged_attention", mutates_args=())
def paged_attention_op(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, scale: float,
                       window: int) -> torch.Tensor:
    return select_ops(query.device).attention(query, key_cache, value_cache, block_tables, rows, lengths, scale,
                                              window)


@paged_attention_op.register_fake
def _(query, key_cache, value_cache, block_tables, rows, lengths, scale, window):
    return query.new_empty(query.shape[0], query.shape[1], value_cache.shape[-1])
