"""Decides which sequences run next and how many tokens each computes. Never touches tensors.

Each step, oldest first:
1. every running sequence that is decoding computes one token. When the pool has no block for
   it, the newest running sequence is preempted: its blocks are freed and it is queued again,
   first in line, to be recomputed (its prefix mostly from the prefix cache);
2. prompts being prefilled continue in chunks, as far as the step's tokens and the free blocks go;
   beside decoding sequences, a long prompt's chunk costs about `long_prefill_tokens` tokens, or
   half the decode batch if that is more, where a token at position p counts 1 + p/attention_span
   (its attention over its context grows with p): a near-context prompt slows the streams by a
   bounded factor at every position instead of stalling them. The steps' measured times correct
   that price on the machine that serves (workers.engine.pace);
3. preempted sequences, then waiting requests, first come first served, start while sequences
   (max_batch_size), the step's tokens (max_batch_tokens) and the blocks of their whole prompt
   allow. A prompt starts from the longest prefix of cached blocks.

A request's samples share one prefill: sample 0 computes the prompt; when it is done, the other
samples start from its cached blocks and compute only the part of the last block it left.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.config_keys import MODEL
from workers.engine.block_manager import BlockManager
from workers.engine.pace import LongChunkPace
from workers.engine.sequence import Sequence, SequenceGroup, Status
from workers.engine.step_result import StepResult, StepUpdate
from workers.engine.stops import finish_reason


@dataclass(slots=True)
class SchedulerConfig:
    max_batch_size: int = MODEL["max_batch_size"].default  # sequences running at once
    max_batch_tokens: int = MODEL["max_batch_tokens"].default  # tokens computed in one step (decode + prefill)
    # while sequences decode, a prompt longer than max_batch_tokens computes at most max(this, half
    # the decoding sequences) tokens a step: it goes at the pace of the streams beside it
    long_prefill_tokens: int = MODEL["long_prefill_tokens"].default
    # context positions whose attention costs about what a token's linears do (the engine derives it
    # from the model); None: a long prompt's chunk counts its tokens only
    attention_span: int | None = None
    # the fewest tokens a long prompt's chunk shrinks to: the attention kernel's pass over the
    # context costs as much for fewer (the engine derives it from the kernel and the model)
    min_long_chunk: int = 1

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_tokens", "long_prefill_tokens", "min_long_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.attention_span is not None and (isinstance(self.attention_span, bool)
                                                or not isinstance(self.attention_span, int) or self.attention_span < 1):
            raise ValueError(f"attention_span must be a positive integer or None, got {self.attention_span!r}")
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
    admitted: list[SequenceGroup] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # freed this step, queued to be recomputed
    new_blocks: list[int] = field(default_factory=list)  # handed out this step: the runner zeroes them
    # a long prompt's chunk beside decoding sequences (see the module): its tokens, and the tokens a
    # step the pace granted it (a fraction where chunks run on some steps only)
    long_tokens: int = 0
    long_want: float = 0.0

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


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[SequenceGroup] = deque()
        self.resume: deque[Sequence] = deque()  # preempted or forked samples, before any new request
        self.running: list[Sequence] = []  # sequences computing tokens, oldest first
        self.groups: dict[str, SequenceGroup] = {}
        self.num_seqs = 0  # admitted and unfinished, including samples waiting for their prompt
        # a few blocks kept free at admission, so that a start does not preempt at the next step
        self.watermark = max(1, blocks.num_blocks // 100)
        self.pace = LongChunkPace()

    # --- queue management -----------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        if group.params.num_samples > self.config.max_batch_size:
            raise ValueError(
                f"n/best_of ({group.params.num_samples}) exceeds max_batch_size ({self.config.max_batch_size})")
        for seq in group.seqs:
            seq.blocks = self.blocks.new_seq()
        self.waiting.append(group)
        self.groups[group.request_id] = group

    def has_work(self) -> bool:
        return bool(self.waiting or self.resume or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        self._stop(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
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
                self._stop(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
        return group

    def _stop(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.num_seqs -= 1
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.resume:
            self.resume.remove(seq)
        self.blocks.free(seq.blocks)

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """The model call of the step `out` planned took `seconds`: it corrects a long chunk's price."""
        self.pace.observe(len(out.decode), out.num_tokens - len(out.decode), out.long_tokens, out.long_want, seconds)

    def computed(self, seq: Sequence) -> None:
        """After a step: offer the sequence's completed blocks to the prefix cache, and drop the
        sliding-window blocks no later query sees."""
        if seq.num_computed // self.blocks.block_size > seq.blocks.committed:
            self.blocks.commit(seq.blocks, seq.all_tokens(), seq.num_computed)
        self.blocks.trim(seq.blocks, seq.num_computed)

    def update_from_output(self, out: SchedulerOutput, result: StepResult, max_model_len: int) -> StepUpdate:
        """Apply what the step that `out` planned computed: positions advance, finished prompts start
        their other samples, new tokens are appended, and samples that reached a stop end."""
        update = StepUpdate()
        for seq in out.decode:
            if seq.finished:
                continue  # ended while a step planned ahead of its tokens ran (its row was wasted)
            seq.num_computed += 1
            self.computed(seq)
        for chunk in out.prefill:
            seq = chunk.seq
            seq.num_computed += chunk.length
            self.computed(seq)
            if seq.sample_index == 0 and seq.num_computed == len(seq.prompt) and not seq.output:
                group = seq.group
                update.touched[group.request_id] = group
                if group.params.max_tokens == 0:
                    for s in group.seqs:
                        self._end(s, "length", update)
                elif len(group.seqs) > 1:
                    self.start_samples(group)
        for ps in result.prompt_scores:
            g = ps.group
            g.prompt_logprobs[ps.first_target: ps.first_target + len(ps.logprobs)] = ps.logprobs
            g.prompt_top_logprobs[ps.first_target: ps.first_target + len(ps.top)] = ps.top
        for seq, tok, lp, top in result.samples:
            if seq.finished:
                continue
            seq.output.append(tok)
            if lp is not None:
                seq.logprobs.append(lp)
            if top is not None:
                seq.top_logprobs.append(top)
            update.new_tokens.setdefault(seq.seq_id, []).append(tok)
            update.tokens += 1
            update.touched[seq.group.request_id] = seq.group
            reason = finish_reason(seq, tok, max_model_len)
            if reason:
                self._end(seq, reason, update)
        return update

    def _end(self, seq: Sequence, reason: str, update: StepUpdate) -> None:
        self.finish(seq, reason)
        update.finished.append(seq)

    # --- the decision -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        for seq in [s for s in self.running if not s.in_prefill]:
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            while not self.blocks.allocate(seq.blocks, seq.num_computed, seq.num_computed + 1):
                if self._preempt_newest(out) is seq:
                    break
            if seq.status is Status.RUNNING:
                out.decode.append(seq)
        budget = self.config.max_batch_tokens - len(out.decode)
        while True:
            for seq in [s for s in self.running if s.in_prefill]:
                if budget <= 0:
                    break
                budget -= self._add_chunk(out, seq, budget)
            if not out.empty or len(self.running) < 2:
                break
            # prompts part-way that all wait for blocks the others hold: the newest gives way
            self._preempt_newest(out)
        while budget > 0 and self._admit_next(out):
            budget -= self._add_chunk(out, self.running[-1], budget)
        out.new_blocks = self.blocks.take_new_blocks()
        return out

    def schedule_ahead(self, out: SchedulerOutput, max_model_len: int) -> SchedulerOutput | None:
        """The next step's plan while the step `out` planned still runs, before its tokens are
        known: where `out` decodes every running sequence and nothing waits, the next step decodes
        the same sequences, in the same order, one position further (a sequence that ends on the
        token still running wastes its row). None where that does not hold or a block is short:
        the next step is planned after this one's tokens, by schedule()."""
        if out.prefill or out.preempted or self.waiting or self.resume or len(out.decode) != len(self.running):
            return None
        ahead = SchedulerOutput()
        for seq in out.decode:
            p = seq.num_computed + 1  # the position of the token that `out` samples
            if seq.finished or p + 1 > max_model_len or not self.blocks.allocate(seq.blocks, p, p + 1):
                return None  # blocks taken stay with their sequences; schedule() zeroes them
            ahead.decode.append(seq)
        ahead.new_blocks = self.blocks.take_new_blocks()
        return ahead

    def _preempt_newest(self, out: SchedulerOutput) -> Sequence:
        victim = self.running.pop()
        if victim in out.decode:
            out.decode.remove(victim)
        self.blocks.free(victim.blocks)
        victim.num_computed = 0
        victim.status = Status.WAITING
        self.num_seqs -= 1
        self.blocks.stats.preemptions += 1
        self.resume.appendleft(victim)
        out.preempted.append(victim)
        return victim

    def _add_chunk(self, out: SchedulerOutput, seq: Sequence, budget: int) -> int:
        """Schedule as much of the sequence's uncomputed tokens as the budget and the free blocks
        allow (whole blocks when the pool is short). Returns the tokens scheduled."""
        start = seq.num_computed
        if out.decode and seq.length > self.config.max_batch_tokens:
            share = max(self.config.long_prefill_tokens, len(out.decode) // 2)
            price = 1 + start / self.config.attention_span if self.config.attention_span else 1
            floor = max(1, min(share, self.config.min_long_chunk))
            tokens = self.pace.tokens(share / price, floor)
            if tokens == 0:
                return 0  # this step's share goes to the credit of a later chunk
            budget = min(budget, tokens)
            out.long_want = share * self.pace.scale / price
        length = min(seq.num_uncomputed, budget)
        while length > 0 and not self.blocks.allocate(seq.blocks, start, start + length):
            bs = self.blocks.block_size
            length = (start + length - 1) // bs * bs - start  # back to the previous block boundary
        if length <= 0:
            return 0
        if out.long_want:
            out.long_tokens = length
        done = start + length == seq.length
        scoring = seq.group.params.prompt_logprobs is not None and not seq.output and seq.sample_index == 0
        out.prefill.append(Chunk(seq, start, length, need_logits=done, all_logits=scoring))
        return length

    def _admit_next(self, out: SchedulerOutput) -> bool:
        """Start the next preempted sample or waiting request if it fits; False when none does."""
        if self.resume:
            seqs, group = [self.resume[0]], None
        elif self.waiting:
            group = self.waiting[0]
            seqs = group.seqs
        else:
            return False
        if self.num_seqs + len(seqs) > self.config.max_batch_size:
            return False
        first = seqs[0]
        tokens = first.all_tokens()
        scoring = group is not None and group.params.prompt_logprobs is not None  # every position is scored
        hit = 0 if scoring else self.blocks.match(first.blocks, tokens)
        held = self.blocks.hit_blocks(hit)
        need = max(0, self.blocks.peak_blocks(len(tokens)) - held)
        reserved = sum(max(0, self.blocks.peak_blocks(s.length) - s.blocks.held()) for s in self.running
                       if s.in_prefill)
        free_after = self.blocks.num_free - self.blocks.evictable_among(first.blocks, hit)
        if need + reserved + self.watermark > free_after and self.running:
            return False  # alone, a request that passed Engine.add_request's check always fits
        if need > free_after:
            return False
        if group is not None:
            self.waiting.popleft()
            out.admitted.append(group)
            self.num_seqs += len(seqs)
            for seq in seqs:
                seq.status = Status.RUNNING  # the other samples start when the prompt is done
        else:
            self.resume.popleft()
            self.num_seqs += 1
            first.status = Status.RUNNING
        self.blocks.stats.prefix_queries += len(tokens)
        if hit:
            self.blocks.take(first.blocks, hit)
            self.blocks.stats.prefix_hits += hit * self.blocks.block_size
        first.num_computed = hit * self.blocks.block_size
        self.running.append(first)
        return True

    def start_samples(self, group: SequenceGroup) -> None:
        """The first sample's prompt is done: the others start from its cached blocks."""
        for child in group.seqs[1:]:
            if not child.finished:
                self.resume.append(child)
                self.num_seqs -= 1  # counted again when it starts
                child.status = Status.WAITING
