"""The generation engine: requests in, tokens out, one step at a time.

    step() = schedule (which sequences run, how many tokens each)
           -> run (one forward pass, sampling)
           -> postprocess (append tokens, stop checks, free slots, outputs)
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from workers.buckets import Buckets, compile_mode, default_buckets
from workers.config_keys import MODEL
from workers.engine import attention, cpu_kernels
from workers.engine import lean as lean_mod
from workers.engine.attention_backend import AttentionBackend, select_attention
from workers.engine.block_manager import BlockManager, CacheGroups, peak_blocks
from workers.engine.compiled import prepare
from workers.engine.kv_cache import bytes_per_block, default_budget
from workers.engine.outputs import CompletionOutput, RequestOutput
from workers.engine.params import SamplingParams
from workers.engine.runner import BaseRunner, CompatRunner, PagedRunner, attention_span, kv_dims, num_layers
from workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from workers.engine.sequence import Sequence, SequenceGroup
from workers.engine.step_result import StepResult
from workers.engine.stops import stop_token_ids
from workers.engine.text_output import RequestText
from workers.precision import precision
from workers.spec import WorkerSpec
from workers.validate import ParamError
from workers.weights.loaded_model import LoadedModel

_SCHEDULING = SchedulerConfig()  # the scheduling limits' defaults are the scheduler's own


# on CPU, the prefix cache keeps this share of the pool's blocks (at least one step's) before a
# never-used block is touched (workers.engine.block_manager)
CACHE_RESERVE_SHARE = 64


@dataclass(slots=True)
class EngineConfig:
    max_batch_size: int = _SCHEDULING.max_batch_size
    max_batch_tokens: int = _SCHEDULING.max_batch_tokens
    long_prefill_tokens: int = _SCHEDULING.long_prefill_tokens
    kv_cache_memory: int | None = None  # bytes of KV blocks; None: what max_batch_size x max_model_len can use,
    # up to a share of the memory available (kv_cache.default_budget)
    kv_block_size: int = MODEL["kv_block_size"].default  # positions per block
    prepack_weights: bool = MODEL["prepack_weights"].default  # CPU: the lean forward on packed weights
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
                   kv_block_size=m.kv_block_size, prepack_weights=m.prepack_weights,
                   num_threads=spec.threads or num_threads, compile=m.compile, compile_buckets=m.compile_buckets)

    def buckets(self) -> Buckets:
        return Buckets(self.compile_buckets or default_buckets(self.max_batch_tokens))

    def scheduler_config(self, attention_span: int | None = None, min_long_chunk: int = 1) -> SchedulerConfig:
        return SchedulerConfig(self.max_batch_size, self.max_batch_tokens, self.long_prefill_tokens, attention_span,
                               min_long_chunk)


class Engine:
    def __init__(self, lm: LoadedModel, config: EngineConfig | None = None,
                 attention: AttentionBackend | None = None):
        """`attention`: the attention kernels to run instead of those attention_backend.select
        chooses for the device (a device's own kernel, a checked one in a test)."""
        self.config = config or EngineConfig()
        self.attention_backend = attention  # the one chosen at load, once loaded (None: no paged attention)
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        self.lm = lm
        self.tokenizer = lm.tokenizer
        self.runner, blocks = self._paged_cache(lm)
        # what a position of a long prompt's attention costs, measured here on the path that serves;
        # never priced cheaper than the model's shapes say (the measurement is a 16-token chunk on
        # scratch keys, and with the shapes' estimate the AVX512-BF16 streams held half their speed)
        measure = getattr(self.runner, "measured_attention_span", None)
        measured = measure() if measure is not None else None
        self.attention_span = min(measured, attention_span(lm)) if measured else attention_span(lm)
        self.scheduler = Scheduler(self.config.scheduler_config(self.attention_span, self._min_long_chunk(lm)), blocks)
        self.compile_info = prepare(self.runner, lm, self.config.compile, self.config.buckets())
        self._seq_ids = itertools.count()
        self._generate_ids = itertools.count()
        self._seed_rng = random.Random()
        self.steps = 0
        self.last_plan: SchedulerOutput | None = None
        self.tokens_generated = 0

    def _paged_cache(self, lm: LoadedModel) -> tuple[BaseRunner, BlockManager]:
        """Size the pool from the budget: the runner that owns its tensors, and its bookkeeping."""
        cfg = self.config
        holder = attention.install(lm.model)
        # the per-sequence runner holds a DynamicCache for each sequence: blocks of one group of
        # every layer count its memory all the same
        groups = holder.groups if holder is not None else CacheGroups.from_windows([None] * num_layers(lm))
        bs = cfg.kv_block_size
        # 16-bit weights may compute in float32 (the lean forward on a CPU without bf16 arithmetic)
        self.precision = precision(lm.dtype, lm.device, holder is not None and lean_mod.applies(
            lm.model, lm.device, cfg.prepack_weights))
        compute = self.precision.compute
        per_block = bytes_per_block(groups, bs, *kv_dims(lm), compute)
        useful = cfg.max_batch_size * peak_blocks(groups, bs, cfg.max_batch_tokens, lm.max_model_len)
        budget = cfg.kv_cache_memory or default_budget(useful * per_block, lm.device)
        num_blocks = min(useful, budget // per_block)
        # a CPU pool becomes resident as its blocks are first used: reuse touched blocks first
        reserve = (max(num_blocks // CACHE_RESERVE_SHARE, peak_blocks(groups, bs, cfg.max_batch_tokens, cfg.max_batch_tokens))
                   if lm.device.type == "cpu" else None)
        blocks = BlockManager(num_blocks, bs, groups, cfg.max_batch_tokens, enable_prefix_caching=holder is not None,
                              cache_reserve=reserve)
        self.kv_bytes = num_blocks * per_block
        if holder is None:
            return CompatRunner(lm), blocks
        self.attention_backend = self.attention_backend or select_attention(lm.device, compute, kv_dims(lm)[1])
        holder.backend = self.attention_backend
        lean = lean_mod.lean_forward(lm.model, holder, lm.device, self.precision, cfg.prepack_weights)
        return PagedRunner(lm, holder, num_blocks, bs, lean, compute), blocks

    def _min_long_chunk(self, lm: LoadedModel) -> int:
        """The tokens whose query rows fill one pass of the CPU prefill kernel over the context (16
        rows of one KV head in bfloat16, 8 in float32): a chunk of fewer costs as much."""
        holder = getattr(self.runner, "holder", None)
        if holder is None or holder.backend.prefill is None:
            return 1
        heads, kv_heads = lm.model.config.get_text_config().num_attention_heads, kv_dims(lm)[0]
        return max(1, cpu_kernels.PREFILL_LANES[self.precision.compute] // max(1, heads // kv_heads))

    def stats(self) -> dict:
        """The KV cache as status and /metrics show it."""
        b = self.scheduler.blocks
        return {"kv_cache_bytes": self.kv_bytes, "block_size": b.block_size, "blocks_total": b.num_blocks,
                "blocks_used": b.num_used, "blocks_free": b.num_free, "tokens_capacity": b.max_tokens(),
                "preemptions": b.stats.preemptions, "prefix_cache_queries": b.stats.prefix_queries,
                "prefix_cache_hits": b.stats.prefix_hits, "prefix_cache_hit_rate": round(b.stats.prefix_hit_rate, 4)}

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
        ctx = self.lm.max_model_len
        if len(ids) >= ctx or len(ids) + params.max_tokens > ctx:
            raise ParamError("max_tokens", f"prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}, but the model's "
                             f"context (max_model_len) is {ctx} tokens: shorten the prompt or lower max_tokens")
        fits = self.scheduler.blocks.max_tokens()
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
        return self.scheduler.has_work()

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
        self.last_plan = None  # None after a failed schedule(): the caller can't tell what it touched
        plan = self.scheduler.schedule()
        self.last_plan = plan  # kept for inspection (tests, metrics) and to fail only this step's requests
        if plan.empty:
            return []
        forward = self.runner.forward_seconds
        result = self.runner.execute(plan)
        self.scheduler.observe(plan, self.runner.forward_seconds - forward)  # what the step's model call took
        return self._update(plan, result)

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
