"""The CPU runner: the packed runner with the CPU's own paths. Where its platform says so, the
lean forward on packed weights replaces transformers' modules (workers.engine.cpu.lean: oneDNN or
FBGEMM linears, the C++ norms and rotary writes), with the batch-invariant kernel set from the start
where the platform says `deterministic`; attention runs the kernels the CPU's chooser picks
(workers.engine.cpu.backend); and what a position of a long prompt's attention costs is measured
at load on that path (workers.engine.cpu.calibrate)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from workers import files
from workers.capability import cpu_capability
from workers.engine import attention
from workers.engine.cpu import calibrate, extension, prefill_route
from workers.engine.cpu.backend import CPU_KERNELS, attention_kernels
from workers.engine.cpu.lean import LeanLlama, lean_forward
from workers.engine.cpu.linears import lay_out
from workers.engine.cpu.prefill_route import PrefillRoute
from workers.engine.lean_parts import held_blocks, keep_blocks_only
from workers.engine.runners.base import kv_dims, num_layers
from workers.engine.runners.paged import PagedRunner
from workers.weights.gguf_blocks import gguf_blocks
from workers.weights.loaded_model import LoadedModel
from workers.weights.quantized_cache import shared_packed, shared_quantized
from workers.weights.shared import drop_pages, release_heap
from workers.weights.sources import source_gguf, source_key

if TYPE_CHECKING:
    from workers.engine.attention_backend import AttentionBackend
    from workers.engine.kv_cache import CacheLayout
    from workers.platform import Platform

LEAN_NOT_COMPILED = ("the lean forward runs this model (prepack_weights), faster eager than its transformers "
                     "modules compiled; set prepack_weights: false to compile those")
PREFILL_NOTE = "prefill attention"  # pick_kernels' entry for the chunks' route, beside the linears'
LONG_CHUNK_ROWS = 48  # query rows of one KV head in the smallest chunk of a long prompt (min_long_chunk)


class CpuRunner(PagedRunner):
    def __init__(self, lm: LoadedModel, platform: Platform, holder: attention.ContextHolder, layout: CacheLayout,
                 backend: AttentionBackend | None = None, max_batch_size: int = 64):
        """`backend`: attention kernels to run instead of those the CPU's chooser picks."""
        backend = backend or attention_kernels(platform.precision.compute, kv_dims(lm)[1])
        if platform.deterministic and backend.name != CPU_KERNELS:
            raise ValueError("deterministic: true needs the C++ attention kernels, which could not be built here "
                             "(the log says why at the first load)")
        super().__init__(lm, platform, holder, layout, backend, max_batch_size)
        # the lean forward on packed (or quantized) weights, where the platform runs it (the model's
        # family has one); quantized, it keeps a GGUF file's own blocks
        self.lean: LeanLlama | None = None
        built = held_blocks(lm, platform.precision, platform.lean)
        if platform.lean:
            self.lean = self._lean(lm, platform.precision, platform.deterministic, built)

    @staticmethod
    def _lean(lm: LoadedModel, precision, invariant: bool, built: dict | None = None) -> LeanLlama:
        """The lean forward (`invariant`: with the batch-invariant linears). Quantized, it keeps a GGUF
        file's own blocks, and copies that share their weights map one file of the quantized linears
        (workers.weights.quantized_cache); a model of its own lets the 16-bit weights of its blocks go
        (lean_parts.keep_blocks_only), and `built` are those blocks where it did so before."""
        kernels = extension.kernel_module()
        if not precision.quantized:
            return lean_forward(lm.model, precision, kernels, invariant=invariant)
        if built is not None:
            return lean_forward(lm.model, precision, kernels, fused=built, invariant=invariant)

        def build(invariant: bool) -> LeanLlama:
            path = source_gguf(lm.source)
            return lean_forward(lm.model, precision, kernels, gguf_blocks(path, lm.model) if path else None,
                                invariant=invariant)

        if not (lm.weights is not None and lm.weights.shared):
            lean = build(invariant)
            if keep_blocks_only(lm, precision, lean.quantized_weights()):
                release_heap()  # the 16-bit linears' memory back to the OS
            return lean
        fused = shared_quantized(lm.source, lm.dtype, precision.quantized_key, lambda: build(False).quantized_weights())
        lean = lean_forward(lm.model, precision, kernels, fused=fused, invariant=invariant)
        # the 16-bit linears of the shared mapping are not read from now on (the embedding is, also
        # where the LM head is tied to it): their pages leave this process's resident memory
        embed = lm.model.get_input_embeddings().weight.data_ptr()
        drop_pages([m.weight for m in lm.model.modules()
                    if isinstance(m, torch.nn.Linear) and m.weight.data_ptr() != embed])
        return lean

    def pick_kernels(self, max_rows: int) -> dict[str, str]:
        """The quantized linears' kernel by the step's rows (workers.engine.cpu.row_kernels) and the
        prompt chunks' attention by their size (workers.engine.cpu.prefill_route), measured here."""
        chosen = self._pick_row_kernels(max_rows) if self.lean is not None else {}
        route = self._pick_prefill_route(max_rows)
        if route is not None:
            chosen[PREFILL_NOTE] = route.describe()
        return chosen

    def _pick_prefill_route(self, max_rows: int) -> PrefillRoute | None:
        """Which chunks the C++ prefill kernel attends and which PyTorch's SDPA does; None where the
        kernel does not serve (or `deterministic`, whose prompts attend as decode rows)."""
        kvh, dk, dv = kv_dims(self.lm)
        if self.backend.prefill is None or self.batch_invariant or dk != dv:
            return None
        given = self.backend.library_prefill  # a route given with the backend (a test's) is kept
        if given is not None:
            return given if isinstance(given, PrefillRoute) else None
        heads = self.model.config.get_text_config().num_attention_heads
        route = prefill_route.chosen(self.backend, heads, kvh, dk, self.block_size, self.cache.keys.dtype,
                                     self.lm.device, max_rows, extension.kernel_module().__name__)
        self.backend = dataclasses.replace(self.backend, library_prefill=route if route.cells else None)
        return route

    def _pick_row_kernels(self, max_rows: int) -> dict[str, str]:
        lm, precision, kernels = self.lm, self.platform.precision, extension.kernel_module()

        mapped: list[torch.Tensor] = []

        def packs(way: str, weights: dict) -> dict[str, torch.Tensor]:
            # copies that share their weights map one file of the values laid out for the way
            # (packed in bfloat16 pairs, or widened to float32)
            if not (lm.weights is not None and lm.weights.shared):
                return lay_out(kernels, way, weights)
            got = shared_packed(lm.source, lm.dtype, precision.quantized_key, sorted(weights),
                                lambda: lay_out(kernels, way, weights), way)
            mapped.extend(got.values())
            return got

        chosen = self.lean.pick_row_kernels(max_rows, packs)
        # the laid-out values no linear's choice takes were read only while measuring: their pages
        # leave this process's resident memory (the file stays in the page cache for the others)
        kept = {t.data_ptr() for lin in self.lean.linears() for t in (lin.packed16, lin.wide32) if t is not None}
        drop_pages([t for t in mapped if t.data_ptr() not in kept])
        # the values laid out here for measuring (a model's packed or widened linears, hundreds of MB)
        # are free again; glibc would keep their pages in this process otherwise
        release_heap()
        return chosen

    def min_long_chunk(self) -> int:
        """The tokens of LONG_CHUNK_ROWS query rows of one KV head (at least one pass of the C++
        prefill kernel over the context: 16 rows in bfloat16, 8 in float32). A chunk's cost is mostly
        the context's keys and values streamed through the caches, whatever its rows: a chunk of one
        pass (2 tokens of SmolLM2 in float32) cost about what one of 16 tokens did, so a long prompt
        beside 32 streams went at 19 tokens/s in chunks of 2 and at 72 in chunks of 16 (2-core EPYC)."""
        if self.backend.prefill is None:
            return 1
        heads, kv_heads = self.model.config.get_text_config().num_attention_heads, kv_dims(self.lm)[0]
        rows = max(LONG_CHUNK_ROWS, extension.PREFILL_LANES[self.platform.precision.compute])
        return max(1, rows // max(1, heads // kv_heads))

    def compile_refusal(self) -> str | None:
        # the lean forward is one fused pass per layer on packed weights: eager, it runs about twice
        # as fast as transformers' modules compiled, so neither auto nor true trades it for them
        return LEAN_NOT_COMPILED if self.lean is not None else None

    def _skips_zeroing(self) -> bool:
        return self.lean is not None and self.compiled is None and self.backend.own_positions_only

    def _call(self, ctx: attention.StepContext, call: dict) -> torch.Tensor:
        if self.lean is None:
            return super()._call(ctx, call)
        return self.lean.forward(call["input_ids"][0], call["position_ids"][0], call["logits_to_keep"],
                                 (self.cache.keys, self.cache.values), ctx)

    def measured_attention_span(self) -> int | None:
        """attention_span measured on this machine on the attention path and linears that serve
        (workers.engine.cpu.calibrate); None where it cannot be measured."""
        cfg = self.model.config.get_text_config()
        kvh, dk, _ = kv_dims(self.lm)
        layers = num_layers(self.lm)
        if self.lean is not None:
            inter = getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
            linears = [(x, width) for lay in self.lean.layers
                       for x, width in ((lay.qkv, cfg.hidden_size), (lay.o, cfg.num_attention_heads * dk),
                                        (lay.gate_up, cfg.hidden_size), (lay.down, inter))]
        else:  # the decoder layers' linears (the LM head's name holds no layer index)
            linears = [(m, m.in_features) for name, m in self.model.named_modules()
                       if isinstance(m, torch.nn.Linear) and any(f".{i}." in f".{name}." for i in range(layers))]
        key = "|".join(map(str, (source_key(self.lm.source), self.platform.precision, self.lean is not None,
                                 self.batch_invariant, self.backend.name, self.backend.prefill is not None,
                                 self.backend.library_prefill,
                                 self.block_size, self.cache.keys.dtype, torch.get_num_threads(),
                                 cpu_capability().tag(),
                                 # the linears' kernels by rows (pick_kernels, before this): a chunk's
                                 # cost is measured on the ways that run it
                                 sorted({str(lin.rows) for lin in self.lean.linears()} if self.lean else ()))))
        return files.remembered(key, lambda: calibrate.attention_span(
            self.holder, self.backend, linears, layers, cfg.num_attention_heads, kvh, dk, self.block_size,
            self.cache.keys.dtype, self.lm.device))


DeviceRunner = CpuRunner  # the room's runner (workers.engine.runners.ROOMS)
