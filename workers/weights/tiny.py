"""Tiny random-weight models built from transformers configs, for fast tests and benchmarks.

They exercise the same modelling code as the real checkpoints (attention variants, positional
schemes, sliding windows) at a size that runs in milliseconds on a CPU.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

# Byte-level vocabulary: 256 byte symbols plus the specials below.
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 320
# ChatML, as SmolLM2 uses it. GPT-2 gets none, like the real GPT-2: a model without a chat template.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Shared shape: small enough to be fast, big enough for GQA (4 heads over 2 KV heads).
_HIDDEN, _LAYERS, _HEADS, _KV_HEADS, _FFN, _CTX = 64, 2, 4, 2, 128, 512

TINY_CONFIGS: dict[str, dict] = {
    "gpt2": dict(model_type="gpt2", n_embd=_HIDDEN, n_layer=_LAYERS, n_head=_HEADS, n_positions=_CTX),
    "llama": dict(
        model_type="llama", hidden_size=_HIDDEN, num_hidden_layers=_LAYERS, num_attention_heads=_HEADS,
        num_key_value_heads=_KV_HEADS, intermediate_size=_FFN, max_position_embeddings=_CTX,
    ),
    "mistral": dict(
        model_type="mistral", hidden_size=_HIDDEN, num_hidden_layers=_LAYERS, num_attention_heads=_HEADS,
        num_key_value_heads=_KV_HEADS, intermediate_size=_FFN, max_position_embeddings=_CTX,
        sliding_window=48,
    ),
    "opt": dict(
        model_type="opt", hidden_size=_HIDDEN, num_hidden_layers=_LAYERS, num_attention_heads=_HEADS,
        ffn_dim=_FFN, max_position_embeddings=_CTX, word_embed_proj_dim=_HIDDEN,
    ),
    "bloom": dict(model_type="bloom", hidden_size=_HIDDEN, n_layer=_LAYERS, n_head=_HEADS),
    "gemma3": dict(
        model_type="gemma3_text", hidden_size=_HIDDEN, num_hidden_layers=4, num_attention_heads=_HEADS,
        num_key_value_heads=_KV_HEADS, head_dim=16, intermediate_size=_FFN, max_position_embeddings=_CTX,
        sliding_window=32, layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                        "full_attention"],
    ),
}
# the transformers class each loads as (known before building it: the plan and the dtype need it)
TINY_ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                      "opt": "OPTForCausalLM", "bloom": "BloomForCausalLM", "gemma3": "Gemma3ForCausalLM"}


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
