"""Attention over the paged KV cache for one packed step (decode tokens first, then prefill chunks).

Registered with transformers' AttentionInterface as "mmfusion", so every model whose attention
goes through that interface (Llama, Mistral, Gemma3, GPT-2, OPT, Qwen2, ...) runs on it unchanged.
Registering a name the mask factory does not know also makes the model skip building its own
masks: this module builds them once per step from the sequences' lengths.

The whole step (K/V writes into the cache's blocks, decode and prefill attention) is one opaque
custom op, `mmfusion::attend`, as vLLM's unified attention is: a compiled forward (workers.engine.compiled)
calls it as an extern kernel, so the graph holds only tensor math and its shapes depend only on the
padded token count, never on how the step's tokens split into sequences. Eager runs call the same
function directly.

A step's metadata (StepContext: block tables, write slots, segments) is built by the runner's
attention backend (workers.engine.attention_backend) and handed to `attend` as an argument: by the
lean forward directly, and through the model call's keyword arguments (`mmfusion_step`) on
transformers' modules. A compiled graph's inputs are tensors only, so there the op reads the step
from the model's holder, named by its id, for the span of that call (ContextHolder.stepping).

Decode reads only the blocks each row holds: every (row, block) pair is scored as one batched
matmul, and a softmax over each row's pairs (a max and a sum gathered per row, as flash-decoding
splits a sequence) joins them, so its cost follows the sum of the lengths, not rows x longest.
A prompt computed from its start attends over this step's own keys (SDPA, causal); a later chunk
gathers its blocks.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from workers.engine.block_manager import CacheGroups
from workers.lean_rules import attention_modules, layer_windows

ATTN_NAME = "mmfusion"
KV_KWARG = "mmfusion_kv"  # the model call's keyword argument that carries (keys, values) of the paged cache
STEP_KWARG = "mmfusion_step"  # the model call's keyword argument that carries the step's StepContext
LAYER_BUFFER = "mmfusion_layer"  # an attention module's layer index, as a buffer (index_layers)


@dataclass(slots=True)
class Segment:
    """A prefill chunk: packed tokens [tok_start, tok_start+length), at positions start_pos..., and
    per cache group the blocks it attends over, the first of which starts at position first_pos[g]."""

    tok_start: int
    length: int
    start_pos: int
    blocks: list[list[int] | None] = field(default_factory=list)  # None: from position 0, this step's keys
    first_pos: list[int] = field(default_factory=list)
    _tensors: dict = field(default_factory=dict)  # group -> blocks[g] as a tensor, made once a step

    def block_tensor(self, g: int, device) -> torch.Tensor:
        """blocks[g] as a tensor, made when a PyTorch path first needs it (the C++ kernels read
        their own table) and kept for the step's other layers."""
        t = self._tensors.get(g)
        if t is None:
            t = self._tensors[g] = torch.tensor(self.blocks[g], device=device)
        return t


@dataclass(slots=True)
class GroupStep:
    """One cache group's view of a step: where each packed token's K/V goes, and the (decode row,
    block) pairs that decode attends over."""

    write_blocks: torch.Tensor  # [N]
    write_offsets: torch.Tensor  # [N]
    pair_blocks: torch.Tensor | None = None  # [T]
    # made from the spans only when the PyTorch path runs (ensure_pairs); the C++ kernel needs neither
    pair_rows: torch.Tensor | None = None  # [T] decode row of each pair
    pair_valid: torch.Tensor | None = None  # [T, block_size] positions the row may see
    single: bool = False  # one pair per decode row, in row order: a plain softmax
    per_row: int = 0  # >0: every decode row has this many pairs, rows in order
    # per decode row: (its first pair, its pair count, and the span [lo, hi) of positions it sees
    # within its gathered blocks)
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    span_table: torch.Tensor | None = None  # spans as a tensor, made once a step by the kernel that wants it
    # for a prefill kernel (AttentionBackend.prefill): the chunks' block lists one after another,
    # and per chunk (first token row, tokens, first position, offset in prefill_blocks, position of
    # its first block)
    prefill_blocks: torch.Tensor | None = None
    prefill_table: torch.Tensor | None = None
    # the segments (indices into StepContext.segments) that the library's attention serves in this
    # group instead of the prefill kernel (AttentionBackend.library_prefill), left out of its table
    library_segments: list[int] = field(default_factory=list)

    def ensure_pairs(self, block_size: int) -> None:
        """pair_rows and pair_valid, from the spans: pair k of a row covers positions
        [k * block_size, (k + 1) * block_size) of its blocks, of which it sees [lo, hi)."""
        if self.pair_valid is not None:
            return
        dev = self.pair_blocks.device
        rows, first, lo, hi = [], [], [], []
        for r, (_, n, a, b) in enumerate(self.spans):
            rows.extend([r] * n)
            first.extend(range(0, n * block_size, block_size))
            lo.extend([a] * n)
            hi.extend([b] * n)
        pos = torch.tensor(first, device=dev)[:, None] + torch.arange(block_size, device=dev)
        self.pair_rows = torch.tensor(rows, device=dev)
        self.pair_valid = (pos >= torch.tensor(lo, device=dev)[:, None]) & (pos < torch.tensor(hi, device=dev)[:, None])


@dataclass(slots=True)
class StepContext:
    """What attention needs to know about the packed batch of one forward pass, built by the
    runner's attention backend (AttentionBackend.metadata)."""

    num_decode: int
    num_tokens: int  # real packed tokens; a compiled forward pads past them, and their rows stay zero
    groups: list[GroupStep]
    segments: list[Segment]
    position: dict  # layer -> (cache group, index in its storage): CacheGroups.position_of
    windows: list  # per cache group, its sliding window (None: full attention)
    backend: object = None  # the AttentionBackend whose kernels run (None: the PyTorch paths)
    # new blocks were not zeroed (the backend's kernels never read a position past a row's own):
    # the PyTorch paths, which read whole blocks under a mask, must not run then
    unzeroed: bool = False
    masks: dict = field(default_factory=dict)  # built lazily, shared by all layers
    prompt_groups: dict = field(default_factory=dict)  # whole-prompt groupings by window, likewise

    def whole_prompt_groups(self, window: int | None, device) -> tuple[list, list[int]]:
        """Segments that are whole prompts (from position 0, inside the window), grouped by length
        when two or more share one: [(packed token rows, length)], and the segments left to
        attend one by one. Built once per step, shared by all layers."""
        got = self.prompt_groups.get(window)
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
                groups.append((tokens, length))
                grouped.update(members)
            got = self.prompt_groups[window] = (groups, [i for i in range(len(self.segments)) if i not in grouped])
        return got

    def segment_mask(self, i: int, g: int, window: int | None, device) -> torch.Tensor:
        """Which keys each query row of segment i sees, [c, keys]."""
        key = ("s", i, g, window)
        m = self.masks.get(key)
        if m is None:
            seg = self.segments[i]
            first = seg.first_pos[g] if seg.blocks[g] is not None else 0
            q_pos = torch.arange(seg.start_pos, seg.start_pos + seg.length, device=device)[:, None]
            k_pos = torch.arange(first, seg.start_pos + seg.length, device=device)[None, :]
            m = k_pos <= q_pos
            if window is not None:
                m &= k_pos > q_pos - window
            self.masks[key] = m
        return m

    def additive_mask(self, i: int, g: int, window: int | None, device, dtype: torch.dtype,
                      repeat: int = 1) -> torch.Tensor:
        """segment_mask as SDPA adds it: 0 where a key is seen, -inf where not, in `dtype`; with
        `repeat`, the rows repeated that many times (the query heads of one KV head, folded into
        rows). Given the boolean mask, ATen's CPU flash attention converts it on every call: a fifth
        of the time of a 512-token chunk over 4,096 keys (18.0 against 14.3 ms a layer, 2-core
        Sapphire Rapids)."""
        key = ("a", i, g, window, repeat, dtype)
        m = self.masks.get(key)
        if m is None:
            seen = self.segment_mask(i, g, window, device)
            m = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
            m = self.masks[key] = m.repeat(repeat, 1) if repeat > 1 else m
        return m


# Up to this many decode rows attend one row at a time through SDPA (a handful of operations a
# row); more go through the batched pairs below (a fixed twenty or so for the whole batch).
FEW_DECODE_ROWS = 2


def decode_attention(gs: GroupStep, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float, softcap: float | None) -> torch.Tensor:
    """q: [D, H, d]; key/value: one layer's blocks [num_blocks, kvh, block, d]. Returns [D, H, dv]."""
    d_rows, heads, dim = q.shape
    if d_rows <= FEW_DECODE_ROWS and softcap is None and gs.spans:
        rows = [_row_attention(q[r], key, value, gs.pair_blocks[a: a + n], lo, hi, scaling)
                for r, (a, n, lo, hi) in enumerate(gs.spans)]
        return rows[0] if d_rows == 1 else torch.cat(rows)
    kvh = key.shape[1]
    gs.ensure_pairs(key.shape[2])
    qg = q.to(key.dtype).reshape(d_rows, kvh, heads // kvh, dim)
    kb = key.index_select(0, gs.pair_blocks)  # [T, kvh, block, d]: only the blocks the rows hold
    vb = value.index_select(0, gs.pair_blocks)
    qp = qg if gs.single else qg.index_select(0, gs.pair_rows)
    scores = torch.matmul(qp, kb.transpose(-1, -2)).float() * scaling  # [T, kvh, g, block]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~gs.pair_valid[:, None, None, :], float("-inf"))
    if gs.single:
        probs = torch.softmax(scores, dim=-1).to(vb.dtype)
        out = torch.matmul(probs, vb)
    elif gs.per_row:
        # every row holds as many blocks: the per-row max and sums are reductions over a view
        n = gs.per_row
        pair_max = scores.amax(-1)
        row_max = pair_max.view(d_rows, n, *pair_max.shape[1:]).amax(1)
        e = torch.exp(scores - row_max.repeat_interleave(n, 0).unsqueeze(-1))
        denom = e.sum(-1).view(d_rows, n, *pair_max.shape[1:]).sum(1)
        part = torch.matmul(e.to(vb.dtype), vb).float()
        out = part.view(d_rows, n, *part.shape[1:]).sum(1) / denom.unsqueeze(-1)
    else:
        # softmax over each row's pairs: every pair has a visible position, so its max is finite
        rows = gs.pair_rows
        pair_max = scores.amax(-1)
        row_max = pair_max.new_full((d_rows, *pair_max.shape[1:]), float("-inf")).scatter_reduce_(
            0, rows[:, None, None].expand_as(pair_max), pair_max, "amax")
        e = torch.exp(scores - row_max.index_select(0, rows).unsqueeze(-1))
        denom = pair_max.new_zeros(row_max.shape).index_add_(0, rows, e.sum(-1))
        part = torch.matmul(e.to(vb.dtype), vb).float()
        out = part.new_zeros(d_rows, *part.shape[1:]).index_add_(0, rows, part) / denom.unsqueeze(-1)
    return out.reshape(d_rows, heads, value.shape[-1]).to(q.dtype)


def _row_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: torch.Tensor, lo: int, hi: int,
                   scaling: float) -> torch.Tensor:
    """One decode row: q [H, d] over positions [lo, hi) of its gathered blocks. Returns [1, H, dv]."""
    heads = q.shape[0]
    k = _gather(key, blocks, hi)[:, :, lo:]
    v = _gather(value, blocks, hi)[:, :, lo:]
    out = F.scaled_dot_product_attention(q.to(k.dtype).view(1, heads, 1, -1), k, v, scale=scaling,
                                         enable_gqa=heads != k.shape[1])
    return out.view(1, heads, -1).to(q.dtype)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Positions [0, length) of a block list as one [1, kvh, length, d] tensor."""
    b = cache.index_select(0, blocks)  # [nb, kvh, block, d]
    return b.transpose(0, 1).reshape(1, b.shape[1], -1, b.shape[-1])[:, :, :length]


def _segment_attention(ctx: StepContext, i: int, g: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       key_cache: torch.Tensor, value_cache: torch.Tensor, scaling: float, window: int | None,
                       softcap: float | None) -> torch.Tensor:
    """q: [c, H, d] for segment i; key/value: this step's [N, kvh, d]. Returns [c, H, dv]."""
    seg = ctx.segments[i]
    end = seg.start_pos + seg.length
    q = q.transpose(0, 1).unsqueeze(0)  # [1, H, c, d]
    if seg.blocks[g] is None:  # from position 0: this step computed every key it sees
        k = key[seg.tok_start: seg.tok_start + seg.length].transpose(0, 1).unsqueeze(0)
        v = value[seg.tok_start: seg.tok_start + seg.length].transpose(0, 1).unsqueeze(0)
    else:
        blocks = seg.block_tensor(g, key_cache.device)
        k = _gather(key_cache, blocks, end - seg.first_pos[g])
        v = _gather(value_cache, blocks, end - seg.first_pos[g])
    heads, kvh = q.shape[1], k.shape[1]
    q = q.to(k.dtype)
    if softcap is None and seg.start_pos == 0 and (window is None or window >= end):
        # a whole prompt from its start: plain causal attention, no mask to build or read
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=heads != kvh)
        return out[0].transpose(0, 1)
    if softcap is None:
        # the query heads that share a KV head attend as one head of g*c rows: each key block is
        # read once per KV head instead of once per query head
        c, per = q.shape[2], heads // kvh
        mask = ctx.additive_mask(i, g, window, q.device, q.dtype, repeat=per)
        out = F.scaled_dot_product_attention(q.reshape(1, kvh, per * c, q.shape[-1]), k, v, attn_mask=mask,
                                             scale=scaling)
        return out.reshape(heads, c, -1).transpose(0, 1)
    mask = ctx.segment_mask(i, g, window, q.device)
    k = k.repeat_interleave(heads // kvh, dim=1)
    v = v.repeat_interleave(heads // kvh, dim=1)
    s = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scaling / softcap) * softcap
    s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    out = torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype), v)
    return out[0].transpose(0, 1)


def layer_cache(ctx: StepContext, layer: int, key_cache: torch.Tensor,
                value_cache: torch.Tensor) -> tuple[GroupStep, torch.Tensor, torch.Tensor]:
    """The step's view of layer `layer`'s cache group, and the layer's keys and values in the pool."""
    g, p = ctx.position[layer]
    return ctx.groups[g], key_cache[p], value_cache[p]


def attend(ctx: StepContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           key_cache: torch.Tensor, value_cache: torch.Tensor, layer: int, scaling: float, window: int | None,
           softcap: float | None, written: bool = False) -> torch.Tensor:
    """Write this step's K/V into layer `layer`'s blocks (unless the caller has: `written`), attend.
    Token-major: query [N, H, d]; key/value [N, kvh, d] (N may include padding past
    ctx.num_tokens); key_cache/value_cache: the whole pool (PagedKVCache.keys/values). Returns [N, H, dv]."""
    n = ctx.num_tokens
    g, p = ctx.position[layer]
    planned = ctx.windows[g]
    if planned is not None and (window is None or window > planned):
        raise RuntimeError(f"layer {layer} attends over a window of {window}, but its cache group keeps {planned}")
    gs = ctx.groups[g]
    key_buf, value_buf = key_cache[p], value_cache[p]
    backend = ctx.backend
    if written and not ctx.segments and backend is not None and ctx.num_decode == n == query.shape[0]:
        # decode rows only, their K/V written by the caller: the kernel's result as it is, without
        # an output buffer to fill (one stream's step runs this for every layer)
        return backend.decode(gs, query, key_buf, value_buf, scaling, softcap)
    if not written:
        key_buf[gs.write_blocks, :, gs.write_offsets] = key[:n].to(key_buf.dtype)
        value_buf[gs.write_blocks, :, gs.write_offsets] = value[:n].to(value_buf.dtype)
    n_all, heads = query.shape[0], query.shape[1]
    out = (query.new_zeros if n_all > n else query.new_empty)(n_all, heads, value_buf.shape[-1])
    d = ctx.num_decode
    if d:
        kernel = backend.decode if backend is not None else decode_attention
        out[:d] = kernel(gs, query[:d], key_buf, value_buf, scaling, softcap)
    prefill = backend.prefill if backend is not None else None
    if (ctx.segments and softcap is None and prefill is not None and gs.prefill_table is not None
            and (not len(gs.prefill_table) or prefill(out, query, key_buf, value_buf, gs, window, scaling))):
        # the chunks the backend routes to the library (SDPA over their gathered keys) read only the
        # positions they hold, as the kernel does: unzeroed blocks are safe for them
        for i in gs.library_segments:
            seg = ctx.segments[i]
            rows = slice(seg.tok_start, seg.tok_start + seg.length)
            out[rows] = _segment_attention(ctx, i, g, query[rows], key, value, key_buf, value_buf, scaling, window,
                                           softcap)
        return out
    if ctx.segments and ctx.unzeroed:
        raise RuntimeError("prefill attention would read blocks that were not zeroed")
    alone = range(len(ctx.segments))
    if softcap is None and len(ctx.segments) > 1:
        groups, alone = ctx.whole_prompt_groups(window, query.device)
        for tokens, length in groups:
            out.index_copy_(0, tokens, _whole_prompts_attention(query, key, value, tokens, length, scaling))
    for i in alone:
        seg = ctx.segments[i]
        rows = slice(seg.tok_start, seg.tok_start + seg.length)
        out[rows] = _segment_attention(ctx, i, g, query[rows], key, value, key_buf, value_buf, scaling, window,
                                       softcap)
    return out


def _whole_prompts_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, tokens: torch.Tensor,
                             length: int, scaling: float) -> torch.Tensor:
    """Causal attention of G whole prompts of one length as one batched SDPA over this step's own
    keys (a short-request step holds dozens of them: one call per prompt per layer was most of
    its attention time). tokens: [G*length] packed rows. Returns [G*length, H, dv]."""
    heads, dim = query.shape[1], query.shape[-1]
    kvh = key.shape[1]
    g = tokens.shape[0] // length
    q = query.index_select(0, tokens).view(g, length, heads, dim).transpose(1, 2)
    k = key.index_select(0, tokens).view(g, length, kvh, dim).transpose(1, 2)
    v = value.index_select(0, tokens).view(g, length, kvh, value.shape[-1]).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=heads != kvh)
    return o.transpose(1, 2).reshape(g * length, heads, v.shape[-1]).to(query.dtype)


def _attend_hf(ctx: StepContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               key_cache: torch.Tensor, value_cache: torch.Tensor, layer: int, scaling: float, window: int | None,
               softcap: float | None) -> torch.Tensor:
    """attend() in transformers' layouts: query [1, H, N, d], key/value [1, kvh, N, d]; returns
    [1, N, H, dv]."""
    return attend(ctx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache,
                  value_cache, layer, scaling, window, softcap).unsqueeze(0)


@torch.library.custom_op("mmfusion::attend", mutates_args=("key_cache", "value_cache"),
                         tags=(torch._C.Tag.cudagraph_unsafe,))
def attend_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, holder: int, layer: torch.Tensor, scaling: float, window: int | None,
              softcap: float | None) -> torch.Tensor:
    # The caches are arguments the op declares it writes, so a compiled graph orders every read
    # and write of them; the pool never changes shape. The layer index is a tensor so that one
    # compiled graph serves every layer (see index_layers). The step's layout comes from the holder,
    # which holds it for the span of the compiled call (ContextHolder.stepping).
    return _attend_hf(_HOLDERS[holder].current, query, key, value, key_cache, value_cache, int(layer), scaling, window,
                      softcap)


@attend_op.register_fake
def _(query, key, value, key_cache, value_cache, holder, layer, scaling, window, softcap):
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[-1])


def mmfusion_attention(holder: ContextHolder, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask, scaling: float | None = None, dropout: float = 0.0,
                       sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers attention-interface entry point, registered per model with its holder bound
    (install). query: [1, H, N, d]; key/value: this step's new K/V (the model runs without a
    transformers cache; the op writes the paged cache, which the runner passes down the model's
    keyword arguments as `mmfusion_kv`, with the step's metadata as `mmfusion_step`)."""
    key_cache, value_cache = kwargs[KV_KWARG]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if torch.compiler.is_compiling():
        out = attend_op(query, key, value, key_cache, value_cache, holder.id, module.get_buffer(LAYER_BUFFER),
                        scaling, sliding_window, softcap)
    else:  # eager: skip the custom-op dispatch
        out = _attend_hf(kwargs[STEP_KWARG], query, key, value, key_cache, value_cache, module.layer_idx, scaling,
                         sliding_window, softcap)
    return out, None


_HOLDERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> live holder, for the op
_HOLDER_IDS = itertools.count(1)


class ContextHolder:
    """What the attention modules of one model share (and every engine on its weights): its cache
    groups and layers' windows, and its id, which compiled graphs name. `current` is the step a
    compiled call's op reads, set only for the span of that call (`stepping`); eager calls carry
    their step as an argument."""

    __slots__ = ("current", "groups", "position", "windows", "id", "__weakref__")

    def __init__(self, groups: CacheGroups) -> None:
        self.current: StepContext | None = None
        self.groups = groups
        self.position = groups.position_of()  # layer -> (cache group, index in its storage)
        self.windows = groups.windows
        self.id = next(_HOLDER_IDS)
        _HOLDERS[self.id] = self

    @contextlib.contextmanager
    def stepping(self, ctx: StepContext):
        """The step a compiled call's attention op reads, for the span of that call."""
        self.current = ctx
        try:
            yield
        finally:
            self.current = None


def install(model) -> ContextHolder | None:
    """Switch `model` to the paged-cache attention. Returns None if the model can't use it.

    The attention function transformers calls is registered for this model under a name of its own,
    with the model's holder bound: nothing is set on transformers' modules. Another engine on these
    weights finds the holder by that name (its id is in compiled graphs, so it is shared)."""
    if not getattr(model, "_supports_attention_backend", False):
        return None
    current = str(model.config._attn_implementation or "")
    if current.startswith(f"{ATTN_NAME}-") and current[len(ATTN_NAME) + 1:].isdigit():
        holder = _HOLDERS.get(int(current[len(ATTN_NAME) + 1:]))
        if holder is not None:
            return holder
    mods = attention_modules(model)
    if not mods:
        return None
    holder = ContextHolder(CacheGroups.from_windows(layer_windows(model, mods)))
    name = f"{ATTN_NAME}-{holder.id}"
    AttentionInterface.register(name, functools.partial(mmfusion_attention, holder))
    model.set_attn_implementation(name)
    return holder


def index_layers(model) -> None:
    """Give each attention module its layer index as a (CPU, non-persistent) buffer: a compiled
    layer takes buffers as graph inputs, so it does not specialise, and recompile, per layer."""
    for mod in attention_modules(model):
        if LAYER_BUFFER not in dict(mod.named_buffers(recurse=False)):
            mod.register_buffer(LAYER_BUFFER, torch.tensor(mod.layer_idx), persistent=False)


@contextlib.contextmanager
def hf_attention(model, name: str = "sdpa"):
    """Temporarily run `model` on transformers' own attention (references, baselines)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
