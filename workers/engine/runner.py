"""Owns the model's tensors: turns a SchedulerOutput into one forward pass and sampled tokens.

SlotRunner packs every scheduled token (decode tokens first, then prefill chunks) into a single
[1, N] forward over the slot KV cache, and asks the LM head only for the rows that are sampled
or scored. CompatRunner serves models whose attention does not go through transformers'
attention interface (BLOOM's ALiBi): one forward per sequence with a DynamicCache per slot.
"""

from __future__ import annotations

import copy
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from workers.engine import attention
from workers.engine.buckets import Buckets
from workers.engine.compiled import CompiledLayers
from workers.engine.kv_cache import SlotKVCache
from workers.engine.sampler import SampleSpec, sample, top_alternatives
from workers.engine.scheduler import Chunk, SchedulerOutput
from workers.engine.sequence import Sequence, SequenceGroup
from workers.weights.loaded_model import LoadedModel


@dataclass(slots=True)
class PromptScores:
    group: SequenceGroup
    first_target: int  # prompt index of the token scored by logprobs[0]
    logprobs: list[float]
    top: list[dict[int, float] | None]


@dataclass(slots=True)
class StepResult:
    samples: list[tuple[Sequence, int, float, dict | None]] = field(default_factory=list)
    prompt_scores: list[PromptScores] = field(default_factory=list)


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
    def __init__(self, lm: LoadedModel, max_batch_size: int):
        self.lm = lm
        self.model = lm.model
        self.max_batch_size = max_batch_size
        self.forward_seconds = 0.0  # time inside forward passes (the rest of a step is bookkeeping)

    @abstractmethod
    def _forward(self, decode: list[Sequence], chunks: list[Chunk], max_len: int) -> torch.Tensor:
        """Logits of the kept rows, in plan order: decode sequences, then each chunk's kept rows."""

    @abstractmethod
    def _copy(self, src: int, dst: int, length: int) -> None:
        """Copy the cached K/V of positions [0, length) from slot src to slot dst."""

    def release(self, slot: int) -> None:  # noqa: B027 - optional hook, most runners hold nothing per slot
        """A slot was freed; drop anything held for it."""

    def _move(self, src: int, dst: int, length: int) -> None:
        """A sequence changes slot (compaction); its old slot is free afterwards."""
        self._copy(src, dst, length)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        for src, dst, n in plan.moves:
            self._move(src, dst, n)
        for src, dst, n in plan.copies:
            self._copy(src, dst, n)
        decode = sorted(plan.decode, key=lambda s: s.slot)
        t0 = time.perf_counter()
        logits = self._forward(decode, plan.prefill, plan.max_len)
        self.forward_seconds += time.perf_counter() - t0
        for src, dst, n in plan.forks:
            self._copy(src, dst, n)
        return self._postprocess(decode, plan.prefill, logits)

    def _postprocess(self, decode: list[Sequence], chunks: list[Chunk], logits: torch.Tensor) -> StepResult:
        specs: list[SampleSpec] = []
        owners: list[Sequence] = []

        def want(seq: Sequence, row: int) -> None:
            p = seq.group.params
            specs.append(SampleSpec(row, p.temperature, p.top_k, p.top_p, seq.group.seed, seq.sample_index,
                                    len(seq.output), p.logprobs))
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
                seq = chunk.seq
                targets = seq.group.seqs if (seq.sample_index == 0 and not seq.output) else [seq]
                for s in targets:
                    want(s, row + len(kept) - 1)
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


class SlotRunner(BaseRunner):
    """Packed forward over the slot KV cache (models that use transformers' attention interface)."""

    def __init__(self, lm: LoadedModel, max_batch_size: int, holder: attention.ContextHolder):
        super().__init__(lm, max_batch_size)
        self.holder = holder
        self.compiled: CompiledLayers | None = None
        self.trace: list | None = None  # set to [] to record each step's model call (bench replay)
        cfg = self.model.config.get_text_config()
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.cache = SlotKVCache(cfg.num_hidden_layers, max_batch_size, kv_heads, head_dim, lm.dtype, lm.device,
                                 max_capacity=lm.max_model_len)

    def enable_compile(self, buckets: Buckets) -> None:
        """Run the decoder layers compiled from now on: every step pads its tokens up to a bucket."""
        self.compiled = CompiledLayers(self.model, buckets, self.lm.device)

    def _copy(self, src: int, dst: int, length: int) -> None:
        self.cache.copy_prefix(src, dst, length)

    def _forward(self, decode: list[Sequence], chunks: list[Chunk], max_len: int) -> torch.Tensor:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        for i, seq in enumerate(decode):
            ids.append(seq.token_at(seq.num_computed))
            pos.append(seq.num_computed)
            slots.append(seq.slot)
            keep.append(i)
        segments: list[attention.Segment] = []
        for chunk in chunks:
            t0 = len(ids)
            ids.extend(_chunk_tokens(chunk))
            pos.extend(range(chunk.start, chunk.start + chunk.length))
            slots.extend([chunk.seq.slot] * chunk.length)
            keep.extend(t0 + r for r in _kept_rows(chunk))
            segments.append(attention.Segment(t0, chunk.length, chunk.seq.slot, chunk.start))
        self.cache.fit(max_len)
        dev = self.lm.device
        d = len(decode)
        dslots = slots[:d]
        dense = dslots == list(range(d))
        self.holder.cache = self.cache  # engines on the same weights share the holder
        self.holder.current = attention.StepContext(
            num_decode=d,
            num_tokens=len(ids),
            decode_slots=torch.tensor(dslots, device=dev) if d else None,
            decode_lengths=torch.tensor([p + 1 for p in pos[:d]], device=dev) if d else None,
            dense=dense,
            rows=(d if dense else max(dslots) + 1) if d else 0,
            span=self.cache.capacity,  # whole rows: contiguous, see SlotKVCache
            segments=segments,
        )
        self.cache.write_slots = torch.tensor(slots, device=dev)
        self.cache.write_pos = torch.tensor(pos, device=dev)
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
        if self.trace is not None:
            self.trace.append((max_len, self.holder.current, self.cache.write_slots, self.cache.write_pos, call))
        return self._call(call)

    def _call(self, call: dict) -> torch.Tensor:
        # no transformers cache: the attention op writes the slot cache, handed down as a keyword
        kv = {attention.KV_KWARG: (self.cache.keys, self.cache.values)}
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
        self.holder.cache = self.cache
        for b in self.compiled.buckets.tokens:
            self.holder.current = attention.StepContext(
                num_decode=0, num_tokens=0, decode_slots=None, decode_lengths=None, dense=True, rows=0,
                span=self.cache.capacity, segments=[])
            self.cache.write_slots = self.cache.write_pos = torch.zeros(0, dtype=torch.long, device=dev)
            zeros = torch.zeros(1, b, dtype=torch.long, device=dev)
            self._call(dict(input_ids=zeros, position_ids=zeros,
                            logits_to_keep=torch.zeros(1, dtype=torch.long, device=dev)))

    @torch.inference_mode()
    def replay(self, trace: list) -> None:
        """Re-run recorded model calls alone: the forward-only cost of a schedule."""
        for max_len, ctx, w_slots, w_pos, call in trace:
            self.cache.fit(max_len)
            ctx.masks.clear()
            ctx.groups.clear()
            self.holder.cache, self.holder.current = self.cache, ctx
            self.cache.write_slots, self.cache.write_pos = w_slots, w_pos
            self._call(call)


class CompatRunner(BaseRunner):
    """One forward per sequence with its own DynamicCache: any causal LM, at batch-1 speed."""

    def __init__(self, lm: LoadedModel, max_batch_size: int):
        super().__init__(lm, max_batch_size)
        self.caches: dict[int, object] = {}

    def release(self, slot: int) -> None:
        self.caches.pop(slot, None)

    def _copy(self, src: int, dst: int, length: int) -> None:
        c = copy.deepcopy(self.caches[src])
        c.crop(length)
        self.caches[dst] = c

    def _move(self, src: int, dst: int, length: int) -> None:
        if src in self.caches:
            self.caches[dst] = self.caches.pop(src)

    def _run(self, slot: int, ids: list[int], start: int, keep: range) -> torch.Tensor:
        from transformers import DynamicCache

        if start == 0 or slot not in self.caches:
            self.caches[slot] = DynamicCache(config=self.model.config)
        dev = self.lm.device
        end = start + len(ids)
        out = self.model(
            input_ids=torch.tensor([ids], device=dev),
            attention_mask=torch.ones(1, end, dtype=torch.long, device=dev),
            position_ids=torch.arange(start, end, device=dev)[None],
            past_key_values=self.caches[slot],
            use_cache=True,
        )
        return out.logits[0, keep.start: keep.stop]

    def _forward(self, decode: list[Sequence], chunks: list[Chunk], max_len: int) -> torch.Tensor:
        rows = [self._run(s.slot, [s.token_at(s.num_computed)], s.num_computed, range(0, 1)) for s in decode]
        for c in chunks:
            rows.append(self._run(c.seq.slot, _chunk_tokens(c), c.start, _kept_rows(c)))
        vocab = self.lm.vocab_size
        rows = [r for r in rows if r.shape[0]]
        return torch.cat(rows) if rows else torch.empty(0, vocab, device=self.lm.device)


def make_runner(lm: LoadedModel, max_batch_size: int) -> BaseRunner:
    """The packed slot runner when the model's attention allows it, else the per-sequence one."""
    holder = attention.install(lm.model)
    if holder is None:
        return CompatRunner(lm, max_batch_size)
    return SlotRunner(lm, max_batch_size, holder)
