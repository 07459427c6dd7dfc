"""Tiny random-weight models built from transformers configs, for fast tests and benchmarks.

They exercise the same modelling code as the real checkpoints (attention variants, positional
schemes, sliding windows) at a size that runs in milliseconds on a CPU.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from workers.weights.tiny_configs import TINY_CONFIGS

# Byte-level vocabulary: 256 byte symbols plus the specials below.
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 320
# ChatML, as SmolLM2 uses it. GPT-2 gets none, like the real GPT-2: a model without a chat template.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")



def byte_tokenizer(chat: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with no merges: every byte is a token, built offline."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for tok in SPECIALS:
        vocab[tok] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=SPECIALS[0], pad_token=SPECIALS[1])
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Return (model, tokenizer) for a random-weight model of architecture `arch`."""
    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(TINY_CONFIGS)}")
    tok = byte_tokenizer(chat=arch != "gpt2")
    kwargs = dict(TINY_CONFIGS[arch])
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(
        model_type, vocab_size=TINY_VOCAB, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **kwargs,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), tok
