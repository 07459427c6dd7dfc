"""The tiny models' shapes and classes (workers.weights.tiny builds them), without importing
transformers: the planner reads them to size a tiny model's weights and KV cache."""

from __future__ import annotations

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
    "qwen2": dict(  # q/k/v projections with biases
        model_type="qwen2", hidden_size=_HIDDEN, num_hidden_layers=_LAYERS, num_attention_heads=_HEADS,
        num_key_value_heads=_KV_HEADS, intermediate_size=_FFN, max_position_embeddings=_CTX,
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
                      "qwen2": "Qwen2ForCausalLM", "opt": "OPTForCausalLM", "bloom": "BloomForCausalLM", "gemma3": "Gemma3ForCausalLM"}
