"""OpenAI's response objects, built here only: text completions (with `Client.complete` and the
HTTP gateway), chat completions, stream chunks and the model list, from the neutral results the
workers send (wire/protocol.py: per sample its text, token IDs, logprobs and finish reason, and
the usage). No I/O here."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field


def new_id(prefix: str) -> str:
    return f"{prefix}-{random.getrandbits(96):024x}"  # opaque and unique enough; no syscall per request


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timing: dict | None = None  # the router's {queued_s, load_s, run_s}; over several prompts, the longest of each

    def add(self, usage: dict, timing: dict | None = None) -> None:
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)
        if isinstance(timing, dict):
            self.timing = {k: max(v, (self.timing or {}).get(k, 0.0)) for k, v in timing.items()
                           if isinstance(v, (int, float))}

    def as_dict(self) -> dict:
        """OpenAI's usage, and the `timing` extension where the router timed the requests."""
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.timing is not None:
            out["timing"] = self.timing
        return out


def text_completion(result: dict, model: str, token_ids: bool = False) -> dict:
    """The `text_completion` object of one prompt's result; `token_ids`: each choice keeps its
    token IDs (the `return_token_ids` extension, which predict's HDF5 rows use)."""
    return merge_completions([result], model, 1, token_ids)


def merge_completions(results: list[dict], model: str, n: int, token_ids: bool = False) -> dict:
    """One completion object from one router answer per prompt: choice index = prompt * n + sample."""
    choices, usage = [], Usage()
    for i, r in enumerate(results):
        usage.add(r["usage"], r.get("timing"))
        for c in r["choices"]:
            c = {k: v for k, v in c.items() if token_ids or k != "token_ids"}
            c["index"] = i * n + c["index"]
            choices.append(c)
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage.as_dict()}


def model_list(models: list[dict], created: int) -> dict:
    """A variant by name (any copy; `available` when none is loaded: a request loads one), then
    each model ID as `name:id` with its state, pin, resident bytes and last use."""
    data = []
    for name in dict.fromkeys(m["name"] for m in models):
        copies = [m for m in models if m["name"] == name and m["id"] is not None]
        state = "loaded" if any(m.get("state", "loaded") == "loaded" for m in copies) else (
            copies[0]["state"] if copies else "available")
        data.append({"id": name, "object": "model", "created": created, "owned_by": "mmfusion", "root": name,
                     "parent": None, "state": state, "pinned": any(m.get("pinned") for m in models
                                                                   if m["name"] == name)})
    for m in models:
        if m["id"] is None:
            continue
        data.append({"id": f"{m['name']}:{m['id']}", "object": "model", "created": created, "owned_by": "mmfusion",
                     "root": m["name"], "parent": m["name"], "state": m.get("state", "loaded"),
                     "pinned": m.get("pinned", False), "resident_bytes": m.get("resident_bytes"),
                     "last_use": m.get("last_use")})
    return {"object": "list", "data": data}


def model_copies(change: dict, created: int) -> dict:
    """A load's or an unload's answer: the model, and its copies now as GET /v1/models lists them."""
    data = [e for e in model_list(change["copies"], created)["data"] if e["parent"] is not None]
    return {"object": "list", "model": change["model"], "data": data}


def completion_chunk(cid: str, created: int, model: str, index: int, text: str, finish_reason,
                     logprobs: dict | None = None) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(cid: str, created: int, model: str, chat: bool, usage: Usage) -> dict:
    """The last chunk of a stream that asked for its usage (stream_options.include_usage)."""
    return {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage.as_dict()}


def _chat_logprobs(block: dict | None) -> dict | None:
    if block is None:
        return None
    content = []
    tops = block.get("top_logprobs") or [None] * len(block["tokens"])
    for tok, lp, top in zip(block["tokens"], block["token_logprobs"], tops):
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode("utf-8"))}
                                         for t, v in (top or {}).items()]})
    return {"content": content}


def chat_completion(result: dict, model: str) -> dict:
    choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                "logprobs": _chat_logprobs(c.get("logprobs")), "finish_reason": c["finish_reason"]}
               for c in result["choices"]]
    usage = Usage()
    usage.add(result["usage"], result.get("timing"))
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage.as_dict()}


def chat_chunk(cid: str, created: int, model: str, index: int, delta: dict, finish_reason=None,
               logprobs: dict | None = None) -> dict:
    """`logprobs`: the chunk's tokens as the worker sends them (completion form), given in chat's."""
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": _chat_logprobs(logprobs),
                         "finish_reason": finish_reason}]}


@dataclass(slots=True)
class StreamState:
    """Per-request bookkeeping of a stream: which choices have started (chat sends the role first)."""

    id: str
    created: int
    model: str
    started: set = field(default_factory=set)
    usage: Usage = field(default_factory=Usage)
