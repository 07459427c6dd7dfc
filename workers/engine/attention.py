"""Attention over the slot KV cache for one packed step (decode tokens first, then prefill chunks).

Registered with transformers' AttentionInterface as "mmfusion", so every model whose attention
goes through that interface (Llama, Mistral, Gemma3, GPT-2, OPT, Qwen2, ...) runs on it unchanged.
Registering a name the mask factory does not know also makes the model skip building its own
masks: this module builds them once per step from the sequences' lengths.

The whole step (K/V writes into the slot cache, decode and prefill attention) is one opaque
custom op, `mmfusion::attend`, as vLLM's unified attention is: a compiled forward (workers.engine.compiled)
calls it as an extern kernel, so the graph holds only tensor math and its shapes depend only on the
padded token count, never on how the step's tokens split into sequences. Eager runs call the same
function directly. The op finds the step's context and cache through the holder named by its id.

Decode rows are one batched GQA matmul over contiguous cache rows (no repeat_kv copy): on CPU
that is ~10x faster than SDPA's flash kernel at q_len=1. Prefill chunks use SDPA with a causal
mask offset by the chunk's start.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_NAME = "mmfusion"
KV_KWARG = "mmfusion_kv"  # the model call's keyword argument that carries (keys, values) of the slot cache


@dataclass(slots=True)
class Segment:
    """A prefill chunk: packed tokens [tok_start, tok_start+length) of `slot`, at positions start_pos..."""

    tok_start: int
    length: int
    slot: int
    start_pos: int


@dataclass(slots=True)
class StepContext:
    """What attention needs to know about the packed batch of one forward pass."""

    num_decode: int
    num_tokens: int  # real packed tokens; a compiled forward pads past them, and their rows stay zero
    decode_slots: torch.Tensor | None  # [D] cache rows of the decode tokens
    decode_lengths: torch.Tensor | None  # [D] keys visible to each decode token (position + 1)
    dense: bool  # decode rows are exactly slots 0..D-1 in order: no scatter/gather needed
    rows: int  # cache rows the decode matmul spans
    span: int  # key positions the decode matmul spans (max length)
    segments: list[Segment]
    masks: dict = field(default_factory=dict)  # built lazily, shared by all layers
    groups: dict = field(default_factory=dict)  # whole-prompt groupings by window, likewise

    def decode_mask(self, window: int | None, dtype: torch.dtype, device) -> torch.Tensor:
        key = ("d", window, dtype)
        m = self.masks.get(key)
        if m is None:
            pos = torch.arange(self.span, device=device)
            lengths = torch.full((self.rows,), self.span, dtype=torch.long, device=device)
            lengths[self.decode_slots if not self.dense else slice(0, self.num_decode)] = self.decode_lengths
            allowed = pos[None, :] < lengths[:, None]
            if window is not None:
                allowed &= pos[None, :] > (lengths[:, None] - 1 - window)
            m = torch.zeros(self.rows, 1, 1, self.span, dtype=dtype, device=device)
            m.masked_fill_(~allowed[:, None, None, :], torch.finfo(dtype).min)
            self.masks[key] = m
        return m

    def whole_prompt_groups(self, window: int | None, device) -> tuple[list, list[int]]:
        """Segments that are whole prompts (from position 0, inside the window), grouped by length
        when two or more share one: [(packed token rows, cache slots, length)], and the segments
        left to attend one by one. Built once per step, shared by all layers."""
        got = self.groups.get(window)
        if got is None:
            by_len: dict[int, list[int]] = {}
            for i, seg in enumerate(self.segments):
                if seg.start_pos == 0 and (window is None or window >= seg.length):
                    by_len.setdefault(seg.length, []).append(i)
            groups, grouped = [], set()
            for length, members in by_len.items():
                if len(members) < 2:
                    continue
                segs = [self.segments[i] for i in members]
                tokens = torch.tensor([s.tok_start + j for s in segs for j in range(length)], device=device)
                groups.append((tokens, torch.tensor([s.slot for s in segs], device=device), length))
                grouped.update(members)
            got = self.groups[window] = (groups, [i for i in range(len(self.segments)) if i not in grouped])
        return got

    def segment_mask(self, i: int, window: int | None, device) -> torch.Tensor:
        key = ("s", i, window)
        m = self.masks.get(key)
        if m is None:
            seg = self.segments[i]
            q_pos = torch.arange(seg.start_pos, seg.start_pos + seg.length, device=device)[:, None]
            k_pos = torch.arange(seg.start_pos + seg.length, device=device)[None, :]
            m = k_pos <= q_pos
            if window is not None:
                m &= k_pos > q_pos - window
            self.masks[key] = m
        return m


def _decode_attention(ctx: StepContext, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scaling: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """q: [D, H, d]; key/value: full buffers [S, kvh, cap, d]. Returns [D, H, dv]."""
    d_rows, heads, dim = q.shape
    kvh = key.shape[1]
    qg = q.to(key.dtype).reshape(d_rows, kvh, heads // kvh, dim)
    if not ctx.dense:
        full = qg.new_zeros(ctx.rows, kvh, heads // kvh, dim)
        full[ctx.decode_slots] = qg
        qg = full
    rows, g = ctx.rows, heads // kvh
    # (rows, kvh) merge into one batch dim without a copy: bmm reads the strided cache in place.
    k = key[:rows, :, : ctx.span].reshape(rows * kvh, ctx.span, dim)
    v = value[:rows, :, : ctx.span].reshape(rows * kvh, ctx.span, value.shape[-1])
    scores = torch.bmm(qg.reshape(rows * kvh, g, dim), k.transpose(1, 2)).view(rows, kvh, g, ctx.span)
    scores = scores * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + ctx.decode_mask(window, scores.dtype, scores.device)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    out = torch.bmm(probs.view(rows * kvh, g, ctx.span), v).view(rows, kvh, g, v.shape[-1])
    if not ctx.dense:
        out = out[ctx.decode_slots]
    return out.reshape(d_rows, heads, v.shape[-1]).to(q.dtype)


def _segment_attention(ctx: StepContext, i: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       scaling: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """q: [1, H, c, d] for segment i. Returns [c, H, dv]."""
    seg = ctx.segments[i]
    end = seg.start_pos + seg.length
    k = key[seg.slot: seg.slot + 1, :, :end]
    v = value[seg.slot: seg.slot + 1, :, :end]
    heads, kvh = q.shape[1], k.shape[1]
    q = q.to(k.dtype)
    if softcap is None and seg.start_pos == 0 and (window is None or window >= end):
        # a whole prompt from its start: plain causal attention, no mask to build or read
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=heads != kvh)
        return out[0].transpose(0, 1)
    mask = ctx.segment_mask(i, window, q.device)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=heads != kvh)
    else:
        k = k.repeat_interleave(heads // kvh, dim=1)
        v = v.repeat_interleave(heads // kvh, dim=1)
        s = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scaling / softcap) * softcap
        s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
        out = torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype), v)
    return out[0].transpose(0, 1)


def _attend(holder: ContextHolder, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            key_cache: torch.Tensor, value_cache: torch.Tensor, layer: int, scaling: float, window: int | None,
            softcap: float | None) -> torch.Tensor:
    """Write this step's K/V into layer `layer` of the caches, attend. query: [1, H, N, d];
    key/value: [1, kvh, N, d] (N may include padding past ctx.num_tokens); key_cache/value_cache:
    every layer's buffers (SlotKVCache.keys/values). Returns [1, N, H, dv]."""
    ctx = holder.current
    n = ctx.num_tokens
    key_buf, value_buf = key_cache[layer], value_cache[layer]
    holder.cache.write(key_buf, value_buf, key[:, :, :n], value[:, :, :n])
    heads, n_all = query.shape[1], query.shape[2]
    out = (query.new_zeros if n_all > n else query.new_empty)(n_all, heads, value_buf.shape[-1])
    d = ctx.num_decode
    if d:
        out[:d] = _decode_attention(ctx, query[0, :, :d].transpose(0, 1), key_buf, value_buf, scaling,
                                    window, softcap)
    alone = range(len(ctx.segments))
    if softcap is None and len(ctx.segments) > 1:
        groups, alone = ctx.whole_prompt_groups(window, query.device)
        for tokens, slots, length in groups:
            out.index_copy_(0, tokens, _whole_prompts_attention(query, tokens, slots, length, key_buf, value_buf,
                                                                scaling))
    for i in alone:
        seg = ctx.segments[i]
        q = query[:, :, seg.tok_start: seg.tok_start + seg.length]
        out[seg.tok_start: seg.tok_start + seg.length] = _segment_attention(
            ctx, i, q, key_buf, value_buf, scaling, window, softcap)
    return out.unsqueeze(0)


def _whole_prompts_attention(query: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, length: int,
                             key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of G whole prompts of one length as one batched SDPA (a short-request step
    holds dozens of them: one call per prompt per layer was most of its attention time).
    tokens: [G*length] packed rows; slots: [G]. Returns [G*length, H, dv]."""
    heads, dim = query.shape[1], query.shape[-1]
    g = slots.shape[0]
    k, v = key[slots, :, :length], value[slots, :, :length]
    q = query[0].index_select(1, tokens).view(heads, g, length, dim).transpose(0, 1).to(k.dtype)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=heads != k.shape[1])
    return o.transpose(1, 2).reshape(g * length, heads, v.shape[-1]).to(query.dtype)


@torch.library.custom_op("mmfusion::attend", mutates_args=("key_cache", "value_cache"),
                         tags=(torch._C.Tag.cudagraph_unsafe,))
def attend_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, holder: int, layer: torch.Tensor, scaling: float, window: int | None,
              softcap: float | None) -> torch.Tensor:
    # The caches are arguments the op declares it writes, so a compiled graph orders every read
    # and write of them; their capacity dimension is dynamic (the runner marks it), so a cache
    # that grows does not recompile. The layer index is a tensor so that one compiled graph
    # serves every layer (see index_layers). The step's layout comes from the holder.
    return _attend(_HOLDERS[holder], query, key, value, key_cache, value_cache, int(layer), scaling, window,
                   softcap)


@attend_op.register_fake
def _(query, key, value, key_cache, value_cache, holder, layer, scaling, window, softcap):
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[-1])


def mmfusion_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask, scaling: float | None = None, dropout: float = 0.0,
                       sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers attention-interface entry point. query: [1, H, N, d]; key/value: this step's
    new K/V (the model runs without a transformers cache; the op writes the slot cache, which the
    runner passes down the model's keyword arguments as `mmfusion_kv`)."""
    holder: ContextHolder = module._mmfusion_ctx
    key_cache, value_cache = kwargs[KV_KWARG]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if torch.compiler.is_compiling():
        out = attend_op(query, key, value, key_cache, value_cache, holder.id, module._mmfusion_layer, scaling,
                        sliding_window, softcap)
    else:  # eager: skip the custom-op dispatch
        out = _attend(holder, query, key, value, key_cache, value_cache, module.layer_idx, scaling, sliding_window,
                      softcap)
    return out, None


_HOLDERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> live holder, for the op
_HOLDER_IDS = itertools.count(1)


class ContextHolder:
    """Mutable handle shared by the attention modules of one model (and by every engine on it):
    the runner that steps sets its cache and `current` for each forward."""

    __slots__ = ("current", "cache", "id", "__weakref__")

    def __init__(self) -> None:
        self.current: StepContext | None = None
        self.cache = None  # a SlotKVCache
        self.id = next(_HOLDER_IDS)
        _HOLDERS[self.id] = self


def install(model) -> ContextHolder | None:
    """Switch `model` to the slot-cache attention. Returns None if the model can't use it."""
    if not getattr(model, "_supports_attention_backend", False):
        return None
    AttentionInterface.register(ATTN_NAME, mmfusion_attention)
    holder = getattr(model, "_mmfusion_holder", None)
    if holder is not None:  # another engine on these weights: share the holder (its id is in compiled graphs)
        model.set_attn_implementation(ATTN_NAME)
        return holder
    holder = ContextHolder()
    n = 0
    for mod in model.modules():
        if hasattr(mod, "layer_idx") and (hasattr(mod, "q_proj") or hasattr(mod, "c_attn")):
            # object.__setattr__: a plain attribute, not a registered submodule.
            object.__setattr__(mod, "_mmfusion_ctx", holder)
            n += 1
    if n == 0:
        return None
    object.__setattr__(model, "_mmfusion_holder", holder)
    model.set_attn_implementation(ATTN_NAME)
    return holder


def index_layers(model) -> None:
    """Give each attention module its layer index as a (CPU, non-persistent) buffer: a compiled
    layer takes buffers as graph inputs, so it does not specialise, and recompile, per layer."""
    for mod in model.modules():
        if hasattr(mod, "_mmfusion_ctx") and not hasattr(mod, "_mmfusion_layer"):
            mod.register_buffer("_mmfusion_layer", torch.tensor(mod.layer_idx), persistent=False)


@contextlib.contextmanager
def hf_attention(model, name: str = "sdpa"):
    """Temporarily run `model` on transformers' own attention (references, baselines)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
