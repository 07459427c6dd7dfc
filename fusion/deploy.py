"""From params + variants to ModelInfo objects, router model entries and worker overrides."""

from __future__ import annotations

from fusion.model_info import ModelInfo, MultiModelFusion
from fusion.params import parse_variants
from fusion.plan import DeploymentPlan
from routing.router import ModelEntry

SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "max_tokens")


def build_fusion(params: dict, variants) -> MultiModelFusion:
    models = []
    for name, count in parse_variants(variants, params):
        v = params["variants"][name]
        m = v["model"]
        for _ in range(count):
            models.append(ModelInfo(name=name, source=m["source"], params={**m, "inference_input":
                                                                          v.get("inference_input", {})},
                                    deltat_scaling_factor=float(m.get("deltat_scaling_factor", 1.0))))
    return MultiModelFusion(models)


def model_entries(fusion: MultiModelFusion) -> list[ModelEntry]:
    out = []
    for i, info in enumerate(fusion.models):
        p = info.params
        spec = {"name": info.name, "source": info.source, "dtype": p.get("dtype", "auto"),
                "max_model_len": p.get("max_model_len"), "share_weights": bool(p.get("share_weights", True)),
                "compile": p.get("compile", "auto"), "compile_buckets": p.get("compile_buckets"),
                "defaults": {k: p[k] for k in SAMPLING_DEFAULTS if k in p}}
        out.append(ModelEntry(i, info.name, spec))
    return out


def worker_overrides(plan: DeploymentPlan) -> list[dict]:
    """Per planned worker: what the router adds to the model spec it assigns (device, threads, limits)."""
    return [{"model_id": w.model_id, "device": w.device, "num_threads": w.threads,
             "engine": {"max_batch_size": w.max_batch_size, "max_batch_tokens": w.max_batch_tokens}}
            for w in plan.workers]
