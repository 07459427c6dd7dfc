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

The same object carries the rest of a decode layer, so that a layer is about ten kernels on a GPU:
- `decode_attention`: attention of one row a sequence, split over the context in fixed segments
  (workers.engine.cuda.triton_decode); `attention` keeps prefill and extend;
- `rms_norm` and `add_rms_norm` (the residual add fused in), `rope_kv_write` (the rotary
  embedding and the KV write in one), `silu_mul` (workers.engine.cuda.triton_fused);
- Gemma 3's: `gemma_rms_norm`, `sandwich_norm` (a sublayer's output normed, added to the residual
  stream, and the next norm, in one), `qk_norm` and `gelu_mul` (workers.engine.cuda.triton_gemma);
- the weight-only quantized linear (`qlinear`): the Triton kernel of
  workers.engine.cuda.triton_qlinear, or `reference_qlinear` (the blocks' values widened to
  float32, then one matmul).
The Triton set's functions but the weight-only linear are registered as torch custom ops
(`mmfusion::triton_*`): one op a kernel to torch's dispatcher, so a count of dispatched ops counts
kernels (tests/test_census.py).
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


def reference_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream's add, then the next norm."""
    summed = x + residual
    return reference_rms_norm(summed, weight, eps), summed


def reference_rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                            key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor, heads: int,
                            kv_heads: int) -> torch.Tensor:
    """qkv [N, (heads + 2 kv_heads) x d], the fused q/k/v output; cos/sin: the rotary tables of every
    position [P, d] (sin with its first half's sign folded in: workers.engine.lean_parts.rotation).
    Rotates the q and k heads of each row at its position, writes k and v to the pool through
    `slots` (reference_kv_write) and returns the rotated q [N, heads, d]."""
    n, d = qkv.shape[0], key_cache.shape[-1]
    qk = qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d)
    cos, sin = cos[positions][:, None, :], sin[positions][:, None, :]
    qk = qk * cos + qk.roll(d // 2, -1) * sin
    v = qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d)
    reference_kv_write(qk[:, heads:], v, key_cache, value_cache, slots)
    return qk[:, :heads]


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2 x inter] -> silu(gate) x up [N, inter]."""
    inter = gate_up.shape[1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def reference_gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Gemma3RMSNorm, `weight` its (1 + w) in float32: the norm and its scale in float32, rounded
    once to the input's dtype."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def reference_sandwich_norm(x: torch.Tensor, residual: torch.Tensor, out_weight: torch.Tensor,
                            next_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's norms around a residual add: (norm_next(h), h) for h = residual + norm_out(x), the
    sublayer's output `x` normed before it joins the residual stream (gemma_rms_norm's weights)."""
    summed = residual + reference_gemma_rms_norm(x, out_weight, eps)
    return reference_gemma_rms_norm(summed, next_weight, eps), summed


def reference_qk_norm(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int, kv_heads: int,
                      eps: float) -> torch.Tensor:
    """The fused q/k/v output with each q and k head normed (gemma_rms_norm over the head), v as it is."""
    n, d = qkv.shape[0], q_weight.shape[0]
    q = reference_gemma_rms_norm(qkv[:, : heads * d].reshape(n, heads, d), q_weight, eps)
    k = reference_gemma_rms_norm(qkv[:, heads * d: (heads + kv_heads) * d].reshape(n, kv_heads, d), k_weight, eps)
    return torch.cat((q.reshape(n, -1), k.reshape(n, -1), qkv[:, (heads + kv_heads) * d:]), dim=1)


def reference_gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2 x inter] -> gelu_tanh(gate) x up [N, inter] (Gemma's gelu_pytorch_tanh)."""
    inter = gate_up.shape[1] // 2
    return F.gelu(gate_up[:, :inter], approximate="tanh") * gate_up[:, inter:]


@dataclass(frozen=True, slots=True)
class PagedOps:
    """The paged ops a runner calls, chosen once at load, and its weight-only quantized linear."""

    name: str
    kv_write: Callable[..., None]
    attention: Callable[..., torch.Tensor]  # prefill and extend: one row a token
    qlinear: Callable[..., torch.Tensor]  # reference_qlinear's contract
    decode_attention: Callable[..., torch.Tensor] = reference_attention  # one row a sequence
    # a dense linear (F.linear's contract): under `deterministic` (batch_invariant), one that
    # computes each row in one order
    linear: Callable[..., torch.Tensor] = F.linear
    rms_norm: Callable[..., torch.Tensor] = reference_rms_norm
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = reference_add_rms_norm
    rope_kv_write: Callable[..., torch.Tensor] = reference_rope_kv_write
    silu_mul: Callable[..., torch.Tensor] = reference_silu_mul
    # Gemma 3's: its norms (in float32, scaled by 1 + w), the q/k norms, GELU x up
    gemma_rms_norm: Callable[..., torch.Tensor] = reference_gemma_rms_norm
    sandwich_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = reference_sandwich_norm
    qk_norm: Callable[..., torch.Tensor] = reference_qk_norm
    gelu_mul: Callable[..., torch.Tensor] = reference_gelu_mul
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


def _add_rms_norm_each_row(x, residual, weight, eps):
    summed = x + residual  # elementwise: each element alone already
    return _each_row(reference_rms_norm, (summed,), weight, eps), summed


def _sandwich_norm_each_row(x, residual, out_weight, next_weight, eps):
    summed = residual + _each_row(reference_gemma_rms_norm, (x,), out_weight, eps)
    return _each_row(reference_gemma_rms_norm, (summed,), next_weight, eps), summed


def batch_invariant(ops: PagedOps) -> PagedOps:
    """`deterministic`: the same ops, every row computed in an order that does not depend on the
    other rows of the call. The Triton kernels: fixed tiles for the linears (weight-only and dense);
    the norms (one program a row) and both attention kernels (a row's own positions, in segments
    fixed by position) are so already. The reference: each row in a call of its own (slow; it is
    the CPU's stand-in)."""
    if ops.invariant:
        return ops
    if ops.name == "triton":
        from workers.engine.cuda import triton_invariant, triton_qlinear

        return replace(ops, name="triton-invariant", qlinear=triton_qlinear.qlinear_invariant,
                       linear=triton_invariant.linear, invariant=True)
    return replace(ops, name=f"{ops.name}-invariant", attention=_attention_each_row,
                   decode_attention=_attention_each_row,
                   qlinear=lambda x, w, b=None: _each_row(ops.qlinear, (x,), w, b),
                   linear=lambda x, w, b=None: _each_row(ops.linear, (x,), w, b),
                   rms_norm=lambda x, w, eps: _each_row(reference_rms_norm, (x,), w, eps),
                   add_rms_norm=_add_rms_norm_each_row,
                   gemma_rms_norm=lambda x, w, eps: _each_row(reference_gemma_rms_norm, (x,), w, eps),
                   sandwich_norm=_sandwich_norm_each_row,
                   qk_norm=lambda qkv, qw, kw, h, kvh, eps: _each_row(reference_qk_norm, (qkv,), qw, kw, h, kvh, eps),
                   invariant=True)


def have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


# the Triton set's functions: (module, function, the arguments it writes)
_TRITON = {"kv_write": ("triton_attention", "kv_write", ("key_cache", "value_cache")),
           "attention": ("triton_attention", "paged_attention", ()),
           "decode_attention": ("triton_decode", "decode_attention", ()),
           "rms_norm": ("triton_fused", "rms_norm", ()),
           "add_rms_norm": ("triton_fused", "add_rms_norm", ()),
           "rope_kv_write": ("triton_fused", "rope_kv_write", ("key_cache", "value_cache")),
           "silu_mul": ("triton_fused", "silu_mul", ()),
           "gemma_rms_norm": ("triton_gemma", "gemma_rms_norm", ()),
           "sandwich_norm": ("triton_gemma", "sandwich_norm", ()),
           "qk_norm": ("triton_gemma", "qk_norm", ()),
           "gelu_mul": ("triton_gemma", "gelu_mul", ())}


@functools.cache
def _triton_op(name: str) -> Callable:
    """A Triton function as the custom op `mmfusion::triton_<name>` (registered once a process; its
    module imported then: TRITON_INTERPRET is read when the kernels are defined)."""
    module, fn, mutates = _TRITON[name]
    impl = getattr(importlib.import_module(f"workers.engine.cuda.{module}"), fn)
    return torch.library.custom_op(f"mmfusion::triton_{name}", impl, mutates_args=mutates)


@functools.cache
def triton_ops() -> PagedOps:
    """The Triton kernels, each one custom op; the weight-only linear, whose weight is no tensor,
    a function."""
    from workers.engine.cuda import triton_qlinear

    return PagedOps("triton", qlinear=triton_qlinear.qlinear, **{name: _triton_op(name) for name in _TRITON})


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
