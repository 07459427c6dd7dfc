"""Owns the model's tensors: turns a SchedulerOutput into one forward pass and sampled tokens.

PagedRunner packs every scheduled token (decode tokens first, then prefill chunks) into a single
[1, N] forward over the paged KV cache, and asks the LM head only for the rows that are sampled
or scored. CompatRunner serves models whose attention does not go through transformers'
attention interface (BLOOM's ALiBi): one forward per sequence with a DynamicCache of its own.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch

from workers.buckets import Buckets
from workers.engine import attention, calibrate
from workers.engine.block_manager import first_block
from workers.engine.compiled import CompiledLayers
from workers.engine.kv_cache import PagedKVCache
from workers.engine.lean import LeanLlama
from workers.engine.sampler import SampleSpec, sample, top_alternatives
from workers.engine.scheduler import Chunk, SchedulerOutput
from workers.engine.sequence import Sequence
from workers.engine.step_result import PromptScores, StepResult
from workers.weights.loaded_model import LoadedModel


def _kept_rows(chunk: Chunk) -> range:
    """Chunk-relative positions whose logits are needed."""
    if chunk.all_logits:
        return range(chunk.length)
    if chunk.need_logits:
        return range(chunk.length - 1, chunk.length)
    return range(0)


def _chunk_tokens(chunk: Chunk) -> list[int]:
    seq = chunk.seq
    end = chunk.start + chunk.length
    p = len(seq.prompt)
    if end <= p:
        return seq.prompt[chunk.start:end]
    return (seq.prompt + seq.output)[chunk.start:end]


class BaseRunner(ABC):
    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.model = lm.model
        self.forward_seconds = 0.0  # time inside forward passes (the rest of a step is bookkeeping)

    @abstractmethod
    def _forward(self, decode: list[Sequence], chunks: list[Chunk]) -> torch.Tensor:
        """Logits of the kept rows, in plan order: decode sequences, then each chunk's kept rows."""

    def release(self, seq: Sequence) -> None:  # noqa: B027 - optional hook, the paged runner holds nothing per sequence
        """A sequence gave its blocks back (finished, aborted or preempted); drop anything held for it."""

    def new_blocks(self, blocks: list[int]) -> None:  # noqa: B027 - optional hook
        """Blocks handed to sequences this step, before anything is written to them."""

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        for seq in plan.preempted:
            self.release(seq)
        self.new_blocks(plan.new_blocks)
        t0 = time.perf_counter()
        logits = self._forward(plan.decode, plan.prefill)
        self.forward_seconds += time.perf_counter() - t0
        return self._sample(plan.decode, plan.prefill, logits)

    def _sample(self, decode: list[Sequence], chunks: list[Chunk], logits: torch.Tensor) -> StepResult:
        specs: list[SampleSpec] = []
        owners: list[Sequence] = []

        def want(seq: Sequence, row: int) -> None:
            p = seq.group.params
            specs.append(SampleSpec(row, p.temperature, p.top_k, p.top_p, seq.group.seed, seq.sample_index,
                                    len(seq.output), p.logprobs, p.wants_logprobs))
            owners.append(seq)

        for i, seq in enumerate(decode):
            want(seq, i)
        result = StepResult()
        row = len(decode)
        for chunk in chunks:
            kept = _kept_rows(chunk)
            if chunk.all_logits and kept:
                result.prompt_scores.append(self._score_prompt(chunk, logits[row: row + len(kept)]))
            if chunk.need_logits and chunk.seq.group.params.max_tokens > 0:
                want(chunk.seq, row + len(kept) - 1)
            row += len(kept)
        tokens, chosen, tops = sample(logits, specs)
        result.samples = list(zip(owners, tokens, chosen, tops))
        return result

    def _score_prompt(self, chunk: Chunk, rows: torch.Tensor) -> PromptScores:
        """Log-probability of each next prompt token under the logits of the position before it."""
        prompt = chunk.seq.prompt
        first_target = chunk.start + 1
        n = max(0, min(chunk.length, len(prompt) - first_target))
        logp = torch.log_softmax(rows[:n].float(), dim=-1)
        targets = torch.tensor(prompt[first_target: first_target + n], device=logp.device)
        vals = logp.gather(1, targets[:, None])[:, 0].tolist() if n else []
        k = chunk.seq.group.params.prompt_logprobs
        tops = top_alternatives(logp, [k] * n) if n else []
        return PromptScores(chunk.seq.group, first_target, vals, tops)


class PagedRunner(BaseRunner):
    """Packed forward over the paged KV cache (models that use transformers' attention interface)."""

    def __init__(self, lm: LoadedModel, holder: attention.ContextHolder, num_blocks: int, block_size: int,
                 lean: LeanLlama | None = None, kv_dtype: torch.dtype | None = None):
        super().__init__(lm)
        self.holder = holder
        self.lean = lean  # the lean forward on packed weights, where the model's family has one
        self.compiled: CompiledLayers | None = None
        self.block_size = block_size
        # the KV cache in the compute dtype (float32 where 16-bit weights compute in float32)
        self.cache = PagedKVCache(holder.groups, num_blocks, block_size, *kv_dims(lm), kv_dtype or lm.dtype, lm.device)

    def measured_attention_span(self) -> int | None:
        """attention_span measured on this machine on the attention path and linears that serve
        (workers.engine.calibrate); None where it cannot be measured."""
        cfg = self.model.config.get_text_config()
        kvh, dk, _ = kv_dims(self.lm)
        layer = next((i for i, (g, p) in sorted(self.holder.position.items())
                      if p == 0 and self.holder.windows[g] is None), None)
        if layer is None:
            return None
        layers = num_layers(self.lm)
        if self.lean is not None:
            inter = getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
            linears = [(x, width) for lay in self.lean.layers
                       for x, width in ((lay.qkv, cfg.hidden_size), (lay.o, cfg.num_attention_heads * dk),
                                        (lay.gate_up, cfg.hidden_size), (lay.down, inter))]
        else:  # the decoder layers' linears (the LM head's name holds no layer index)
            linears = [(m, m.in_features) for name, m in self.model.named_modules()
                       if isinstance(m, torch.nn.Linear) and any(f".{i}." in f".{name}." for i in range(layers))]
        return calibrate.attention_span(self.holder, linears, layers, cfg.num_attention_heads, kvh, dk,
                                        self.block_size, self.cache.keys.dtype, self.lm.device)

    def enable_compile(self, buckets: Buckets) -> None:
        """Run the decoder layers compiled from now on: every step pads its tokens up to a bucket."""
        self.compiled = CompiledLayers(self.model, buckets, self.lm.device)

    def new_blocks(self, blocks: list[int]) -> None:
        # the C++ kernels read only the positions a row holds; the PyTorch paths read whole blocks
        # under a mask, and stale memory (NaN among it) would leak through: zero for them
        h = self.holder
        h.unzeroed = (self.lean is not None and self.compiled is None and h.backend is not None
                      and h.backend.own_positions_only)
        if not h.unzeroed:
            self.cache.zero_blocks(blocks)

    def _group_steps(self, decode: list[Sequence], chunks: list[Chunk], pos: list[int]) -> list[attention.GroupStep]:
        bs, dev = self.block_size, self.lm.device
        offsets = torch.tensor([p % bs for p in pos], device=dev)
        steps = []
        for g, window in enumerate(self.holder.windows):
            writes = [s.blocks.tables[g][s.num_computed // bs] for s in decode]
            for c in chunks:
                t = c.seq.blocks.tables[g]
                writes.extend(t[p // bs] for p in range(c.start, c.start + c.length))
            gs = attention.GroupStep(torch.tensor(writes, dtype=torch.long, device=dev), offsets)
            if decode:
                blocks, per_row, spans = [], set(), []
                for s in decode:
                    t = s.blocks.tables[g]
                    first, last = first_block(window, s.num_computed, bs), s.num_computed // bs
                    n = s.num_computed + 1
                    lo = max(0, n - window) if window is not None else 0
                    spans.append((len(blocks), last + 1 - first, lo - first * bs, n - first * bs))
                    per_row.add(last + 1 - first)
                    blocks.extend(t[first: last + 1])
                gs.pair_blocks = torch.tensor(blocks, device=dev)
                gs.single = len(blocks) == len(decode)
                gs.per_row = per_row.pop() if len(per_row) == 1 else 0
                gs.spans = spans
            steps.append(gs)
        return steps

    def _segments(self, chunks: list[Chunk], first_token: int) -> list[attention.Segment]:
        bs = self.block_size
        segments, t0 = [], first_token
        for c in chunks:
            seg = attention.Segment(t0, c.length, c.start)
            for g, window in enumerate(self.holder.windows):
                if c.start == 0:
                    seg.blocks.append(None)
                    seg.first_pos.append(0)
                    continue
                first = first_block(window, c.start, bs)
                seg.blocks.append(c.seq.blocks.tables[g][first: -(-(c.start + c.length) // bs)])
                seg.first_pos.append(first * bs)
            segments.append(seg)
            t0 += c.length
        return segments

    def _prefill_tables(self, steps: list[attention.GroupStep], chunks: list[Chunk], first_token: int) -> None:
        """The prefill kernel's view of the chunks (GroupStep.prefill_table), per cache group."""
        bs = self.block_size
        for g, (gs, window) in enumerate(zip(steps, self.holder.windows)):
            blocks, rows, t0 = [], [], first_token
            for c in chunks:
                first = first_block(window, c.start, bs)
                rows.append((t0, c.length, c.start, len(blocks), first * bs))
                blocks.extend(c.seq.blocks.tables[g][first: -(-(c.start + c.length) // bs)])
                t0 += c.length
            gs.prefill_blocks = torch.tensor(blocks, dtype=torch.long)
            gs.prefill_table = torch.tensor(rows, dtype=torch.long)

    def _forward(self, decode: list[Sequence], chunks: list[Chunk]) -> torch.Tensor:
        ids = [s.token_at(s.num_computed) for s in decode]
        pos = [s.num_computed for s in decode]
        keep = list(range(len(decode)))
        for chunk in chunks:
            t0 = len(ids)
            ids.extend(_chunk_tokens(chunk))
            pos.extend(range(chunk.start, chunk.start + chunk.length))
            keep.extend(t0 + r for r in _kept_rows(chunk))
        dev = self.lm.device
        groups = self._group_steps(decode, chunks, pos)
        if chunks and self.holder.backend is not None and self.holder.backend.prefill is not None:
            self._prefill_tables(groups, chunks, len(decode))
        self.holder.current = attention.StepContext(
            num_decode=len(decode), num_tokens=len(ids), groups=groups, segments=self._segments(chunks, len(decode)))
        padded = self.compiled.buckets.pad(len(ids)) if self.compiled is not None else None
        if padded is not None and padded > len(ids):
            # padded rows: token 0 at position 0; row-wise layers keep them apart and attention skips them
            extra = padded - len(ids)
            ids = ids + [0] * extra
            pos = pos + [0] * extra
        call = dict(
            input_ids=torch.tensor([ids], device=dev),
            position_ids=torch.tensor([pos], device=dev),
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev),
        )
        return self.run_call(self.holder.current, call)

    def run_call(self, ctx: attention.StepContext, call: dict) -> torch.Tensor:
        """One model call of a step, laid out by `ctx`: the logits of the rows it keeps."""
        self.holder.current = ctx
        return self._call(call)

    def _call(self, call: dict) -> torch.Tensor:
        # no transformers cache: the attention op writes the paged cache, handed down as a keyword
        kv = {attention.KV_KWARG: (self.cache.keys, self.cache.values)}
        if self.lean is not None and self.compiled is None:
            logits = self.lean.forward(call["input_ids"][0], call["position_ids"][0], call["logits_to_keep"],
                                       kv[attention.KV_KWARG])
            self.holder.current = None
            return logits
        if self.compiled is not None and self.compiled.buckets.pad(call["input_ids"].shape[1]) is not None:
            with self.compiled.active():
                out = self.model(**call, use_cache=False, **kv)
        else:
            out = self.model(**call, use_cache=False, **kv)
        self.holder.current = None
        return out.logits[0]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Build the compiled graph of every bucket now, not on the first request that needs it:
        a forward of zero real tokens (attention writes and reads nothing) at each bucket size."""
        if self.compiled is None:
            return
        dev = self.lm.device
        none = torch.zeros(0, dtype=torch.long, device=dev)
        for b in self.compiled.buckets.tokens:
            self.holder.current = attention.StepContext(
                num_decode=0, num_tokens=0, groups=[attention.GroupStep(none, none) for _ in self.holder.windows],
                segments=[])
            zeros = torch.zeros(1, b, dtype=torch.long, device=dev)
            self._call(dict(input_ids=zeros, position_ids=zeros,
                            logits_to_keep=torch.zeros(1, dtype=torch.long, device=dev)))


class CompatRunner(BaseRunner):
    """One forward per sequence with its own DynamicCache: any causal LM, at batch-1 speed. The
    scheduler still counts its blocks, so the budget holds here too."""

    def __init__(self, lm: LoadedModel):
        super().__init__(lm)
        self.caches: dict[int, object] = {}  # by sequence id

    def release(self, seq: Sequence) -> None:
        self.caches.pop(seq.seq_id, None)

    def _run(self, seq: Sequence, ids: list[int], start: int, keep: range) -> torch.Tensor:
        from transformers import DynamicCache

        if start == 0 or seq.seq_id not in self.caches:
            self.caches[seq.seq_id] = DynamicCache(config=self.model.config)
        dev = self.lm.device
        end = start + len(ids)
        out = self.model(
            input_ids=torch.tensor([ids], device=dev),
            attention_mask=torch.ones(1, end, dtype=torch.long, device=dev),
            position_ids=torch.arange(start, end, device=dev)[None],
            past_key_values=self.caches[seq.seq_id],
            use_cache=True,
        )
        return out.logits[0, keep.start: keep.stop]

    def _forward(self, decode: list[Sequence], chunks: list[Chunk]) -> torch.Tensor:
        rows = [self._run(s, [s.token_at(s.num_computed)], s.num_computed, range(0, 1)) for s in decode]
        for c in chunks:
            rows.append(self._run(c.seq, _chunk_tokens(c), c.start, _kept_rows(c)))
        vocab = self.lm.vocab_size
        rows = [r for r in rows if r.shape[0]]
        return torch.cat(rows) if rows else torch.empty(0, vocab, device=self.lm.device)


def kv_dims(lm: LoadedModel) -> tuple[int, int, int]:
    """(kv heads, key head dim, value head dim) of the model's attention layers."""
    cfg = lm.model.config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return kv_heads, head_dim, head_dim


def num_layers(lm: LoadedModel) -> int:
    return lm.model.config.get_text_config().num_hidden_layers


# Where attention_span cannot be measured (workers.engine.calibrate), prefill attention is assumed
# to run at about 40% of the linears' FLOP rate (the C++ kernel's 75-90 GFLOP/s a thread against
# oneDNN's ~190 in bfloat16 on an AVX512-BF16 CPU).
ATTENTION_RATE = 0.4


def attention_span(lm: LoadedModel) -> int:
    """Positions of context whose attention costs about what one token's linears do, estimated
    from the model's shapes: a token's linear FLOPs over its attention FLOPs per position it sees."""
    model = lm.model
    cfg = model.config.get_text_config()
    _, dk, dv = kv_dims(lm)
    embeddings = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())
                  if m is not None and hasattr(m, "weight")}
    linear = max(1, sum(p.numel() for p in model.parameters()) - sum(embeddings.values()))
    per_position = 2 * cfg.num_attention_heads * (dk + dv) * num_layers(lm)
    return max(1, int(2 * linear / per_position * ATTENTION_RATE))
