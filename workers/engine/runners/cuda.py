"""The CUDA runner: a decode step is one CUDA graph.

Where its platform runs the lean forward (the Llama family, one cache group), the runner keeps
persistent input buffers sized to its largest decode bucket (1, 2, 4, ... up to max_batch_size)
and, for each bucket, the whole decode step (embedding, every layer with its KV write and paged
attention, the final norm, the LM head and sampling: workers.engine.device_lean,
workers.engine.device_sampler) captured once as a CUDA graph. A decode step is then one
host-to-device copy of every input (one pinned buffer), a replay, and one device-to-host copy of
the sampled tokens. Rows past the batch are padding: token 0 at position 0, its KV written to a
reserved dummy block past the pool's, attending nothing (length 0), sampled greedily and dropped.

Prefill and mixed steps, and decode rows that ask for log-probabilities, run the same forward
eagerly (the latter replay the graph and sample on the host from its logits). Models without the
lean forward keep transformers' modules, compiled with piecewise CUDA graphs (PagedRunner).

Off a GPU the same step function runs eagerly with the reference paged ops
(workers.engine.paged_ops): tests/test_cuda_runner.py runs it on the CPU. Not yet run on a GPU
(docs/operations.md).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.engine import attention
from workers.engine.block_manager import NO_BLOCK
from workers.engine.device_lean import DeviceLean, DeviceStep
from workers.engine.device_sampler import SamplingRows, sample_tokens
from workers.engine.paged_ops import PagedOps, select_ops
from workers.engine.runners.base import chunk_tokens, kept_rows
from workers.engine.runners.paged import PagedRunner
from workers.engine.scheduler import Chunk, SchedulerOutput
from workers.engine.sequence import Sequence
from workers.engine.step_result import StepResult
from workers.weights.loaded_model import LoadedModel

if TYPE_CHECKING:
    from workers.engine.attention_backend import AttentionBackend
    from workers.engine.kv_cache import CacheLayout
    from workers.platform import Platform

GRAPHS_NOT_COMPILED = "its decode steps run as captured CUDA graphs of the lean forward"
# int64 rows of the input buffer before the block tables: ids, positions, slots, lengths, top_k, seed,
# sample index, token index, and temperature and top_p as float64 bits
_FIELDS = ("ids", "positions", "slots", "lengths", "top_k", "seed", "sample_index", "token_index", "temperature",
           "top_p")


def decode_buckets(max_batch_size: int) -> list[int]:
    """Decode batch sizes with a graph each: powers of two up to max_batch_size, and it."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return [*sizes, max_batch_size]


class DecodeBuffers:
    """The decode graphs' inputs and outputs, allocated once: their addresses never change. The
    inputs are one int64 buffer (one copy a step from its pinned host twin), viewed as fields."""

    def __init__(self, rows: int, table_width: int, vocab: int, logits_dtype: torch.dtype, device: torch.device):
        self.rows, self.width = rows, table_width
        size = len(_FIELDS) * rows + rows * table_width
        self.device_inputs = torch.zeros(size, dtype=torch.long, device=device)
        pinned = device.type != "cpu" and torch.cuda.is_available()
        self.host_inputs = torch.zeros(size, dtype=torch.long, pin_memory=pinned)
        self.fields = {name: self.device_inputs[i * rows:(i + 1) * rows] for i, name in enumerate(_FIELDS)}
        self.tables = self.device_inputs[len(_FIELDS) * rows:].view(rows, table_width)
        # the host side as numpy views of the pinned buffer: a step writes Python lists into them
        # with no tensor made per field (the host's share of a decode step)
        host = self.host_inputs.numpy()
        self.host_fields = {name: host[i * rows:(i + 1) * rows] for i, name in enumerate(_FIELDS)}
        for name in ("temperature", "top_p"):
            self.host_fields[name] = self.host_fields[name].view(np.float64)
        self.host_tables = host[len(_FIELDS) * rows:].reshape(rows, table_width)
        self.row_index = torch.arange(rows, device=device)
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.host_tokens = torch.zeros(rows, dtype=torch.long, pin_memory=pinned)
        self.logits = torch.zeros(rows, vocab, dtype=logits_dtype, device=device)

    def step(self, n: int) -> DeviceStep:
        f = self.fields
        return DeviceStep(f["ids"][:n], f["positions"][:n], f["slots"][:n], self.row_index[:n],
                          f["lengths"][:n], self.tables[:n])

    def sampling(self, n: int) -> SamplingRows:
        f = self.fields
        return SamplingRows(f["temperature"][:n].view(torch.float64).float(), f["top_k"][:n],
                            f["top_p"][:n].view(torch.float64).float(), f["seed"][:n], f["sample_index"][:n],
                            f["token_index"][:n])


class CudaRunner(PagedRunner):
    def __init__(self, lm: LoadedModel, platform: Platform, holder: attention.ContextHolder, layout: CacheLayout,
                 backend: AttentionBackend, max_batch_size: int = 64, ops: PagedOps | None = None,
                 graphs: bool | None = None):
        """`ops`: the paged kernels (None: the device's, paged_ops.select_ops); `graphs`: capture
        the decode steps (None: on a CUDA device)."""
        lean = platform.lean and len(holder.windows) == 1
        # the dummy block that padded rows write to lies past the pool the scheduler counts
        super().__init__(lm, platform, holder, layout, backend, max_batch_size, extra_blocks=1 if lean else 0)
        self.ops = ops or select_ops(lm.device)
        self.device_lean: DeviceLean | None = None
        if not lean:
            return
        self.dummy = layout.num_blocks
        self.width = -(-lm.max_model_len // layout.block_size)
        self.device_lean = DeviceLean(lm.model, self.ops, {i: p for i, (_, p) in holder.position.items()},
                                      holder.windows[0], lm.max_model_len)
        self.buckets = decode_buckets(max_batch_size)
        self.buffers = DecodeBuffers(self.buckets[-1], self.width, lm.vocab_size, lm.dtype, lm.device)
        self.graphs_on = lm.device.type == "cuda" if graphs is None else graphs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        # decode steps, and their time filling the inputs (the host) and from the copy in to the
        # tokens out (the device, with the launch): bench/gpu.py reports the shares
        self.decode_steps, self.fill_seconds, self.replay_seconds = 0, 0.0, 0.0

    def compile_refusal(self) -> str | None:
        return GRAPHS_NOT_COMPILED if self.device_lean is not None else None

    def bucket(self, n: int) -> int | None:
        """The smallest decode bucket that holds n rows (None: more than the largest)."""
        return next((b for b in self.buckets if b >= n), None) if self.device_lean is not None else None

    # --- the decode graph -------------------------------------------------------------------------
    def _decode_body(self, n: int) -> None:
        """The whole decode step of n (bucket) rows, from the input buffers to the sampled tokens."""
        buf = self.buffers
        logits = self.device_lean.forward(buf.step(n), (self.cache.keys, self.cache.values))
        buf.logits[:n].copy_(logits)
        buf.tokens[:n].copy_(sample_tokens(logits, buf.sampling(n)))

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture every bucket's decode graph now (padded rows only: they write the dummy block)."""
        if self.device_lean is None or not self.graphs_on:
            return
        t = time.perf_counter()
        self._fill([], self.buckets[-1])
        self.buffers.device_inputs.copy_(self.buffers.host_inputs)
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in self.buckets:  # warm-up runs: kernels compiled, allocator settled, outside capture
                self._decode_body(b)
        torch.cuda.current_stream().wait_stream(stream)
        for b in reversed(self.buckets):  # the largest first: the smaller ones reuse its memory pool
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._decode_body(b)
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t

    def _fill(self, seqs: list[Sequence], rows: int) -> None:
        """The host buffer for a decode step of `seqs`, padded to `rows`."""
        buf, bs = self.buffers, self.block_size
        f = buf.host_fields
        n = len(seqs)
        pos = [s.num_computed for s in seqs]
        params = [s.group.params for s in seqs]
        tab = buf.host_tables
        tab[:rows] = self.dummy
        for r, s in enumerate(seqs):
            t = s.blocks.tables[0]
            tab[r, : len(t)] = t
        real = tab[:n]
        real[real == NO_BLOCK] = self.dummy  # blocks a window dropped: never read
        f["ids"][:n] = [s.token_at(p) for s, p in zip(seqs, pos)]
        f["positions"][:n] = pos
        f["slots"][:n] = [int(tab[r, p // bs]) * bs + p % bs for r, p in enumerate(pos)]
        f["lengths"][:n] = [p + 1 for p in pos]
        f["top_k"][:n] = [p.top_k for p in params]
        f["seed"][:n] = [s.group.seed for s in seqs]
        f["sample_index"][:n] = [s.sample_index for s in seqs]
        f["token_index"][:n] = [len(s.output) for s in seqs]
        f["temperature"][:n] = [p.temperature for p in params]
        f["top_p"][:n] = [p.top_p for p in params]
        # padded rows: token 0 at position 0 into the dummy block, attending nothing, greedy
        for name, value in (("ids", 0), ("positions", 0), ("slots", self.dummy * bs), ("lengths", 0), ("top_k", 0),
                            ("seed", 0), ("sample_index", 0), ("token_index", 0), ("temperature", 0.0),
                            ("top_p", 1.0)):
            f[name][n:rows] = value

    def _decode_step(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list[int]]:
        """Run a decode step of `seqs` as its bucket's graph (or the same body eagerly): the logits
        of its rows (a view of the output buffer) and the sampled tokens."""
        n = self.bucket(len(seqs))
        t0 = time.perf_counter()
        self._fill(seqs, n)
        t1 = time.perf_counter()
        buf = self.buffers
        buf.device_inputs.copy_(buf.host_inputs, non_blocking=True)  # the step's one copy in
        if n in self.graphs:
            self.graphs[n].replay()
        else:
            self._decode_body(n)
        buf.host_tokens[:n].copy_(buf.tokens[:n], non_blocking=True)  # and its one copy out
        if self.graphs_on:
            torch.cuda.current_stream().synchronize()
        self.decode_steps += 1
        self.fill_seconds += t1 - t0
        self.replay_seconds += time.perf_counter() - t1
        return buf.logits[: len(seqs)], buf.host_tokens[: len(seqs)].tolist()

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
        self.forward_seconds += time.perf_counter() - t0
        if any(s.group.params.wants_logprobs or s.group.params.logprobs is not None for s in decode):
            return self._sample(decode, [], logits)  # the host sampler adds the log-probabilities
        result = StepResult()
        result.samples = [(seq, tok, None, None) for seq, tok in zip(decode, tokens)]
        return result

    def _forward(self, decode: list[Sequence], chunks: list[Chunk]) -> torch.Tensor:
        """Any step, eagerly, on the lean forward: one block-table row a sequence."""
        if self.device_lean is None:
            return super()._forward(decode, chunks)
        bs, dev = self.block_size, self.lm.device
        seqs = decode + [c.seq for c in chunks]
        tables = [[b if b != NO_BLOCK else self.dummy for b in s.blocks.tables[0]] for s in seqs]
        ids = [s.token_at(s.num_computed) for s in decode]
        pos = [s.num_computed for s in decode]
        rows = list(range(len(decode)))
        keep = list(range(len(decode)))
        for i, c in enumerate(chunks):
            t0 = len(ids)
            ids.extend(chunk_tokens(c))
            pos.extend(range(c.start, c.start + c.length))
            rows.extend([len(decode) + i] * c.length)
            keep.extend(t0 + r for r in kept_rows(c))
        table = torch.full((len(seqs), self.width), self.dummy, dtype=torch.long)
        for r, t in enumerate(tables):
            table[r, : len(t)] = torch.tensor(t)

        def tensor(xs):
            return torch.tensor(xs, dtype=torch.long, device=dev)

        step = DeviceStep(tensor(ids), tensor(pos), tensor([tables[r][p // bs] * bs + p % bs for r, p in zip(rows, pos)]),
                          tensor(rows), tensor([p + 1 for p in pos]), table.to(dev))
        return self.device_lean.forward(step, (self.cache.keys, self.cache.values), tensor(keep))
