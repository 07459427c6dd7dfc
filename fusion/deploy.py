"""From params + variants to ModelInfo objects, router model entries and worker overrides."""

from __future__ import annotations

from fusion.model_info import ModelInfo, MultiModelFusion
from fusion.params import parse_variants
from fusion.plan import DeploymentPlan
from routing.router import ModelEntry
from workers.config_keys import SAMPLING_DEFAULTS, model_value


def build_fusion(params: dict, variants) -> MultiModelFusion:
    models = []
    for name, count in parse_variants(variants, params):
        v = params["variants"][name]
        m = v["model"]
        for _ in range(count):
            models.append(ModelInfo(name=name, source=m["source"], params={**m, "inference_input":
                                                                          v.get("inference_input", {})},
                                    deltat_scaling_factor=float(model_value(m, "deltat_scaling_factor"))))
    return MultiModelFusion(models)


def model_entries(fusion: MultiModelFusion) -> list[ModelEntry]:
    out = []
    for i, info in enumerate(fusion.models):
        p = info.params
        spec = {"name": info.name, "source": info.source, "dtype": model_value(p, "dtype"),
                "max_model_len": model_value(p, "max_model_len"),
                "share_weights": bool(model_value(p, "share_weights")),
                "compile": model_value(p, "compile"), "compile_buckets": model_value(p, "compile_buckets"),
                "long_prefill_tokens": model_value(p, "long_prefill_tokens"),
                "prepack_weights": bool(model_value(p, "prepack_weights")),
                "defaults": {k: p[k] for k in SAMPLING_DEFAULTS if p.get(k) is not None}}
        out.append(ModelEntry(i, info.name, spec))
    return out


def worker_overrides(plan: DeploymentPlan) -> list[dict]:
    """Per planned worker: what the router adds to the model spec it assigns (device, threads, limits)."""
    return [{"model_id": w.model_id, "device": w.device, "num_threads": w.threads,
             **({"cpus": w.cpus} if w.cpus else {}),
             "engine": {"max_batch_size": w.max_batch_size, "max_batch_tokens": w.max_batch_tokens,
                        "kv_cache_memory": w.kv_cache_bytes, "kv_block_size": w.block_size}}
            for w in plan.workers]
