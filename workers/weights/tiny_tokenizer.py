"""The tiny models' tokenizer (workers.weights.tiny), without torch: a byte-level BPE with no
merges, so every byte is a token. Building it takes transformers' tokenizer classes only, so the
data tools (fusion.data.prepare) tokenize for a tiny model in a moment."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from workers.weights.tiny_configs import TINY_CONFIGS

# Byte-level vocabulary: 256 byte symbols plus the specials below.
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
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


def tiny_tokenizer(arch: str) -> PreTrainedTokenizerFast:
    """The tokenizer of tiny model `arch`; a ValueError names the architectures there are."""
    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(TINY_CONFIGS)}")
    return byte_tokenizer(chat=arch != "gpt2")
