"""What a worker does besides plain completions, all with its model's own tokenizer: render chat
messages with the model's chat template, tokenize, detokenize, describe the tokenizer (the
`/tokenize`, `/detokenize`, `/tokenizer_info` endpoints, as vLLM serves them)."""

from __future__ import annotations

from jinja2 import TemplateError

from wire.protocol import MAX_TOKENIZE_IDS
from workers.validate import ParamError

# the tokens that end an assistant turn in the chat templates we know; those in the vocabulary stop
# a chat completion (they are special tokens, so they never appear in its text)
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>")


def message_text(content) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts only)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ParamError("messages", "messages: only text content parts are supported "
                                 "({'type': 'text', 'text': ...})")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    raise ParamError("messages", "messages: content must be a string or a list of text parts, got "
                     f"{type(content).__name__}")


def check_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ParamError("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ParamError("messages", f"messages[{i}] must be an object with a string 'role'")
        out.append({"role": m["role"], "content": message_text(m.get("content"))})
    return out


def end_of_turn_ids(tokenizer) -> list[int]:
    vocab = tokenizer.get_vocab()
    ids = [vocab[t] for t in END_OF_TURN if t in vocab]
    return sorted(set(ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()))


def chat_prompt(tokenizer, messages, model_name: str) -> list[int]:
    """Token IDs of the conversation rendered by the model's own template, ready for the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model_name!r} has no chat template; use /v1/completions with a plain prompt")
    try:
        text = tokenizer.apply_chat_template(check_messages(messages), add_generation_prompt=True, tokenize=False)
    except TemplateError as exc:  # the template's own check (`raise_exception`): the messages' fault, a 400
        raise ParamError("messages", f"model {model_name!r}'s chat template refuses these messages: {exc}") from None
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def tokenize(tokenizer, prompt, params: dict, model_name: str, max_model_len: int) -> dict:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):  # chat messages
        ids = chat_prompt(tokenizer, prompt, model_name)
    elif isinstance(prompt, str):
        add = params.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise ValueError(f"add_special_tokens must be true or false, got {add!r}")
        ids = list(tokenizer(prompt, add_special_tokens=add).input_ids)
    else:
        raise ValueError("prompt must be a string (or messages a list of {role, content} objects)")
    if len(ids) > MAX_TOKENIZE_IDS:
        raise ParamError("prompt", f"the prompt is {len(ids)} tokens; tokenize answers at most {MAX_TOKENIZE_IDS} "
                                   "(split the text)")
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}


def detokenize(tokenizer, tokens, vocab_size: int) -> dict:
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ParamError("tokens", "tokens must be a list of integer token IDs")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ParamError("tokens", f"token ID {bad} is not in the vocabulary [0, {vocab_size})")
    return {"prompt": tokenizer.decode(tokens)}


def tokenizer_info(tokenizer, model_name: str, max_model_len: int) -> dict:
    return {"model": model_name, "tokenizer_class": type(tokenizer).__name__,
            "eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token,
            "chat_template": getattr(tokenizer, "chat_template", None), "model_max_length": max_model_len,
            "vocab_size": len(tokenizer)}
