"""ModelInfo and MultiModelFusion: several models fused into one deployment with unique IDs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass(slots=True)
class ModelInfo:
    """One model of a fused deployment.

    deltat_scaling_factor: the model's relative share of batch capacity when workers share a
    device. A model with factor 2 gets twice the `max_batch_size` and `max_batch_tokens` of a
    model with factor 1 on the same device (see fusion.plan).
    """

    name: str
    source: str
    params: dict = field(default_factory=dict)  # the variant's `model` section (+ inference_input)
    input_fn: Callable[[dict], Iterator[dict]] | None = None
    deltat_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("ModelInfo.name must be a non-empty string")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"ModelInfo {self.name!r}: source must be a non-empty string")
        if isinstance(self.deltat_scaling_factor, bool) or not isinstance(self.deltat_scaling_factor, (int, float)) \
                or self.deltat_scaling_factor <= 0:
            raise ValueError(f"ModelInfo {self.name!r}: deltat_scaling_factor must be a positive number, "
                             f"got {self.deltat_scaling_factor!r}")


class MultiModelFusion:
    """Fuses ModelInfo objects: model ID i is models[i]; copies of one variant share its name."""

    def __init__(self, models: list[ModelInfo]):
        if not models:
            raise ValueError("MultiModelFusion needs at least one ModelInfo")
        self.models = list(models)

    @property
    def params(self) -> dict:
        return {str(i): m.params for i, m in enumerate(self.models)}

    @property
    def stack_params(self) -> dict:
        return {"num_models": len(self.models),
                "models": [{"model_id": i, "name": m.name, "source": m.source,
                            "deltat_scaling_factor": m.deltat_scaling_factor} for i, m in enumerate(self.models)]}

    def model_ids(self, name: str) -> list[int]:
        return [i for i, m in enumerate(self.models) if m.name == name]

    def input_fn(self, params: dict | None = None) -> Iterator[tuple[int, dict]]:
        """Yield (model ID, request) from every model's input_fn, interleaved round-robin."""
        iters = [(i, iter(m.input_fn(params or m.params))) for i, m in enumerate(self.models) if m.input_fn]
        while iters:
            alive = []
            for i, it in iters:
                try:
                    yield i, next(it)
                    alive.append((i, it))
                except StopIteration:
                    pass
            iters = alive
