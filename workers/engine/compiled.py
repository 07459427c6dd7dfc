"""A compiled packed forward: each decoder layer runs as one torch.compile'd (inductor) graph.

Regional compilation: the decoder layers of a model are identical, so compiling the layer
rather than the whole model traces and code-generates one graph per token bucket and reuses it
for every layer (the layer index reaches the attention op as a tensor, not a constant it could
specialise on). Cold compiles take seconds instead of minutes, and the cache holds little.

Shapes are static per bucket: the runner pads a step's packed tokens up to the next bucket
(padded rows are zeros that the attention op never writes to the cache), so a handful of graphs
cover every step. Attention itself is the opaque op `mmfusion::attend` (workers.engine.attention); the
graph around it holds the projections, norms, rotary embeddings and MLP.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from workers.buckets import Buckets
from workers.compile_summary import summary
from workers.engine import attention, compile_cache
from workers.gc_pause import collector_paused

if TYPE_CHECKING:
    from workers.platform import Platform

log = logging.getLogger("mmfusion.compile")


def decoder_layers(model) -> torch.nn.ModuleList | None:
    """The model's stack of decoder layers: the ModuleList as long as the config's layer count."""
    n = model.config.get_text_config().num_hidden_layers
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n and n > 0:
            return mod
    return None


class CompiledLayers:
    """Compiled versions of a model's decoder layers, active only inside `active()`: outside it
    (another engine on the same weights running eagerly, a transformers reference) the layers
    are the plain modules and never trigger a compile."""

    def __init__(self, model, buckets: Buckets, cuda_graphs: bool = False):
        layers = decoder_layers(model)
        if layers is None:
            raise ValueError(f"{type(model).__name__}: no decoder layer stack found to compile")
        self.buckets = buckets
        attention.index_layers(model)
        # One graph per bucket and attention variant (Gemma's sliding and global layers), and the
        # limit counts per code object, which transformers' layers share across architectures
        # (GradientCheckpointingLayer.__call__): let dynamo keep them all rather than fall back
        # to eager after its default 8.
        limit = 64 + 4 * len(buckets.tokens)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4 * limit)
        self.layers = list(layers)
        # one code object (Module._call_impl) for every layer: the layers share the graphs
        self.graphs = GraphReplay(cuda_graphs)
        opts = self.graphs.compile_options()
        self._fns = [torch.compile(layer._call_impl, dynamic=False, fullgraph=True, **opts) for layer in self.layers]

    @contextlib.contextmanager
    def active(self):
        self.graphs.step_begin()
        for layer, fn in zip(self.layers, self._fns):
            layer._compiled_call_impl = fn
        try:
            yield
        finally:
            for layer in self.layers:
                layer._compiled_call_impl = None


class GraphReplay:
    """The CUDA-graph seam: on CUDA, each bucket's compiled layer graph is captured once and
    replayed (inductor's CUDA graph trees, mode="reduce-overhead"). The attention op is tagged
    cudagraph_unsafe and inductor's graph partition splits each layer around it, as vLLM's
    piecewise CUDA graphs do: the projections, norms and MLP replay, while attention runs
    live with the step's own sequence layout. Its platform turns it on (Platform.cuda_graphs); on
    CPU it is inert.

    Not yet run on a GPU (docs/architecture.md): tests/test_compiled.py has a CUDA-only test for it."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def compile_options(self) -> dict:
        if not self.enabled:
            return {}
        torch._inductor.config.graph_partition = True
        return {"mode": "reduce-overhead"}

    def step_begin(self) -> None:
        # a new step: the previous step's graph outputs may be overwritten by this one's replays
        if self.enabled:
            torch.compiler.cudagraph_mark_step_begin()


def graphs_compiled() -> int:
    """Frames dynamo has compiled in this process (each bucket/variant of a layer is one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclass(slots=True)
class CompileInfo:
    """How an engine runs, for logs and status: compiled or eager, and why."""

    compiled: bool
    reason: str
    warm: bool = False  # the graphs came from the compiled cache
    seconds: float = 0.0  # compiling (or loading) every bucket at start-up
    cache: str | None = None
    buckets: tuple[int, ...] = ()

    def summary(self) -> str:
        return summary(self.as_dict())

    def as_dict(self) -> dict:
        return {"compiled": self.compiled, "reason": self.reason, "warm": self.warm,
                "seconds": round(self.seconds, 3), "cache": self.cache, "buckets": list(self.buckets)}


class Compilable(Protocol):
    """What compiling asks of a runner (workers.engine.runners.base.Runner declares it)."""

    platform: Platform

    def compile_refusal(self) -> str | None: ...

    def enable_compile(self, buckets: Buckets) -> None: ...

    def warm_up(self) -> None: ...


def prepare(runner: Compilable, lm, mode: str, buckets: Buckets) -> CompileInfo:
    """Compile `runner`'s forward when `mode` asks for it: `true` always, `auto` when the cache
    has this model's artifacts. Builds every bucket before returning and saves what it built."""
    if mode == "false":
        return CompileInfo(False, "compile is false")
    reason = runner.compile_refusal()
    if reason is not None:
        if mode == "true":
            log.warning("compile: true, but %s: running eagerly", reason)
        return CompileInfo(False, reason)
    key = compile_cache.CompileKey.for_model(lm.source, lm.dtype, lm.device, buckets.key(), runner.platform.compile_isa())
    present = compile_cache.has_artifacts(key)
    if mode == "auto" and not present:
        return CompileInfo(False, "no compiled artifacts in the cache for this model, dtype, device and "
                                  "buckets (run compile_only, or set compile: true)")
    compile_cache.use_cache_dir()
    t = time.perf_counter()
    # tracing and lowering a graph is a burst of Python objects: the collector paused (workers.gc_pause),
    # a compile of tiny Llama's two buckets takes 22 s instead of 26 on a 2-core AVX2 CPU
    with collector_paused():
        warm = present and compile_cache.load(key)
        runner.enable_compile(buckets)
        runner.warm_up()
        if not warm:
            compile_cache.save(key)
    took = time.perf_counter() - t
    log.info("compiled %s (%s) for buckets %s in %.1f s (%s)", lm.source, str(lm.dtype).removeprefix("torch."),
             buckets.key(), took, "from the cache" if warm else "from scratch, saved to the cache")
    return CompileInfo(True, "loaded from the cache" if warm else "compiled", warm, took,
                       str(key.directory()), buckets.tokens)
