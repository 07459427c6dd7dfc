"""run_mm.py --mode compile_only: load each variant once, compile its forward for the worker's
token buckets and save the artifacts under $MMFUSION_CACHE/compiled (workers.engine.compile_cache) so that
predict and serve start compiled from them, run one batch at its configured batch size, and report
whether the planned deployment fits and the memory measured. A variant with `compile: false`
stays eager.

A GGUF model is saved as safetensors on its first load (workers.models.write_gguf_cache) and
loaded again from there, so the report gives the start time before and after the cache. Each
conversion and measurement runs in a process of its own forked from the preloaded server, as a
worker starts (fusion.launcher), without router: the memory measured is the process's peak above
its footprint before the load (on CUDA, the peak allocated).
"""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, replace

import psutil

from fusion import launcher
from fusion.data.files import DataError
from fusion.inputs import variant_samples
from fusion.jobs import variant_groups
from fusion.model_info import MultiModelFusion
from fusion.params import input_value
from fusion.plan import DeploymentPlan, available_bytes
from workers.buckets import compile_mode
from workers.devices import device_kind
from workers.spec import WorkerSpec
from workers.weights.sources import check_source, gguf_cache_dir, source_gguf

TEST_BATCH_MAX_TOKENS = 16  # new tokens per prompt of the test batch when the variant sets no max_tokens


@dataclass(slots=True)
class CompileReport:
    variant: str
    source: str
    device: str
    dtype: str
    load_s: float  # start time as a worker would see it next time (from the cache when there is one)
    load_s_before_cache: float | None  # None: the cache existed already, or the source is not GGUF
    cache: str | None
    batch_size: int
    max_tokens: int
    batch_s: float | None
    tokens_generated: int
    measured_bytes: int  # weights + KV cache + activations of one worker
    estimated_bytes: int  # what the plan assumed
    fits: bool
    error: str | None = None
    weight_bytes: int = 0
    shared_weights: bool = False  # one mapping for every copy on a device (counted once there)
    compile: dict | None = None  # workers.engine.compiled.CompileInfo: compiled or not, seconds, cache entry

    def as_dict(self) -> dict:
        return asdict(self)


def first_batch(fusion: MultiModelFusion, name: str, batch_size: int) -> list:
    """The prompts of the variant's first batch; its data must be readable (errors name the file)."""
    prompts = [s.prompt for s in variant_samples(fusion, name, inference_steps=1) if s.error is None]
    if not prompts:
        raise DataError(f"variant {name!r}: no valid sample in its input")
    return (prompts * batch_size)[:batch_size]  # a short input is repeated to fill the batch


def _in_own_process(fn: str, *args):
    """fn(*args) ("function" of this module) in a process forked from the preloaded server: its
    memory is its own, and it imports nothing (the server has torch and transformers already)."""
    try:
        return launcher.call_in_server(f"fusion.compile:{fn}", *args)
    except ValueError as exc:  # the loader's errors name the source and what to do
        raise DataError(str(exc)) from None


def convert(source: str) -> float:
    """First load of a GGUF (dequantizing it), then the safetensors cache. Returns the load time.
    In float32 on CPU whatever the variant serves in: the cache keeps the dequantized values
    exactly, for every dtype that loads it later (a bfloat16 load would round them first)."""
    from workers.models import load_model
    from workers.weights.hf_loader import write_gguf_cache

    t = time.perf_counter()
    lm = load_model(source, dtype="float32", device="cpu", use_cache=False)
    took = time.perf_counter() - t
    write_gguf_cache(lm.model, lm.tokenizer, source_gguf(source))
    return took


def measure(spec: WorkerSpec, prompts: list, max_tokens: int) -> dict:
    """Load as the worker of `spec` would and run one batch; the memory it took and the times."""
    import torch

    from workers.engine import Engine, EngineConfig
    from workers.engine.params import SamplingParams
    from workers.models import load_model

    dev = torch.device(spec.device)
    base = psutil.Process().memory_info().rss
    t = time.perf_counter()
    m = spec.model
    lm = load_model(m.source, dtype=m.dtype, device=spec.device, max_model_len=m.max_model_len,
                    share_weights=m.share_weights, prepack=m.prepack_weights, one_engine=True)
    out = {"load_s": round(time.perf_counter() - t, 3), "dtype": str(lm.dtype).removeprefix("torch."),
           "batch_s": None, "tokens_generated": 0, "fits": False, "error": None,
           "weight_bytes": lm.weights.bytes, "shared_weights": lm.weights.shared, "compile": None}
    try:
        engine = Engine(lm, EngineConfig.from_spec(spec))
        out["compile"] = engine.compile_info.as_dict()
        t = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        out["batch_s"] = round(time.perf_counter() - t, 3)
        out["tokens_generated"] = sum(len(o.outputs[0].token_ids) for o in outs)
        out["fits"] = True
    except (RuntimeError, ValueError) as exc:  # out of memory, a prompt longer than the context...
        out["error"] = f"{type(exc).__name__}: {exc}"
    if device_kind(dev).host:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        out["measured_bytes"] = max(0, peak - base)
    else:
        out["measured_bytes"] = torch.cuda.max_memory_allocated(dev)
    return out


def first_batches(fusion: MultiModelFusion) -> dict[str, list]:
    """Each variant's first batch (compile_only runs one), every variant's input and source checked
    before anything loads: a bad last variant is not found after the first one's compile."""
    batches = {}
    for name, mids in variant_groups(fusion).items():
        info = fusion.models[mids[0]]
        if not info.inference_input:
            raise DataError(f"variant {name!r} has no inference_input: compile_only runs one batch of a variant's "
                            "data, so give it one (data_processor, data_dir, batch_size)")
        batches[name] = first_batch(fusion, name, input_value(info.inference_input, "batch_size"))
        try:
            check_source(info.source)  # here, not seconds later in a fresh process
        except ValueError as exc:
            raise DataError(str(exc)) from None
    return batches


def compile_variant(fusion: MultiModelFusion, plan: DeploymentPlan, name: str, prompts: list) -> CompileReport:
    mids = variant_groups(fusion)[name]
    info = fusion.models[mids[0]]
    w = next(w for w in plan.workers if w.model_id == mids[0])
    model = info.spec
    max_tokens = model.max_tokens or TEST_BATCH_MAX_TOKENS
    gguf = source_gguf(info.source)
    before = None
    if gguf is not None and gguf_cache_dir(gguf) is None:
        before = round(_in_own_process("convert", info.source), 3)
    # compile_only is where the artifacts are made: `auto` compiles here
    compiled = "false" if compile_mode(model.compile) == "false" else "true"
    spec = w.spec.placed(model=replace(model, compile=compiled))
    m = _in_own_process("measure", spec, prompts, max_tokens)
    cache = gguf_cache_dir(gguf) if gguf is not None else None
    return CompileReport(name, info.source, w.device, m["dtype"], m["load_s"], before,
                         str(cache) if cache else None, len(prompts), max_tokens, m["batch_s"], m["tokens_generated"],
                         m["measured_bytes"], w.est_bytes, m["fits"], m["error"], m["weight_bytes"],
                         m["shared_weights"], m["compile"])


def compile_only(fusion: MultiModelFusion, plan: DeploymentPlan,
                 batches: dict[str, list]) -> tuple[list[CompileReport], list[dict]]:
    """Reports per variant (each running its batch of `first_batches`), then per device: the workers
    planned there at their measured sizes."""
    reports = {name: compile_variant(fusion, plan, name, batches[name]) for name in variant_groups(fusion)}
    by_model = {mid: reports[fusion.models[mid].name] for mid in range(len(fusion.models))}
    devices = []
    for dev in plan.devices:
        workers = [w for w in plan.workers if w.device == dev]
        need, groups = 0, {}
        for w in workers:
            r = by_model[w.model_id]
            if r.shared_weights:  # the copies of a variant map one set of weights: counted once
                need += r.measured_bytes - r.weight_bytes
                groups[r.variant] = r.weight_bytes
            else:
                need += r.measured_bytes
        need += sum(groups.values())
        avail = available_bytes(dev)
        ok = all(by_model[w.model_id].fits for w in workers) and (avail is None or need <= avail)
        devices.append({"device": dev, "workers": len(workers), "measured_bytes": need, "available_bytes": avail,
                        "fits": ok})
    return list(reports.values()), devices
