"""The one carrier of a model's settings from the params to the engine.

`ModelSpec` is a variant's `model` section, made once from the params with every default taken
from the key table (workers.config_keys, which also generates docs/configuration.md) and checked
there. `WorkerSpec` is a ModelSpec plus its placement: the model ID, the device, the threads and
cores, the planned batch limits and KV budget, and the weights' owner. The planner makes it
(fusion.plan.place_worker), the router sends it in ASSIGN as one map (`to_wire`), and the worker
reads the same type back (`from_wire`) and builds its engine from it.

Light on purpose (no torch): the router and the planner import it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from wire.protocol import out_of_range, range_error
from workers.buckets import Buckets, compile_mode
from workers.config_keys import MODEL, REQUIRED, SAMPLING_DEFAULTS, parse_size
from workers.devices import check_device
from workers.validate import check_int, is_int


def _default(name: str) -> Any:
    return MODEL[name].default


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A variant's model settings; its fields are the key table's keys, plus the variant's name."""

    name: str
    source: str
    dtype: str = _default("dtype")
    max_model_len: int | None = _default("max_model_len")
    max_batch_size: int = _default("max_batch_size")
    max_batch_tokens: int = _default("max_batch_tokens")
    long_prefill_tokens: int = _default("long_prefill_tokens")
    kv_cache_memory: int | str | None = _default("kv_cache_memory")
    kv_block_size: int = _default("kv_block_size")
    deltat_scaling_factor: float = _default("deltat_scaling_factor")
    share_weights: bool = _default("share_weights")
    prepack_weights: bool = _default("prepack_weights")
    quantization: str = _default("quantization")
    deterministic: bool = _default("deterministic")
    compile: str | bool = _default("compile")
    compile_buckets: tuple[int, ...] | None = _default("compile_buckets")
    pin: bool = _default("pin")
    resources: dict | None = _default("resources")
    start_token: int | tuple[int, ...] | None = _default("start_token")
    end_token: int | tuple[int, ...] | None = _default("end_token")
    loop_dim: int = _default("loop_dim")
    max_tokens: int | None = _default("max_tokens")
    temperature: float | None = _default("temperature")
    top_p: float | None = _default("top_p")
    top_k: int | None = _default("top_k")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a model's name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"model.source must name a model source (e.g. smollm2-135m), got {self.source!r}")
        for key in MODEL.values():
            value = getattr(self, key.name)
            if key.check is not None and not key.check(value):
                raise ValueError(f"model.{key.name} must be {key.valid}, got {value!r}")
        if self.max_batch_tokens < self.max_batch_size:  # as the scheduler refuses it (and vLLM)
            raise ValueError(f"model.max_batch_tokens ({self.max_batch_tokens}) must be >= model.max_batch_size "
                             f"({self.max_batch_size}): a step computes a token of each sequence it runs; raise "
                             "max_batch_tokens or lower max_batch_size")
        path = out_of_range({f.name: getattr(self, f.name) for f in fields(self)})
        if path is not None:  # the spec travels to its workers as a message
            raise ValueError(f"model.{range_error(path)}")
        # lists from YAML or the wire become tuples: the spec is a value, compared and never changed
        for name in ("compile_buckets", "start_token", "end_token"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        try:
            compile_mode(self.compile)
        except ValueError as exc:
            raise ValueError(f"model.compile: {exc}") from None
        if self.compile_buckets is not None:
            try:
                Buckets(self.compile_buckets)
            except ValueError as exc:
                raise ValueError(f"model.compile_buckets: {exc}") from None

    @classmethod
    def from_params(cls, name: str, params: dict) -> ModelSpec:
        """From a variant's `model` section; a key the table does not know is an error."""
        unknown = sorted(set(params) - set(MODEL))
        if unknown:
            raise ValueError(f"model.{unknown[0]}: unknown key; known keys: {sorted(MODEL)}")
        missing = [k.name for k in MODEL.values() if k.default is REQUIRED and k.name not in params]
        if missing:
            raise ValueError(f"model.{missing[0]} is required")
        return cls(name=name, **params)

    def request_defaults(self) -> dict:
        """The sampling defaults this model gives requests that leave them out."""
        return {k: getattr(self, k) for k in SAMPLING_DEFAULTS if getattr(self, k) is not None}

    def kv_budget(self) -> int | None:
        """This model's own KV budget in bytes; None where it leaves it to the plan (`auto`, null)."""
        return None if self.kv_cache_memory in (None, "auto") else parse_size(self.kv_cache_memory)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What one worker serves and where: its model's settings and its placement."""

    model: ModelSpec
    model_id: int
    device: str = "cpu"
    threads: int | None = None  # torch threads; None: the worker's own default
    cpus: tuple[int, ...] | None = None  # cores its threads are bound to (None: unbound)
    max_batch_size: int | None = None  # None: the model's (a planned worker's share otherwise)
    max_batch_tokens: int | None = None
    kv_cache_bytes: int | None = None  # its KV pool; None: the model's own, else the engine's default budget
    weights_owner: str | None = None  # CUDA: the process that holds the shared weights

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelSpec):
            raise ValueError(f"WorkerSpec.model must be a ModelSpec, got {type(self.model).__name__}")
        check_int("model_id", self.model_id, 0)
        check_device(self.device)
        for name in ("threads", "max_batch_size", "max_batch_tokens", "kv_cache_bytes"):
            value = getattr(self, name)
            if value is not None:
                check_int(name, value, 1)
        if isinstance(self.cpus, list):
            object.__setattr__(self, "cpus", tuple(self.cpus))
        if self.cpus is not None and not all(is_int(c, 0) for c in self.cpus):
            raise ValueError(f"cpus must be core numbers, got {self.cpus!r}")
        if self.weights_owner is not None and not isinstance(self.weights_owner, str):
            raise ValueError(f"weights_owner must be an address, got {self.weights_owner!r}")

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def batch_size(self) -> int:
        return self.max_batch_size or self.model.max_batch_size

    @property
    def batch_tokens(self) -> int:
        return self.max_batch_tokens or self.model.max_batch_tokens

    @property
    def kv_bytes(self) -> int | None:
        return self.kv_cache_bytes or self.model.kv_budget()

    def placed(self, **changes) -> WorkerSpec:
        """The same worker with some placement fields changed (a new value: the spec is frozen)."""
        return replace(self, **changes)

    def to_wire(self) -> dict:
        """One msgpack-able map (tuples as lists)."""
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> WorkerSpec:
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            raise ValueError("an ASSIGN's model must be a map with the worker's spec")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"the worker spec has unknown fields {unknown}: the router runs another version")
        model = data["model"]
        name = model.get("name")
        return cls(**{**data, "model": ModelSpec.from_params(name, {k: v for k, v in model.items() if k != "name"})})
