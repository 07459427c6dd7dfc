"""From params + variants to the fused models and the router's model entries."""

from __future__ import annotations

from fusion.model_info import ModelInfo, MultiModelFusion
from fusion.params import parse_variants
from routing.router import ModelEntry
from workers.spec import ModelSpec


def build_fusion(params: dict, variants) -> MultiModelFusion:
    models = []
    for name, count in parse_variants(variants, params):
        v = params["variants"][name]
        spec = ModelSpec.from_params(name, v["model"])
        models += [ModelInfo(spec, v.get("inference_input") or {}) for _ in range(count)]
    return MultiModelFusion(models)


def variant_specs(params: dict) -> dict[str, ModelSpec]:
    """Every variant of the params: what a serving deployment can load at run time."""
    return {name: ModelSpec.from_params(name, v["model"]) for name, v in params["variants"].items()}


def model_entries(fusion: MultiModelFusion) -> list[ModelEntry]:
    return [ModelEntry(i, info.name, info.spec) for i, info in enumerate(fusion.models)]
