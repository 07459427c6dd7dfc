"""OpenAI's API on top of the router's requests: parse and check request bodies, build the router
requests, and turn the router's answers (text completions) into completion, chat-completion and
stream-chunk objects. No I/O here."""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field

from routing import protocol as P

MAX_LOGPROBS = 20
# keys this module consumes; every other key goes to the worker, which checks it and names it if unknown
_COMPLETION_OWN = {"model", "prompt", "stream", "stream_options", "user", "echo"}
_CHAT_OWN = {"model", "messages", "stream", "stream_options", "user", "logprobs", "top_logprobs",
             "max_completion_tokens"}


class OpenAIError(Exception):
    """An error answered as OpenAI's error object with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
                429: "rate_limit_error"}.get(self.status, "invalid_request_error" if self.status < 500 else
                                             "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# router error code -> HTTP status
STATUS = {P.BAD_REQUEST: 400, P.UNKNOWN_MODEL: 404, P.TOO_LARGE: 413, P.BUSY: 429, P.WORKER_LOST: 503,
          P.NO_WORKER: 503, P.ROUTER_LOST: 503, P.REFUSED: 503, P.INTERNAL: 500, "bad_reply": 502}


def from_router(code: str, message: str, params=()) -> OpenAIError:
    """The HTTP error for a router error; a 400 names the first of the request's `params` that its
    message mentions (the workers' messages name the parameter they refuse)."""
    status = STATUS.get(code, 500)
    headers = {"Retry-After": "1"} if status == 429 else None
    param = next((k for k in params if re.search(rf"\b{re.escape(k)}\b", message)), None) if status == 400 else None
    return OpenAIError(status, message, param=param, code=code, headers=headers)


def bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_parameter")


@dataclass(slots=True)
class Target:
    """Where a request goes: the router's `model` (a name, or an integer model ID) and the name the
    response carries."""

    router_model: str | int
    name: str


def resolve_model(value, models: list[dict], default: str | None = None) -> Target:
    """`name` (any copy) or `name:id` (that copy). 404 naming what exists, like the router."""
    if value is None:
        value = default
    if not isinstance(value, str) or not value:
        raise bad("model", "model is required: a variant name or <name>:<model id> (see GET /v1/models)")
    names = {m["name"] for m in models}
    if value in names:
        return Target(value, value)
    name, sep, mid = value.rpartition(":")
    if sep and mid.isdigit() and any(m["id"] == int(mid) and m["name"] == name for m in models):
        return Target(int(mid), value)
    known = sorted(names | {f"{m['name']}:{m['id']}" for m in models})
    raise OpenAIError(404, f"The model '{value}' does not exist; this deployment serves {', '.join(known)}",
                      param="model", code="model_not_found")


def model_list(models: list[dict], created: int) -> dict:
    data = []
    for name in dict.fromkeys(m["name"] for m in models):
        data.append({"id": name, "object": "model", "created": created, "owned_by": "mmfusion", "root": name,
                     "parent": None})
    for m in models:
        data.append({"id": f"{m['name']}:{m['id']}", "object": "model", "created": created, "owned_by": "mmfusion",
                     "root": m["name"], "parent": m["name"]})
    return {"object": "list", "data": data}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def split_prompts(prompt) -> list[str | list[int]]:
    """OpenAI's four prompt forms: a string, strings, token IDs, lists of token IDs."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_int(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return list(prompt)
    raise bad("prompt", "prompt must be a string, a list of strings, a list of token IDs or a list of "
                        "token-ID lists, and not empty")


@dataclass(slots=True)
class StreamOptions:
    stream: bool = False
    include_usage: bool = False


def stream_options(body: dict) -> StreamOptions:
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad("stream", f"stream must be true or false, got {stream!r}")
    opts = body.get("stream_options")
    if opts is None:
        return StreamOptions(bool(stream))
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise bad("stream_options", "stream_options must be an object like {\"include_usage\": true}")
    if not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    return StreamOptions(True, opts.get("include_usage", False))


@dataclass(slots=True)
class CompletionJob:
    prompts: list
    params: dict  # for the worker (sampling_params checks them)
    stream: StreamOptions
    n: int = 1


def completion_job(body: dict) -> CompletionJob:
    prompts = split_prompts(body.get("prompt"))
    opts = stream_options(body)
    params = {k: v for k, v in body.items() if k not in _COMPLETION_OWN}
    echo = body.get("echo", False)
    if echo:
        if opts.stream:
            raise bad("echo", "echo is not supported together with stream")
        params["echo"] = echo
    lp = body.get("logprobs")
    if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
        raise bad("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {lp!r}")
    if lp is not None and opts.stream:
        raise bad("logprobs", "logprobs is not supported together with stream")
    n = body.get("n", 1)
    return CompletionJob(prompts, params, opts, n if _is_int(n) and n > 0 else 1)


@dataclass(slots=True)
class ChatJob:
    messages: list
    params: dict
    stream: StreamOptions
    n: int = 1


def chat_job(body: dict) -> ChatJob:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    opts = stream_options(body)
    params = {k: v for k, v in body.items() if k not in _CHAT_OWN}
    if body.get("max_completion_tokens") is not None:
        params["max_tokens"] = body["max_completion_tokens"]
    want = body.get("logprobs", False)
    if not isinstance(want, bool) and want is not None:
        raise bad("logprobs", f"logprobs must be true or false, got {want!r}")
    top = body.get("top_logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
            raise bad("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}")
        if not want:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    if want:
        if opts.stream:
            raise bad("logprobs", "logprobs is not supported together with stream")
        params["logprobs"] = top or 0
    n = body.get("n", 1)
    return ChatJob(messages, params, opts, n if _is_int(n) and n > 0 else 1)


# --- responses --------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{random.getrandbits(96):024x}"  # opaque and unique enough; no syscall per request


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, usage: dict) -> None:
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def merge_completions(results: list[dict], model: str, n: int) -> dict:
    """One completion object from one router answer per prompt: choice index = prompt * n + sample."""
    choices, usage = [], Usage()
    for i, r in enumerate(results):
        usage.add(r["usage"])
        for c in r["choices"]:
            c = {k: v for k, v in c.items() if k != "token_ids"}
            c["index"] = i * n + c["index"]
            choices.append(c)
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage.as_dict()}


def completion_chunk(cid: str, created: int, model: str, index: int, text: str, finish_reason) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(cid: str, created: int, model: str, obj: str, usage: Usage) -> dict:
    return {"id": cid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage.as_dict()}


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
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": result["usage"]}


def chat_chunk(cid: str, created: int, model: str, index: int, delta: dict, finish_reason=None) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


@dataclass(slots=True)
class StreamState:
    """Per-request bookkeeping of a stream: which choices have started (chat sends the role first)."""

    id: str
    created: int
    model: str
    started: set = field(default_factory=set)
    usage: Usage = field(default_factory=Usage)
