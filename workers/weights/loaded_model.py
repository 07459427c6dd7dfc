"""A loaded model as the engine takes it: weights, tokenizer and the limits the engine needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    source: str
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    weights: Any = None  # weights.shared.WeightsInfo: bytes, and whether shared with other copies
    # weights.owner.OwnerLink: open while the model holds a weight owner's tensors (closed once
    # they are let go, so the owner can stop: Engine.close)
    owner_link: Any = None
    # workers.quant.fuse.QuantizedLinears: the linears as weight-only blocks where the model holds
    # no 16-bit weights for them (a weight owner's, or let go by the engine that built them)
    quantized: Any = None
    # only one engine runs it (a worker's, load_engine's): that engine may let go of the weights it
    # does not read, the 16-bit weights of the linears it runs as blocks
    one_engine: bool = False
    # read once: the config lookup behind it costs microseconds, and every request checks its prompt
    vocab_size: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.vocab_size = int(self.model.config.get_text_config().vocab_size)
