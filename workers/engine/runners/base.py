"""The runner's interface: what the engine may ask of the object that owns a model's tensors.

A runner turns a SchedulerOutput into one forward pass and sampled tokens (`execute`), holds the
KV pool its CacheLayout sizes, and says what the scheduler prices with: what a position of a long
prompt's attention costs (`attention_span`) and the fewest tokens of a chunk worth a step
(`min_long_chunk`). Sampling is shared: every runner's forward returns the logits of the rows it
keeps, in plan order, and `execute` samples them here.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.engine.sampler import LogitsAdjust, PromptTokens, SampleSpec, sample, top_alternatives
from workers.engine.scheduler import Chunk, SchedulerOutput
from workers.engine.sequence import Sequence
from workers.engine.step_result import PromptScores, StepResult
from workers.weights.loaded_model import LoadedModel

if TYPE_CHECKING:
    from workers.buckets import Buckets
    from workers.engine.attention_backend import AttentionBackend
    from workers.engine.kv_cache import CacheLayout
    from workers.platform import Platform

# Where attention_span cannot be measured (workers.engine.cpu.calibrate), prefill attention is assumed
# to run at about 40% of the linears' FLOP rate (the C++ kernel's 75-90 GFLOP/s a thread against
# oneDNN's ~190 in bfloat16 on an AVX512-BF16 CPU).
ATTENTION_RATE = 0.4


def kept_rows(chunk: Chunk) -> range:
    """Chunk-relative positions whose logits are needed."""
    if chunk.all_logits:
        return range(chunk.length)
    if chunk.need_logits:
        return range(chunk.length - 1, chunk.length)
    return range(0)


def chunk_tokens(chunk: Chunk) -> list[int]:
    seq = chunk.seq
    end = chunk.start + chunk.length
    p = len(seq.prompt)
    if end <= p:
        return seq.prompt[chunk.start:end]
    return (seq.prompt + seq.output)[chunk.start:end]


@dataclass(slots=True, frozen=True, eq=False)
class Launched:
    """A step started on the device: `finish()` waits for it and gives its result (at once for a
    runner whose steps end where they start)."""

    plan: SchedulerOutput
    finish: Callable[[], StepResult]


class Runner(ABC):
    """Owns a model's tensors on its platform's device. The engine calls only what is declared here."""

    def __init__(self, lm: LoadedModel, platform: Platform, layout: CacheLayout):
        self.lm = lm
        self.model = lm.model
        self.platform = platform
        self.layout = layout  # the KV pool: the engine's block manager counts these blocks
        self.forward_seconds = 0.0  # time inside forward passes (the rest of a step is bookkeeping)
        # `deterministic`: the batch-invariant kernel set, chosen by the platform before this was built
        self.batch_invariant = platform.deterministic
        self._prompt_tokens: dict[int, PromptTokens] = {}  # by sequence id, for a repetition penalty

    @property
    def backend(self) -> AttentionBackend | None:
        """The paged attention kernels it runs (None: the model's own attention)."""
        return None

    @abstractmethod
    def _forward(self, decode: list[Sequence], chunks: list[Chunk]) -> torch.Tensor:
        """Logits of the kept rows, in plan order: decode sequences, then each chunk's kept rows."""

    def release(self, seq: Sequence) -> None:
        """A sequence gave its blocks back (finished, aborted or preempted); drop anything held for it."""
        self._prompt_tokens.pop(seq.seq_id, None)

    def new_blocks(self, blocks: list[int]) -> None:  # noqa: B027 - the per-sequence runner has no pool
        """Blocks handed to sequences this step, before anything is written to them."""

    def attention_span(self) -> int:
        """Positions of context whose attention costs about what one token's linears do: measured
        where the runner can (never priced cheaper than the model's shapes say: the measurement is
        a 16-token chunk on scratch keys, and with the shapes' estimate the AVX512-BF16 streams held
        half their speed), else estimated from the shapes."""
        estimate = estimated_attention_span(self.lm)
        measured = self.measured_attention_span()
        return min(measured, estimate) if measured else estimate

    def measured_attention_span(self) -> int | None:
        """attention_span measured on this machine on the path that serves; None: not measured."""
        return None

    def pick_kernels(self, max_rows: int) -> dict[str, str]:
        """Choose the kernels whose speed depends on the step's rows by measuring them here, for steps
        of up to `max_rows` rows; returns the choice by what it applies to (empty: nothing to choose)."""
        return {}

    def min_long_chunk(self) -> int:
        """The fewest tokens of a long prompt's chunk worth a step beside the streams."""
        return 1

    def compile_refusal(self) -> str | None:
        """Why this runner does not run compiled (None: it can, through enable_compile)."""
        return f"{type(self.model).__name__} does not take the packed slot path (its attention is its own)"

    def enable_compile(self, buckets: Buckets) -> None:
        """Run compiled from now on (only where compile_refusal gives no reason against it)."""
        raise RuntimeError(f"{type(self).__name__} does not run compiled: {self.compile_refusal()}")

    def warm_up(self) -> None:  # noqa: B027 - nothing to build ahead for an eager runner
        """Build what the first steps would otherwise build (compiled graphs of every bucket)."""

    def capture_graphs(self, max_rows: int) -> None:  # noqa: B027 - a device without graphs captures nothing
        """Capture the device graphs its steps replay (steps of up to `max_rows` tokens), before the
        first request."""

    def launch(self, plan: SchedulerOutput, ahead_of: SchedulerOutput | None = None) -> Launched:
        """Start the step `plan` planned. `ahead_of`: the plan of the step still running, whose
        sampled tokens are this step's inputs (only where can_run_ahead said so)."""
        result = self.execute(plan)
        return Launched(plan, lambda: result)

    def can_run_ahead(self, plan: SchedulerOutput) -> bool:
        """Whether the next step may start before this one's tokens reach the host: where the
        device runs asynchronously, the host then plans and fills step n+1 while step n runs."""
        return False

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        for seq in plan.preempted:
            self.release(seq)
        self.new_blocks(plan.new_blocks)
        t0 = time.perf_counter()
        logits = self._forward(plan.decode, plan.prefill)
        seconds = time.perf_counter() - t0
        self.forward_seconds += seconds
        result = self._sample(plan.decode, plan.prefill, logits)
        result.forward_seconds = seconds
        return result

    def _sample(self, decode: list[Sequence], chunks: list[Chunk], logits: torch.Tensor) -> StepResult:
        specs: list[SampleSpec] = []
        owners: list[Sequence] = []

        def want(seq: Sequence, row: int) -> None:
            p = seq.group.params
            adjust = None
            if p.adjusts_logits:
                held = seq.group.stop_ids if len(seq.output) < p.min_tokens else frozenset()
                prompt = None
                if p.repetition_penalty != 1.0:
                    prompt = self._prompt_tokens.get(seq.seq_id)
                    if prompt is None:
                        prompt = self._prompt_tokens[seq.seq_id] = PromptTokens.of(seq.prompt, logits.device)
                adjust = LogitsAdjust(p.logit_bias, held, p.repetition_penalty, p.frequency_penalty,
                                      p.presence_penalty, prompt, seq.output)
            specs.append(SampleSpec(row, p.temperature, p.top_k, p.top_p, seq.group.seed, seq.sample_index,
                                    len(seq.output), p.logprobs, p.wants_logprobs, adjust))
            owners.append(seq)

        for i, seq in enumerate(decode):
            want(seq, i)
        result = StepResult()
        row = len(decode)
        for chunk in chunks:
            kept = kept_rows(chunk)
            if chunk.all_logits and kept:
                result.prompt_scores.append(self._score_prompt(chunk, logits[row: row + len(kept)]))
            if chunk.need_logits and chunk.seq.group.params.max_tokens > 0:
                want(chunk.seq, row + len(kept) - 1)
            row += len(kept)
        tokens, chosen, tops = sample(logits, specs, row_by_row=self.batch_invariant)
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


def kv_dims(lm: LoadedModel) -> tuple[int, int, int]:
    """(kv heads, key head dim, value head dim) of the model's attention layers."""
    cfg = lm.model.config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return kv_heads, head_dim, head_dim


def num_layers(lm: LoadedModel) -> int:
    return lm.model.config.get_text_config().num_hidden_layers


def estimated_attention_span(lm: LoadedModel) -> int:
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
