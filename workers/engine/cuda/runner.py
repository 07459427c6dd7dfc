"""The CUDA runner: a decode step is one CUDA graph.

Where its platform runs the lean forward (the Llama family and Gemma 3, every layer in one cache
group), the runner keeps persistent input buffers sized to its largest decode bucket (1, 2, 4, ...
up to max_batch_size) and, for each bucket, the whole decode step (embedding, every layer with
its KV write and paged attention, the final norm, the LM head and sampling:
workers.engine.cuda.lean, workers.engine.cuda.sampler) captured once as a CUDA graph, twice in fact: a step whose rows are
all greedy replays the graph that takes the argmax, and sorts nothing. A decode step is then one
host-to-device copy of every input (one pinned buffer), a replay, and one device-to-host copy of
the sampled tokens. Rows past the batch are padding: token 0 at position 0, its KV written to a
reserved dummy block past the pool's, attending nothing (length 0), sampled greedily and dropped.

Where graphs run, the host overlaps the device: while step n runs, the engine plans step n+1
(Scheduler.schedule_ahead: the same sequences one position further) and the runner launches it,
its input tokens taken on the device from step n's sampled tokens (the `source` field); step n's
tokens are then read and applied while step n+1 runs. Two pinned host twins of the inputs take
turns, so filling one never races the copies of the other.

Steps with prompt chunks (prefill, and chunks beside decode rows) are graphs too, one a bucket of
tokens (workers.engine.cuda.mixed_steps), leaving the kept rows' logits to the host sampler; one
that keeps more rows than a step has sequences (a prompt's scores) runs the same forward eagerly.
Decode rows that ask for log-probabilities replay the decode graph and sample on the host from its
logits. Models without the lean forward keep transformers' modules, compiled with piecewise CUDA
graphs (PagedRunner).

Off a GPU the same step functions run eagerly with the reference paged ops
(workers.engine.cuda.ops): tests/test_cuda_runner.py runs them on the CPU. The decode graphs ran
on an H100 and an H200; the prompt steps' graphs are not yet run on a GPU (docs/operations.md).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.engine import attention
from workers.engine.attention_backend import TORCH
from workers.engine.cuda import int4_rows
from workers.engine.cuda.int4pack import refusal as int4pack_refusal
from workers.engine.cuda.lean import DeviceLean, DeviceStep, device_lean
from workers.engine.cuda.mixed_steps import StepBuffers, fill_tables, step_layout, token_buckets
from workers.engine.cuda.ops import PagedOps, select_ops
from workers.engine.cuda.sampler import SamplingRows, sample_tokens
from workers.engine.cuda.timing import Timer, cuda_timer
from workers.engine.lean_parts import held_blocks, keep_blocks_only
from workers.engine.runners.base import Launched
from workers.engine.runners.paged import PagedRunner
from workers.engine.scheduler import Chunk, SchedulerOutput
from workers.engine.sequence import Sequence
from workers.engine.step_result import StepResult
from workers.lean_rules import attention_modules, layer_windows
from workers.quant.weight import INT4
from workers.weights.fused_layout import lay_out_fused
from workers.weights.gguf_blocks import gguf_blocks
from workers.weights.loaded_model import LoadedModel
from workers.weights.sources import source_gguf

if TYPE_CHECKING:
    from workers.engine.attention_backend import AttentionBackend
    from workers.engine.kv_cache import CacheLayout
    from workers.platform import Platform

GRAPHS_NOT_COMPILED = "its decode steps run as captured CUDA graphs of the lean forward"
# int64 rows of the input buffer before the block tables: ids, positions, slots, lengths, top_k, seed,
# sample index, token index, source (the row of the previous step's sampled tokens that is this
# row's input, -1: `ids`), and temperature and top_p as float64 bits
_FIELDS = ("ids", "positions", "slots", "lengths", "top_k", "seed", "sample_index", "token_index", "source",
           "temperature", "top_p")
_PADDING = (("ids", 0), ("positions", 0), ("lengths", 0), ("top_k", 0), ("seed", 0), ("sample_index", 0),
            ("token_index", 0), ("source", -1), ("temperature", 0.0), ("top_p", 1.0))


def decode_buckets(max_batch_size: int) -> list[int]:
    """Decode batch sizes with a graph each: powers of two up to max_batch_size, and it."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch_size]


class HostInputs:
    """One pinned host twin of the decode inputs, with the sampled tokens' landing place. The
    fields are numpy views: a step writes Python lists into them with no tensor made per field
    (the host's share of a decode step)."""

    def __init__(self, rows: int, table_width: int, size: int, pinned: bool):
        self.inputs = torch.zeros(size, dtype=torch.long, pin_memory=pinned)
        host = self.inputs.numpy()
        self.fields = {name: host[i * rows:(i + 1) * rows] for i, name in enumerate(_FIELDS)}
        for name in ("temperature", "top_p"):
            self.fields[name] = self.fields[name].view(np.float64)
        self.tables = host[len(_FIELDS) * rows:].reshape(rows, table_width)
        self.tokens = torch.zeros(rows, dtype=torch.long, pin_memory=pinned)


class DecodeBuffers:
    """The decode graphs' inputs and outputs, allocated once: their addresses never change. The
    inputs are one int64 buffer (one copy a step from a pinned host twin), viewed as fields. There
    are two host twins, used in turn: a step started ahead fills one while the copies of the step
    still running read and write the other."""

    def __init__(self, rows: int, table_width: int, vocab: int, logits_dtype: torch.dtype, device: torch.device):
        self.rows, self.width = rows, table_width
        size = len(_FIELDS) * rows + rows * table_width
        self.device_inputs = torch.zeros(size, dtype=torch.long, device=device)
        pinned = device.type != "cpu" and torch.cuda.is_available()
        self.hosts = (HostInputs(rows, table_width, size, pinned), HostInputs(rows, table_width, size, pinned))
        self.turn = 0
        self.fields = {name: self.device_inputs[i * rows:(i + 1) * rows] for i, name in enumerate(_FIELDS)}
        self.tables = self.device_inputs[len(_FIELDS) * rows:].view(rows, table_width)
        self.row_index = torch.arange(rows, device=device)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.logits = torch.zeros(rows, vocab, dtype=logits_dtype, device=device)

    def next_host(self) -> HostInputs:
        self.turn ^= 1
        return self.hosts[self.turn]

    def step(self, n: int) -> DeviceStep:
        """The first n rows' layout; a row whose source is a row of the last step's tokens takes
        that token as its input (a step started ahead of the last one's tokens reaching the host)."""
        f = self.fields
        source = f["source"][:n]
        ids = torch.where(source >= 0, self.tokens.index_select(0, source.clamp(min=0)), f["ids"][:n])
        return DeviceStep(ids, f["positions"][:n], f["slots"][:n], self.row_index[:n], f["lengths"][:n],
                          self.tables[:n])

    def sampling(self, n: int) -> SamplingRows:
        f = self.fields
        return SamplingRows(f["temperature"][:n].view(torch.float64).float(), f["top_k"][:n],
                            f["top_p"][:n].view(torch.float64).float(), f["seed"][:n], f["sample_index"][:n],
                            f["token_index"][:n])


@dataclass(slots=True, frozen=True)
class InFlight:
    """A decode step launched on the device: its real rows, the host twin its tokens land in, and
    the event after that copy (None off a GPU, where the step is done at launch)."""

    rows: int
    host: HostInputs
    event: torch.cuda.Event | None


class CudaRunner(PagedRunner):
    def __init__(self, lm: LoadedModel, platform: Platform, holder: attention.ContextHolder, layout: CacheLayout,
                 backend: AttentionBackend | None = None, max_batch_size: int = 64, ops: PagedOps | None = None,
                 graphs: bool | None = None, overlap: bool | None = None):
        """`backend`: the attention of transformers' modules (None: the PyTorch paths); `ops`: the
        paged kernels of the lean forward (None: what the CUDA room's chooser picks, ops.select_ops,
        batch-invariant where the platform says `deterministic`); `graphs`: capture the decode steps
        (None: on a CUDA device); `overlap`: start a decode step before the last one's tokens reach
        the host (None: where graphs run and tokens are sampled on the device)."""
        lean = platform.lean
        # the dummy block that padded rows write to lies past the pool the scheduler counts
        super().__init__(lm, platform, holder, layout, backend or TORCH, max_batch_size,
                         extra_blocks=1 if lean else 0)
        self.ops = ops or select_ops(lm.device, platform.deterministic)
        self.device_lean: DeviceLean | None = None
        self.overlap = False
        prec = platform.precision
        built = held_blocks(lm, prec, lean)
        if not lean:
            return
        if len(layout.groups.layers) > 1:
            raise ValueError("the device's lean forward takes every layer in one cache group (CacheGroups.as_one)")
        self.dummy = layout.num_blocks
        self.width = -(-lm.max_model_len // layout.block_size)
        path = source_gguf(lm.source) if prec.quantized and built is None else None
        own = not (lm.weights is not None and lm.weights.shared)
        if own:
            # weights of its own: their q/k/v and gate/up laid out side by side where they are, so
            # the lean forward holds no fused copy beside them (an owner's come laid out so)
            if lay_out_fused(lm.model) and lm.device.type == "cuda":
                torch.cuda.empty_cache()  # the weights' former places
        # every layer in the cache's one group (the engine gives a model of several windows one
        # group), each attending its own window
        self.device_lean = device_lean(lm.model, self.ops, {i: p for i, (_, p) in self.cache.position.items()},
                                       layer_windows(lm.model, attention_modules(lm.model)), lm.max_model_len, prec,
                                       gguf_blocks(path, lm.model) if path else None, built, fused_own=own)
        # the 16-bit weights its blocks serve are read no more: a model of its own lets them go (an
        # owner's copies never had them: the owner let them go before it exported the rest)
        if keep_blocks_only(lm, prec, self.device_lean.quantized_weights()) and lm.device.type == "cuda":
            torch.cuda.empty_cache()
        self.buckets = decode_buckets(max_batch_size)
        self.buffers = DecodeBuffers(self.buckets[-1], self.width, lm.vocab_size, lm.dtype, lm.device)
        self.graphs_on = lm.device.type == "cuda" if graphs is None else graphs
        self.overlap = self.graphs_on if overlap is None else overlap
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}  # (bucket, all greedy) -> graph
        self.step_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # tokens -> graph of a step with prompt chunks
        self.steps: StepBuffers | None = None  # their buffers (capture_graphs)
        self.token_buckets: list[int] = []
        self.capture_seconds = 0.0
        # decode steps; their time filling the inputs (the host), launching them, and waiting for
        # their tokens (what the device took past the host's work in the meantime): bench/gpu.py
        # reports the shares
        self.decode_steps, self.fill_seconds, self.launch_seconds, self.wait_seconds = 0, 0.0, 0.0, 0.0

    def pick_kernels(self, max_rows: int, timer: Timer = cuda_timer) -> dict[str, str]:
        """With the Triton kernels, measured here on every distinct linear shape (`timer`: on the GPU,
        CUDA events), for the graphs captured after to take in:
        - weight-only blocks: the row kernel's shape (workers.engine.cuda.tile_choice);
        - under `deterministic`, the dense linears' tiles;
        - in bfloat16 and not `deterministic`: up to how many rows each int4 shape's calls go to
          torch's tinygemm instead (workers.engine.cuda.int4_rows), at the decode buckets and on up
          to `max_rows`."""
        lean = self.device_lean
        if lean is None or not self.ops.name.startswith("triton"):
            return {}
        from workers.engine.cuda import tile_choice  # the Triton kernels' modules: where they run

        invariant = self.ops.invariant
        gemv_rows = tile_choice.ANY_ROWS if invariant else tile_choice.FEW_ROWS
        gemv, tiles = {}, {}
        for lin in lean.linears():
            q = lin.quant
            if q is not None and (q.kind, q.out_features, q.in_features) not in gemv:
                gemv[q.kind, q.out_features, q.in_features] = tile_choice.gemv_shape(
                    q, self.ops.qlinear, self.lm.dtype, gemv_rows, timer)
            elif q is None and invariant and tuple(lin.weight.shape) not in tiles:
                tiles[tuple(lin.weight.shape)] = tile_choice.dense_tiles(lin.weight, self.ops.linear,
                                                                         tile_choice.ANY_ROWS, timer)
        lean.set_shapes(tiles, gemv)
        notes = {f"{kind} {n}x{k}": shape.name for (kind, n, k), shape in gemv.items()}
        notes.update({f"dense {n}x{k}": shape.name for (n, k), shape in tiles.items()})
        if invariant or self.lm.dtype != torch.bfloat16:
            return notes
        shapes = {}
        for lin in lean.linears():
            if lin.quant is not None and int4pack_refusal(lin.quant, torch.bfloat16) is None:
                shapes.setdefault((lin.quant.out_features, lin.quant.in_features), lin)
        buckets = int4_rows.row_buckets(self.buckets, max_rows)
        rows = {shape: int4_rows.measure(lin.quant, lin.qlinear, buckets, timer)[0] for shape, lin in shapes.items()}
        lean.pack_int4(rows)

        def note(r: int) -> str:
            if r >= buckets[-1]:
                return f"torch's tinygemm at every step (1 to {r} rows measured)"
            return f"torch's tinygemm up to {r} rows, Triton from {r + 1}" if r else "Triton (tinygemm measured slower)"

        for (n, k), r in rows.items():
            notes[f"{INT4} {n}x{k}"] = f"{note(r)}; Triton's {notes[f'{INT4} {n}x{k}']}"
        return notes

    def compile_refusal(self) -> str | None:
        return GRAPHS_NOT_COMPILED if self.device_lean is not None else None

    def bucket(self, n: int) -> int | None:
        """The smallest decode bucket that holds n rows (None: more than the largest)."""
        return next((b for b in self.buckets if b >= n), None) if self.device_lean is not None else None

    # --- the decode graph -------------------------------------------------------------------------
    def _decode_body(self, n: int, greedy: bool = False) -> None:
        """The whole decode step of n (bucket) rows, from the input buffers to the sampled tokens.
        `greedy`: every row is (padding is), so the tokens are the logits' argmax: no sort."""
        buf = self.buffers
        logits = self.device_lean.forward(buf.step(n), (self.cache.keys, self.cache.values), decode=True)
        buf.logits[:n].copy_(logits)
        buf.tokens[:n].copy_(torch.argmax(logits, dim=-1) if greedy else sample_tokens(logits, buf.sampling(n)))

    def _step_body(self, n: int) -> None:
        """A step with prompt chunks of n (bucket) tokens, from the step buffers to the kept rows'
        logits (workers.engine.cuda.mixed_steps)."""
        steps = self.steps
        logits = self.device_lean.forward(steps.step(n), (self.cache.keys, self.cache.values), steps.keep)
        steps.logits.copy_(logits)

    @torch.inference_mode()
    def capture_graphs(self, max_rows: int) -> None:
        """The buffers of the steps with prompt chunks (up to `max_rows` tokens), and where graphs
        run, every decode bucket's graphs and every token bucket's graph, captured now (padded rows
        only: they write the dummy block)."""
        if self.device_lean is None:
            return
        self.token_buckets = token_buckets(max_rows)
        self.steps = StepBuffers(self.token_buckets[-1], self.buckets[-1], self.width, self.lm.vocab_size,
                                 self.lm.dtype, self.lm.device)
        if not self.graphs_on:
            return
        t = time.perf_counter()
        host = self.buffers.next_host()
        self._fill(host, [], self.buckets[-1])
        self.buffers.device_inputs.copy_(host.inputs)
        self.steps.fill([], [], self.token_buckets[-1], self.dummy, self.block_size)
        self.steps.copy_in()
        # the largest steps first (a prompt step's tokens outnumber a decode step's rows): the
        # smaller ones reuse their memory pool
        bodies = [*((functools.partial(self._step_body, n), n) for n in reversed(self.token_buckets)),
                  *((functools.partial(self._decode_body, b, greedy), (b, greedy))
                    for b in reversed(self.buckets) for greedy in (True, False))]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for body, _ in bodies:  # warm-up runs: kernels compiled, allocator settled, outside capture
                body()
        torch.cuda.current_stream().wait_stream(stream)
        pool = None
        for body, key in bodies:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                body()
            pool = g.pool()
            (self.step_graphs if isinstance(key, int) else self.graphs)[key] = g
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t

    def _fill(self, host: HostInputs, seqs: list[Sequence], rows: int, ahead: bool = False) -> None:
        """The host buffer for a decode step of `seqs`, padded to `rows`. `ahead`: the step runs
        before the last one's tokens are known; each sequence is one position further and row r
        takes row r of the last step's tokens as its input (Scheduler.schedule_ahead keeps the order)."""
        bs = self.block_size
        f = host.fields
        n = len(seqs)
        step = 1 if ahead else 0
        pos = [s.num_computed + step for s in seqs]
        params = [s.group.params for s in seqs]
        tab = host.tables
        fill_tables(tab[:rows], seqs, self.dummy)
        if ahead:
            f["ids"][:n] = 0
            f["source"][:n] = range(n)
        else:
            f["ids"][:n] = [s.token_at(p) for s, p in zip(seqs, pos)]
            f["source"][:n] = -1
        f["positions"][:n] = pos
        f["slots"][:n] = [int(tab[r, p // bs]) * bs + p % bs for r, p in enumerate(pos)]
        f["lengths"][:n] = [p + 1 for p in pos]
        f["top_k"][:n] = [p.top_k for p in params]
        f["seed"][:n] = [s.group.seed for s in seqs]
        f["sample_index"][:n] = [s.sample_index for s in seqs]
        f["token_index"][:n] = [len(s.output) + step for s in seqs]
        f["temperature"][:n] = [p.temperature for p in params]
        f["top_p"][:n] = [p.top_p for p in params]
        # padded rows: token 0 at position 0 into the dummy block, attending nothing, greedy
        for name, value in _PADDING:
            f[name][n:rows] = value
        f["slots"][n:rows] = self.dummy * bs

    def _start_decode(self, seqs: list[Sequence], ahead: bool = False) -> InFlight:
        """Launch a decode step of `seqs` as its bucket's graph (or the same body eagerly): one copy
        in, the replay, one copy of the sampled tokens out, and an event after it."""
        n = self.bucket(len(seqs))
        t0 = time.perf_counter()
        buf = self.buffers
        host = buf.next_host()
        self._fill(host, seqs, n, ahead)
        t1 = time.perf_counter()
        buf.device_inputs.copy_(host.inputs, non_blocking=True)  # the step's one copy in
        greedy = all(s.group.params.temperature == 0 for s in seqs)
        if (n, greedy) in self.graphs:
            self.graphs[n, greedy].replay()
        else:
            self._decode_body(n, greedy)
        host.tokens[:n].copy_(buf.tokens[:n], non_blocking=True)  # and its one copy out
        event = None
        if self.graphs_on:
            event = torch.cuda.Event()
            event.record()
        self.decode_steps += 1
        self.fill_seconds += t1 - t0
        self.launch_seconds += time.perf_counter() - t1
        return InFlight(len(seqs), host, event)

    def _end_decode(self, step: InFlight) -> list[int]:
        """Wait for a launched decode step: its sampled tokens."""
        t = time.perf_counter()
        if step.event is not None:
            step.event.synchronize()
        self.wait_seconds += time.perf_counter() - t
        return step.host.tokens[: step.rows].tolist()

    def _decode_step(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[int]]:
        """A decode step of `seqs` to its end: the logits of its rows (a view of the output buffer)
        and the sampled tokens."""
        tokens = self._end_decode(self._start_decode(seqs))
        return self.buffers.logits[: len(seqs)], tokens

    def _device_tokens(self, decode: list[Sequence]) -> bool:
        """Whether the device's tokens are the step's: no row asks for log-probabilities or changes
        its logits (penalties, biases: the host does both), and under `deterministic` every row is
        greedy (an argmax is the same whatever the batch; a sampled row is drawn on the host, row by
        row)."""
        return (not any(s.group.params.wants_logprobs or s.group.params.logprobs is not None
                        or s.group.params.adjusts_logits for s in decode)
                and not (self.batch_invariant and any(s.group.params.temperature != 0 for s in decode)))

    def _graph_decode(self, plan: SchedulerOutput) -> bool:
        """A step the decode graph serves by itself: decoding only, within a bucket, every token
        sampled on the device."""
        decode = plan.decode
        return (self.device_lean is not None and not plan.prefill and bool(decode)
                and self.bucket(len(decode)) is not None and self._device_tokens(decode))

    def can_run_ahead(self, plan: SchedulerOutput) -> bool:
        return self.overlap and self._graph_decode(plan)

    def launch(self, plan: SchedulerOutput, ahead_of: SchedulerOutput | None = None) -> Launched:
        if not (self.overlap and self._graph_decode(plan)):
            return super().launch(plan)
        for seq in plan.preempted:
            self.release(seq)
        self.new_blocks(plan.new_blocks)
        t0 = time.perf_counter()
        with torch.inference_mode():
            step = self._start_decode(plan.decode, ahead=ahead_of is not None)
        launched = time.perf_counter() - t0
        self.forward_seconds += launched

        def finish() -> StepResult:
            t = time.perf_counter()
            tokens = self._end_decode(step)
            waited = time.perf_counter() - t
            self.forward_seconds += waited
            result = StepResult(forward_seconds=launched + waited)
            result.samples = [(seq, tok, None, None) for seq, tok in zip(plan.decode, tokens)]
            return result

        return Launched(plan, finish)

    # --- a step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        decode = plan.decode
        if self.device_lean is None or plan.prefill or not decode or self.bucket(len(decode)) is None:
            return super().execute(plan)
        for seq in plan.preempted:
            self.release(seq)
        self.new_blocks(plan.new_blocks)
        t0 = time.perf_counter()
        logits, tokens = self._decode_step(decode)
        seconds = time.perf_counter() - t0
        self.forward_seconds += seconds
        if not self._device_tokens(decode):
            result = self._sample(decode, [], logits)  # the host sampler (log-probabilities; row by row)
            result.forward_seconds = seconds
            return result
        result = StepResult(forward_seconds=seconds)
        result.samples = [(seq, tok, None, None) for seq, tok in zip(decode, tokens)]
        return result

    def _forward(self, decode: list[Sequence], chunks: list[Chunk]) -> torch.Tensor:
        """A step with prompt chunks, on the lean forward: its token bucket's graph (or the same body
        eagerly, off a GPU) where the step buffers hold it, else eagerly. The logits of its kept
        rows, in order."""
        if self.device_lean is None:
            return super()._forward(decode, chunks)
        steps = self.steps
        total = len(decode) + sum(c.length for c in chunks)
        n = next((b for b in self.token_buckets if b >= total), None)
        kept = None if steps is None or n is None else steps.fill(decode, chunks, n, self.dummy, self.block_size)
        if kept is None:
            return self._eager_forward(decode, chunks)
        steps.copy_in()
        if n in self.step_graphs:
            self.step_graphs[n].replay()
        else:
            self._step_body(n)
        return steps.logits[:kept]

    def _eager_forward(self, decode: list[Sequence], chunks: list[Chunk]) -> torch.Tensor:
        """Any step, eagerly, on the lean forward: one block-table row a sequence."""
        bs, dev = self.block_size, self.lm.device
        seqs = decode + [c.seq for c in chunks]
        ids, pos, rows, keep = step_layout(decode, chunks)
        table = np.empty((len(seqs), self.width), dtype=np.int64)
        fill_tables(table, seqs, self.dummy)

        def tensor(xs):
            return torch.tensor(xs, dtype=torch.long, device=dev)

        step = DeviceStep(tensor(ids), tensor(pos), tensor([int(table[r, p // bs]) * bs + p % bs for r, p in zip(rows, pos)]),
                          tensor(rows), tensor([p + 1 for p in pos]), torch.from_numpy(table).to(dev))
        return self.device_lean.forward(step, (self.cache.keys, self.cache.values), tensor(keep))


DeviceRunner = CudaRunner  # the room's runner (workers.engine.runners.ROOMS)
