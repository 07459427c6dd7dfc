"""The generation engine: requests in, tokens out, one step at a time.

    step() = schedule (which sequences run, how many tokens each)
           -> run (one forward pass, sampling)
           -> postprocess (append tokens, stop checks, free slots, outputs)
"""

from __future__ import annotations

import gc
import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from workers import kernel_notes
from workers.buckets import Buckets, compile_mode, default_buckets
from workers.config_keys import MODEL
from workers.engine import attention
from workers.engine.attention_backend import AttentionBackend
from workers.engine.block_manager import BlockManager, CacheGroups
from workers.engine.compiled import prepare
from workers.engine.kv_cache import CacheLayout
from workers.engine.outputs import CompletionOutput, RequestOutput
from workers.engine.params import SamplingParams
from workers.engine.runners import Runner, make_runner
from workers.engine.runners.base import Launched, kv_dims, num_layers
from workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from workers.engine.sequence import Sequence, SequenceGroup
from workers.engine.step_result import StepResult
from workers.engine.stops import stop_token_ids
from workers.engine.text_output import RequestText
from workers.platform import Platform, for_model
from workers.precision import Precision
from workers.spec import WorkerSpec
from workers.validate import ParamError
from workers.weights.loaded_model import LoadedModel

_SCHEDULING = SchedulerConfig()  # the scheduling limits' defaults are the scheduler's own


@dataclass(slots=True)
class EngineConfig:
    max_batch_size: int = _SCHEDULING.max_batch_size
    max_batch_tokens: int = _SCHEDULING.max_batch_tokens
    long_prefill_tokens: int = _SCHEDULING.long_prefill_tokens
    kv_cache_memory: int | None = None  # bytes of KV blocks; None: what max_batch_size x max_model_len can use,
    # up to a share of the memory available (Platform.kv_budget)
    kv_block_size: int = MODEL["kv_block_size"].default  # positions per block
    prepack_weights: bool = MODEL["prepack_weights"].default  # CPU: the lean forward on packed weights
    quantization: str = MODEL["quantization"].default  # CPU, the lean forward: weight-only int8/int4 linears
    deterministic: bool = MODEL["deterministic"].default  # batch-invariant linears and attention
    num_threads: int | None = None  # torch threads for this process; None leaves torch's default
    compile: str | bool = MODEL["compile"].default  # auto: compiled when the cache has artifacts; true: compile now
    compile_buckets: tuple[int, ...] | list[int] | None = None  # padded token counts; None: default_buckets

    def __post_init__(self) -> None:
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be a positive integer or None, got {self.num_threads!r}")
        if self.kv_cache_memory is not None and (isinstance(self.kv_cache_memory, bool)
                                                 or not isinstance(self.kv_cache_memory, int)
                                                 or self.kv_cache_memory < 1):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes or None, got {self.kv_cache_memory!r}")
        if not MODEL["kv_block_size"].check(self.kv_block_size):
            raise ValueError(f"kv_block_size must be {MODEL['kv_block_size'].valid}, got {self.kv_block_size!r}")
        if not isinstance(self.prepack_weights, bool):
            raise ValueError(f"prepack_weights must be true or false, got {self.prepack_weights!r}")
        if not MODEL["quantization"].check(self.quantization):
            raise ValueError(f"quantization must be {MODEL['quantization'].valid}, got {self.quantization!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be true or false, got {self.deterministic!r}")
        self.compile = compile_mode(self.compile)
        if self.compile_buckets is not None:
            self.compile_buckets = Buckets(tuple(self.compile_buckets)).tokens

    @classmethod
    def from_spec(cls, spec: WorkerSpec, num_threads: int | None = None) -> EngineConfig:
        """A worker's engine settings: its planned limits and KV budget, its model's settings;
        `num_threads` where the spec leaves the threads open."""
        m = spec.model
        return cls(max_batch_size=spec.batch_size, max_batch_tokens=spec.batch_tokens,
                   long_prefill_tokens=m.long_prefill_tokens, kv_cache_memory=spec.kv_bytes,
                   kv_block_size=m.kv_block_size, prepack_weights=m.prepack_weights, quantization=m.quantization,
                   deterministic=m.deterministic, num_threads=spec.threads or num_threads, compile=m.compile,
                   compile_buckets=m.compile_buckets)

    def buckets(self) -> Buckets:
        return Buckets(self.compile_buckets or default_buckets(self.max_batch_tokens))

    def scheduler_config(self, attention_span: int | None = None, min_long_chunk: int = 1) -> SchedulerConfig:
        return SchedulerConfig(self.max_batch_size, self.max_batch_tokens, self.long_prefill_tokens, attention_span,
                               min_long_chunk)


class Engine:
    def __init__(self, lm: LoadedModel, config: EngineConfig | None = None,
                 attention: AttentionBackend | None = None, platform: Platform | None = None):
        """`attention`: the attention kernels to run instead of those the device's room chooses (a
        checked one in a test); `platform`: the device's decisions, made here from the model and
        the config when not given (workers.platform.for_model), `deterministic` among them."""
        self.config = cfg = config or EngineConfig()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.lm = lm
        self.tokenizer = lm.tokenizer
        # everything that depends on the device, decided once (workers.platform)
        self.platform: Platform = platform or for_model(lm, cfg.prepack_weights, cfg.quantization, cfg.deterministic)
        if self.platform.deterministic != cfg.deterministic:
            raise ValueError(f"the platform given was decided for deterministic: {self.platform.deterministic}, "
                             f"the config asks for {cfg.deterministic}")
        self.runner = self._runner(lm, attention)
        layout = self.runner.layout
        blocks = BlockManager(layout.num_blocks, layout.block_size, layout.groups, cfg.max_batch_tokens,
                              enable_prefix_caching=layout.prefix_caching, cache_reserve=layout.reserve)
        # the kernels picked by the step's rows, measured at load where the runner has a choice
        max_rows = max(cfg.max_batch_tokens, cfg.max_batch_size)
        self.kernels: dict[str, str] = self.runner.pick_kernels(max_rows)
        if self.kernels:  # for validate_only to show before the next deployment's workers start
            kernel_notes.remember(kernel_notes.note_key(lm.source, self.precision, torch.get_num_threads(), max_rows),
                                  self.kernels)
        # what a position of a long prompt's attention costs, measured at load where the runner can
        self.attention_span = self.runner.attention_span()
        self.scheduler = Scheduler(cfg.scheduler_config(self.attention_span, self.runner.min_long_chunk()), blocks)
        self.compile_info = prepare(self.runner, lm, cfg.compile, cfg.buckets())
        self.runner.capture_graphs(max_rows)
        self._seq_ids = itertools.count()
        self._generate_ids = itertools.count()
        self._seed_rng = random.Random()
        self.steps = 0
        self.steps_ahead = 0  # steps started before the previous step's tokens were read
        self._ahead: Launched | None = None
        self.last_plan: SchedulerOutput | None = None
        self.tokens_generated = 0

    def _runner(self, lm: LoadedModel, backend: AttentionBackend | None) -> Runner:
        """The platform's runner over a pool sized from the budget. A model on transformers'
        attention interface gets the paged cache's attention (its holder); another runs the compat
        runner, whose per-sequence caches count blocks of one group of every layer all the same."""
        cfg = self.config
        holder = attention.install(lm.model)
        groups = holder.groups if holder is not None else CacheGroups.from_windows([None] * num_layers(lm))
        if self.platform.lean and self.platform.lean_one_group:
            # every layer's keys and values in one group, held for the whole context: each layer then
            # attends its own window in it (Gemma 3's sliding layers keep what they no longer read)
            groups = groups if len(groups.layers) == 1 else groups.as_one()
        layout = CacheLayout.sized(self.platform, groups, kv_dims(lm), cfg.kv_block_size, cfg.kv_cache_memory,
                                   cfg.max_batch_size, cfg.max_batch_tokens, lm.max_model_len,
                                   prefix_caching=holder is not None)
        return make_runner(self.platform, lm, holder, layout, backend, cfg.max_batch_size)

    @property
    def precision(self) -> Precision:
        return self.platform.precision

    @property
    def attention_backend(self) -> AttentionBackend | None:
        """The paged attention kernels chosen at load (None: the model's own attention)."""
        return self.runner.backend

    @property
    def kv_bytes(self) -> int:
        return self.runner.layout.nbytes

    def close(self) -> None:
        """Let go of the model's tensors now, not at the interpreter's exit: weights attached from a
        weight owner (CUDA IPC) go back to it while it still runs (workers.weights.owner)."""
        self._drop_ahead()
        link = self.lm.owner_link if self.lm is not None else None
        self.runner = self.scheduler = None
        self.lm = self.tokenizer = None
        gc.collect()
        self.platform.release()
        if link is not None:
            link.close()  # the owner may stop now

    def stats(self) -> dict:
        """The KV cache as status and /metrics show it, and the tokens generated so far."""
        b = self.scheduler.blocks
        return {"kv_cache_bytes": self.kv_bytes, "block_size": b.block_size, "blocks_total": b.num_blocks,
                "blocks_used": b.num_used, "blocks_free": b.num_free, "tokens_capacity": b.max_tokens(self.lm.max_model_len),
                "preemptions": b.stats.preemptions, "prefix_cache_queries": b.stats.prefix_queries,
                "prefix_cache_hits": b.stats.prefix_hits, "prefix_cache_hit_rate": round(b.stats.prefix_hit_rate, 4),
                "tokens_generated": self.tokens_generated}

    # --- requests -----------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ParamError("prompt", "prompt must not be empty")
            return list(self.tokenizer(prompt).input_ids)
        if not isinstance(prompt, (list, tuple)):
            raise ParamError("prompt", f"prompt must be text or a list of token IDs, got {type(prompt).__name__}")
        vocab = self.lm.vocab_size
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ParamError("prompt", f"prompt token ID {t!r} at position {i} is not in the vocabulary [0, {vocab})")
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queue a request. Raises ValueError naming the bad parameter; nothing is queued then."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.scheduler.groups:
            raise ValueError(f"request_id {request_id!r} is already running")
        if params.num_samples > self.config.max_batch_size:
            name = "best_of" if params.best_of else "n"
            raise ParamError(name, f"{name} ({params.num_samples}) exceeds this engine's "
                             f"max_batch_size ({self.config.max_batch_size}): its samples must run together")
        ids = self.encode(prompt)
        if not ids:
            raise ParamError("prompt", "prompt must not be empty")
        if outside := [t for t in params.logit_bias if t >= self.lm.vocab_size]:
            raise ParamError("logit_bias", f"logit_bias token ID {outside[0]} is not in the vocabulary "
                             f"[0, {self.lm.vocab_size})")
        ctx = self.lm.max_model_len
        if len(ids) >= ctx or len(ids) + params.max_tokens > ctx:
            raise ParamError("max_tokens", f"prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}, but the model's "
                             f"context (max_model_len) is {ctx} tokens: shorten the prompt or lower max_tokens")
        fits = self.scheduler.blocks.max_tokens(ctx)
        if len(ids) + params.max_tokens > fits:
            raise ParamError("max_tokens", f"prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}, but this worker's "
                             f"KV cache (kv_cache_memory {self.kv_bytes / 2**20:.1f} MiB) holds {fits} tokens of one "
                             "sequence: shorten the prompt, lower max_tokens or raise kv_cache_memory")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        group = SequenceGroup(request_id, ids, params, seed,
                              prompt_text=prompt if isinstance(prompt, str) else None,
                              stop_ids=stop_token_ids(params, self.lm.eos_token_ids))
        group.seqs = [Sequence(next(self._seq_ids), group, i, ids) for i in range(params.num_samples)]
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(ids)
            group.prompt_top_logprobs = [None] * len(ids)
        self.scheduler.add(group)

    def abort(self, request_id: str) -> bool:
        group = self.scheduler.groups.get(request_id)
        if group is None:
            return False
        for seq in group.seqs:
            self.runner.release(seq)
        self.scheduler.abort(request_id)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._ahead is not None

    def request_ids(self) -> list[str]:
        """The requests added and not yet finished or aborted."""
        return list(self.scheduler.groups)

    def last_step_requests(self) -> set[str]:
        """The requests the last step touched (what a failed step may have left half-done): every
        request when it failed before its plan was made."""
        plan = self.last_plan
        return plan.request_ids() if plan is not None else set(self.scheduler.groups)

    # --- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step's outputs. Where the runner can run ahead (a device that computes while the host
        goes on), the next step is planned and started before this one's tokens are read, so the
        host's bookkeeping of step n overlaps the device's step n+1 (Scheduler.schedule_ahead)."""
        running, self._ahead = self._ahead, None
        self.last_plan = running.plan if running is not None else None  # None: a failed schedule() touched all
        try:
            if running is None:
                plan = self.scheduler.schedule()
                self.last_plan = plan  # kept for inspection (tests, metrics) and to fail only this step's requests
                if plan.empty:
                    return []
                running = self.runner.launch(plan)
            plan = running.plan
            if self.runner.can_run_ahead(plan):
                ahead = self.scheduler.schedule_ahead(plan, self.lm.max_model_len)
                if ahead is not None:
                    self._ahead = self.runner.launch(ahead, ahead_of=plan)
                    self.steps_ahead += 1
            result = running.finish()
        except BaseException:
            self._drop_ahead()
            raise
        self.scheduler.observe(plan, result.forward_seconds)  # what the step's model call took
        outputs = self._update(plan, result)
        if self._ahead is not None and all(s.finished for s in self._ahead.plan.decode):
            self._drop_ahead()  # every row of it ended on this step's tokens
        return outputs

    def _drop_ahead(self) -> None:
        """Wait for a step started ahead and drop its tokens (their sequences ended or failed):
        its host buffers are free again when this returns."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            try:
                ahead.finish()
            except Exception:  # noqa: BLE001 - the step that failed is reported; this one's rows are gone
                pass

    def _update(self, plan: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        self.steps += 1
        update = self.scheduler.update_from_output(plan, result, self.lm.max_model_len)
        for seq in update.finished:
            self.runner.release(seq)
        self.tokens_generated += update.tokens
        return [self._output(g, update.new_tokens) for g in update.touched.values()]

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.runner.release(seq)
        self.scheduler.finish(seq, reason)

    def finish_sample(self, request_id: str, index: int) -> bool:
        """End one sample of a running request: a stop string matched its text (text_output). Its
        tokens past the match are dropped there; here its blocks are freed."""
        group = self.scheduler.groups.get(request_id)
        if group is None or not 0 <= index < len(group.seqs) or group.seqs[index].finished:
            return False
        self._finish(group.seqs[index], "stop")
        return True

    def _output(self, group: SequenceGroup, new_tokens: dict[int, list[int]]) -> RequestOutput:
        """Tokens only: text, stop strings and best_of's choice are text_output's, off this thread.
        While a request runs, its output holds the engine's own lists, which only ever grow (read
        them up to their length at the step, as the worker and generate() do): copying every list
        of every running request on every step made a long generation quadratic. A finished
        output is a copy, with every sample (best_of's too)."""
        finished = group.finished
        p = group.params
        own = list if finished else (lambda x: x)  # a finished output copies; a running one shares
        outs = [
            CompletionOutput(
                index=s.sample_index,
                token_ids=own(s.output),
                text="",
                logprobs=own(s.logprobs) if p.wants_logprobs else None,
                top_logprobs=own(s.top_logprobs) if p.logprobs is not None else None,
                finish_reason=s.finish_reason,
                new_token_ids=new_tokens.get(s.seq_id, []),
            )
            for s in group.seqs
        ]
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt_text, prompt_token_ids=group.prompt, outputs=outs,
            finished=finished,
            prompt_logprobs=own(group.prompt_logprobs) if p.prompt_logprobs is not None else None,
            prompt_top_logprobs=own(group.prompt_top_logprobs) if p.prompt_logprobs is not None else None,
        )

    # --- offline convenience ---------------------------------------------------------------------
    def generate(self, prompts: Iterable[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion, as vLLM's LLM.generate: one RequestOutput per prompt, in order,
        with its text (stop strings applied, best_of's n best chosen). Text is made between steps
        here; a worker makes it on another thread."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} params for {len(prompts)} prompts")
        base = f"gen-{next(self._generate_ids)}-"
        ids = [f"{base}{i}" for i in range(len(prompts))]
        texts: dict[str, RequestText] = {}
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
            texts[rid] = RequestText(self.tokenizer, self.scheduler.groups[rid].params, self.lm.eos_token_ids)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                text = texts[out.request_id]
                for index in text.update(out):
                    self.finish_sample(out.request_id, index)
                if out.request_id not in final and text.done(out):
                    final[out.request_id] = text.final(out)
                    self.abort(out.request_id)  # ended by stop strings: nothing left to run
        return [final[r] for r in ids]
