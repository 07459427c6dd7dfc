"""Decides which sequences run next and how many tokens each computes. Never touches tensors.

Each step: every running sequence that is decoding computes one token; prompts still being
prefilled continue in chunks; then waiting requests are admitted first-come first-served while
cache slots (max_batch_size) and the step's token budget (max_batch_tokens) allow. A request's
samples share one prefill: sample 0 computes the prompt and the others fork from it. A prompt
that starts with tokens some running sequence already has in cache copies that prefix instead
of recomputing it.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from workers.config_keys import MODEL
from workers.engine.sequence import Sequence, SequenceGroup, Status


@dataclass(slots=True)
class SchedulerConfig:
    max_batch_size: int = MODEL["max_batch_size"].default  # sequences holding a cache slot at once
    max_batch_tokens: int = MODEL["max_batch_tokens"].default  # tokens computed in one step (decode + prefill)
    min_shared_prefix: int = 16  # shortest prompt prefix worth copying from another sequence

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_tokens", "min_shared_prefix"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_batch_tokens < self.max_batch_size:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must be >= max_batch_size "
                f"({self.max_batch_size}) so every running sequence can decode each step")


@dataclass(slots=True)
class Chunk:
    """Tokens [start, start+length) of `seq` to compute this step."""

    seq: Sequence
    start: int
    length: int
    need_logits: bool  # the chunk reaches the last known token: sample from its logits
    all_logits: bool  # prompt log-probabilities were asked for: keep logits of every position


@dataclass(slots=True)
class SchedulerOutput:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[Chunk] = field(default_factory=list)
    moves: list[tuple[int, int, int]] = field(default_factory=list)  # compaction (src, dst, len), first
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (src, dst, len) before the forward
    forks: list[tuple[int, int, int]] = field(default_factory=list)  # (src, dst, len) after the forward
    admitted: list[SequenceGroup] = field(default_factory=list)
    max_len: int = 0  # longest cached length of any slot-holding sequence after this step

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.length for c in self.prefill)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    def request_ids(self) -> set[str]:
        """The requests whose state this step touches (what a failed step may have left half-done)."""
        return ({s.group.request_id for s in self.decode} | {c.seq.group.request_id for c in self.prefill}
                | {g.request_id for g in self.admitted})


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[Sequence] = []  # sequences holding a slot that compute tokens
        self.free_slots: list[int] = list(range(config.max_batch_size))
        heapq.heapify(self.free_slots)
        self.groups: dict[str, SequenceGroup] = {}

    # --- queue management -----------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        if group.params.num_samples > self.config.max_batch_size:
            raise ValueError(
                f"n/best_of ({group.params.num_samples}) exceeds max_batch_size ({self.config.max_batch_size})")
        self.waiting.append(group)
        self.groups[group.request_id] = group

    def slots_in_use(self) -> int:
        return self.config.max_batch_size - len(self.free_slots)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        if seq.group.finished:
            self.groups.pop(seq.group.request_id, None)

    def abort(self, request_id: str) -> SequenceGroup | None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        if group in self.waiting:
            self.waiting.remove(group)
        for seq in group.seqs:
            if not seq.finished:
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
                if seq in self.running:
                    self.running.remove(seq)
                self._release(seq)
        return group

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            heapq.heappush(self.free_slots, seq.slot)
            seq.slot = None

    # --- the decision -----------------------------------------------------------------------
    def _compact(self, out: SchedulerOutput) -> None:
        """Keep occupied slots at 0..n-1: decode attention then spans only live rows."""
        holders = [s for g in self.groups.values() for s in g.seqs if s.slot is not None]
        n = len(holders)
        holes = sorted(x for x in self.free_slots if x < n)
        if not holes:
            return
        movers = sorted((s for s in holders if s.slot >= n), key=lambda s: -s.slot)
        for hole, seq in zip(holes, movers):
            out.moves.append((seq.slot, hole, seq.num_computed))
            seq.slot = hole
        self.free_slots = list(range(n, self.config.max_batch_size))
        heapq.heapify(self.free_slots)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._compact(out)
        budget = self.config.max_batch_tokens
        prefilling: list[Sequence] = []
        for seq in self.running:
            if seq.in_prefill:
                prefilling.append(seq)
            else:
                out.decode.append(seq)
        budget -= len(out.decode)
        for seq in prefilling:
            if budget <= 0:
                break
            budget -= self._add_chunk(out, seq, budget)
        while self.waiting and budget > 0:
            group = self.waiting[0]
            need = group.params.num_samples
            if need > len(self.free_slots):
                break
            src, plen = self._find_prefix(group)
            if src is not None and src.num_computed < plen:
                break  # the shared prefix is still being computed: admit next step and copy it
            self.waiting.popleft()
            self._admit(group, out, src, plen)
            budget -= self._add_chunk(out, group.seqs[0], budget)
        scheduled = {c.seq.seq_id: c.start + c.length for c in out.prefill}
        out.max_len = max((scheduled.get(s.seq_id, s.num_computed + (not s.in_prefill)) for s in self.running),
                          default=0)
        return out

    def _admit(self, group: SequenceGroup, out: SchedulerOutput, src: Sequence | None, plen: int) -> None:
        for seq in group.seqs:
            seq.slot = heapq.heappop(self.free_slots)
            seq.status = Status.RUNNING
        first = group.seqs[0]
        self.running.append(first)  # the other samples join when the prompt is done (fork)
        if src is not None:
            out.copies.append((src.slot, first.slot, plen))
            first.num_computed = plen
            group.prefix_source, group.prefix_len = src, plen
        out.admitted.append(group)

    def _add_chunk(self, out: SchedulerOutput, seq: Sequence, budget: int) -> int:
        length = min(seq.num_uncomputed, budget)
        end = seq.num_computed + length
        done = end == seq.length
        group = seq.group
        out.prefill.append(Chunk(seq, seq.num_computed, length, need_logits=done,
                                 all_logits=group.params.prompt_logprobs is not None))
        if done and seq.sample_index == 0 and not seq.output:
            for child in group.seqs[1:]:
                out.forks.append((seq.slot, child.slot, len(seq.prompt)))
        return length

    def _find_prefix(self, group: SequenceGroup) -> tuple[Sequence | None, int]:
        """The running sequence sharing the longest prompt prefix with `group`, if long enough."""
        if group.params.prompt_logprobs is not None:
            return None, 0  # every prompt position must be computed to score it
        limit = len(group.prompt) - 1  # the last prompt token is computed to get its logits
        best, best_len = None, self.config.min_shared_prefix - 1
        for seq in self.running:
            n = common_prefix(seq.prompt, group.prompt, limit)
            if n > best_len:
                best, best_len = seq, n
        if best is None:
            return None, 0
        return best, best_len

    def start_forked(self, group: SequenceGroup) -> None:
        """The first sample's prompt is done: the other samples start decoding from its cache."""
        first = group.seqs[0]
        for child in group.seqs[1:]:
            child.num_computed = first.num_computed
            if not child.finished:
                self.running.append(child)
