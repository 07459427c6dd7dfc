"""The packed runner over the paged KV cache, for models on transformers' attention interface.

Every scheduled token (decode tokens first, then prefill chunks) goes into a single [1, N]
forward, and the LM head computes only the rows that are sampled or scored. The attention
backend builds the step's metadata; the model call carries it, with the cache, as keyword
arguments (workers.engine.attention). The forward runs transformers' modules, eagerly or with
each decoder layer compiled per token bucket (workers.engine.compiled); a device's runner may
replace the model call (the CPU's lean forward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.engine import attention
from workers.engine.attention_backend import token_rows
from workers.engine.compiled import CompiledLayers
from workers.engine.kv_cache import PagedKVCache
from workers.engine.runners.base import Runner, chunk_tokens, kept_rows, kv_dims
from workers.engine.scheduler import Chunk
from workers.engine.sequence import Sequence
from workers.weights.loaded_model import LoadedModel

if TYPE_CHECKING:
    from workers.buckets import Buckets
    from workers.engine.attention_backend import AttentionBackend
    from workers.engine.kv_cache import CacheLayout
    from workers.platform import Platform


class PagedRunner(Runner):
    def __init__(self, lm: LoadedModel, platform: Platform, holder: attention.ContextHolder, layout: CacheLayout,
                 backend: AttentionBackend, max_batch_size: int = 64, extra_blocks: int = 0):
        """`max_batch_size`: the most sequences a step holds; `extra_blocks`: pool blocks of the
        runner's own, past the layout's."""
        super().__init__(lm, platform, layout)
        self.max_batch_size = max_batch_size
        self.holder = holder
        self._backend = backend
        self.compiled: CompiledLayers | None = None
        self.block_size = layout.block_size
        # new blocks are left unzeroed where every kernel that serves reads only a row's own positions
        self.unzeroed = False
        # the KV cache in the compute dtype (float32 where 16-bit weights compute in float32)
        self.cache = PagedKVCache(layout, *kv_dims(lm), platform.precision.compute, lm.device, extra_blocks)

    @property
    def backend(self) -> AttentionBackend:
        return self._backend

    @backend.setter
    def backend(self, backend: AttentionBackend) -> None:
        self._backend = backend

    def compile_refusal(self) -> str | None:
        return None

    def enable_compile(self, buckets: Buckets) -> None:
        """Run the decoder layers compiled from now on: every step pads its tokens up to a bucket."""
        self.compiled = CompiledLayers(self.model, buckets, self.platform.cuda_graphs)

    def _skips_zeroing(self) -> bool:
        """Whether every path that may serve reads only the positions a row holds."""
        return False

    def new_blocks(self, blocks: list[int]) -> None:
        # the C++ kernels read only the positions a row holds; the PyTorch paths read whole blocks
        # under a mask, and stale memory (NaN among it) would leak through: zero for them
        self.unzeroed = self._skips_zeroing()
        if not self.unzeroed:
            self.cache.zero_blocks(blocks)

    def _forward(self, decode: list[Sequence], chunks: list[Chunk]) -> torch.Tensor:
        ids = [s.token_at(s.num_computed) for s in decode]
        pos = [s.num_computed for s in decode]
        keep = list(range(len(decode)))
        for chunk in chunks:
            t0 = len(ids)
            ids.extend(chunk_tokens(chunk))
            pos.extend(range(chunk.start, chunk.start + chunk.length))
            keep.extend(t0 + r for r in kept_rows(chunk))
        dev = self.lm.device
        if self.batch_invariant:  # `deterministic`: every token attends as a decode row does
            ctx = self.backend.metadata(self.holder, token_rows(decode, chunks), [], pos, self.block_size, dev,
                                        self.unzeroed)
        else:
            ctx = self.backend.metadata(self.holder, decode, chunks, pos, self.block_size, dev, self.unzeroed)
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
        return self.run_call(ctx, call)

    def run_call(self, ctx: attention.StepContext, call: dict) -> torch.Tensor:
        """One model call of a step, laid out by `ctx`: the logits of the rows it keeps."""
        return self._call(ctx, call)

    def _call(self, ctx: attention.StepContext, call: dict) -> torch.Tensor:
        # no transformers cache: the attention op writes the paged cache, handed down as a keyword
        kv = {attention.KV_KWARG: (self.cache.keys, self.cache.values)}
        if self.compiled is not None and self.compiled.buckets.pad(call["input_ids"].shape[1]) is not None:
            # a compiled graph takes tensors only: its op reads the step from the holder meanwhile
            with self.compiled.active(), self.holder.stepping(ctx):
                out = self.model(**call, use_cache=False, **kv)
        else:
            out = self.model(**call, use_cache=False, **kv, **{attention.STEP_KWARG: ctx})
        return out.logits[0]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Build the compiled graph of every bucket now, not on the first request that needs it:
        a forward of zero real tokens (attention writes and reads nothing) at each bucket size."""
        if self.compiled is None:
            return
        dev = self.lm.device
        for b in self.compiled.buckets.tokens:
            zeros = torch.zeros(1, b, dtype=torch.long, device=dev)
            self._call(self.backend.empty(self.holder, dev),
                       dict(input_ids=zeros, position_ids=zeros, logits_to_keep=torch.zeros(1, dtype=torch.long,
                                                                                            device=dev)))
