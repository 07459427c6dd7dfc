"""ModelInfo and MultiModelFusion: several models fused into one deployment with unique IDs."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.spec import ModelSpec


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """One model of a fused deployment: its variant's model settings and input section.

    deltat_scaling_factor: the model's relative share of batch capacity when workers share a
    device. A model with factor 2 gets twice the `max_batch_size` and `max_batch_tokens` of a
    model with factor 1 on the same device (see fusion.plan).
    """

    spec: ModelSpec
    inference_input: dict = field(default_factory=dict)  # the variant's `inference_input` section

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def source(self) -> str:
        return self.spec.source

    @property
    def deltat_scaling_factor(self) -> float:
        return float(self.spec.deltat_scaling_factor)


class MultiModelFusion:
    """Fuses ModelInfo objects: model ID i is models[i]; copies of one variant share its name."""

    def __init__(self, models: list[ModelInfo]):
        if not models:
            raise ValueError("MultiModelFusion needs at least one ModelInfo")
        self.models = list(models)
