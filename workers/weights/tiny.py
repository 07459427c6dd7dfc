"""Tiny random-weight models built from transformers configs, for fast tests and benchmarks.

They exercise the same modelling code as the real checkpoints (attention variants, positional
schemes, sliding windows) at a size that runs in milliseconds on a CPU.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from workers.weights.tiny_configs import TINY_CONFIGS
from workers.weights.tiny_tokenizer import tiny_tokenizer

# Byte-level vocabulary (workers.weights.tiny_tokenizer): 256 byte symbols plus its specials.
TINY_VOCAB = 320


def build_tiny(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Return (model, tokenizer) for a random-weight model of architecture `arch`."""
    tok = tiny_tokenizer(arch)
    kwargs = dict(TINY_CONFIGS[arch])
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(
        model_type, vocab_size=TINY_VOCAB, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **kwargs,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), tok
