"""OpenAI request bodies, parsed here only: the gateway's bodies (prompts, messages, stream options)
into router requests. A request's parameters become the engine's SamplingParams on the worker
(workers.request_params). A bad value is an error that names its parameter."""

from __future__ import annotations

from dataclasses import dataclass

from wire.protocol import BAD_REQUEST, MAX_COPIES
from workers.request_params import MAX_LOGPROBS
from workers.validate import is_int

# keys the gateway consumes; every other key goes to the worker, which checks it and names it if unknown
_COMPLETION_OWN = {"model", "prompt", "stream", "stream_options", "echo"}
_CHAT_OWN = {"model", "messages", "stream", "stream_options", "logprobs", "top_logprobs",
             "max_completion_tokens"}
# the router client's own arguments (AsyncClient.result, .events), which a body's key passed on as a
# parameter would collide with: no OpenAI parameter, so unknown here as on the worker
_CLIENT_ARGS = {"model", "prompt", "stream", "task", "tenant"}

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


def bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=BAD_REQUEST)  # the worker's code for the same refusal


def split_prompts(prompt) -> list[str | list[int]]:
    """OpenAI's four prompt forms: a string, strings, token IDs, lists of token IDs."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(is_int(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt):
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


def passed_on(body: dict, own: set[str]) -> dict:
    """The body's parameters for the worker (which checks them): every key but those the gateway
    consumes (`own`)."""
    params = {k: v for k, v in body.items() if k not in own}
    clash = sorted(params.keys() & _CLIENT_ARGS)
    if clash:
        raise _unknown(clash[0])
    return params


def _unknown(name: str, detail: str = "") -> OpenAIError:
    return OpenAIError(400, f"unknown parameter {name!r}{detail}", param=name, code="bad_request")


def completion_job(body: dict) -> CompletionJob:
    prompts = split_prompts(body.get("prompt"))
    opts = stream_options(body)
    params = passed_on(body, _COMPLETION_OWN)
    echo = body.get("echo", False)
    if echo:
        if opts.stream:
            raise bad("echo", "echo is not supported together with stream")
        params["echo"] = echo
    lp = body.get("logprobs")
    if lp is not None and (not is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
        raise bad("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {lp!r}")
    n = body.get("n", 1)
    return CompletionJob(prompts, params, opts, n if is_int(n) and n > 0 else 1)


@dataclass(slots=True)
class ChatJob:
    messages: list
    params: dict
    stream: StreamOptions
    n: int = 1
    # the name the request gave the worker's max_tokens (chat's current name, or the older one)
    max_tokens_name: str = "max_tokens"

    def error(self, exc: OpenAIError) -> OpenAIError:
        """A refusal in the words of the request that sent it: its messages went as the prompt, and
        its max_completion_tokens as max_tokens."""
        if exc.param == "prompt":
            return OpenAIError(exc.status, exc.message, param="messages", code=exc.code, headers=exc.headers)
        if exc.param != "max_tokens" or self.max_tokens_name == "max_tokens":
            return exc
        return OpenAIError(exc.status, exc.message.replace("max_tokens", self.max_tokens_name),
                           param=self.max_tokens_name, code=exc.code, headers=exc.headers)


def chat_job(body: dict) -> ChatJob:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    opts = stream_options(body)
    params = passed_on(body, _CHAT_OWN)
    limit = body.get("max_completion_tokens")
    if limit is not None:  # chat's current name for max_tokens; it wins where both are given, as in vLLM
        if not is_int(limit) or limit < 0:
            raise bad("max_completion_tokens", f"max_completion_tokens must be an integer >= 0, got {limit!r}")
        params["max_tokens"] = limit
    want = body.get("logprobs", False)
    if not isinstance(want, bool) and want is not None:
        raise bad("logprobs", f"logprobs must be true or false, got {want!r}")
    top = body.get("top_logprobs")
    if top is not None:
        if not is_int(top) or not 0 <= top <= MAX_LOGPROBS:
            raise bad("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}")
        if not want:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    if want:
        params["logprobs"] = top or 0
    n = body.get("n", 1)
    return ChatJob(messages, params, opts, n if is_int(n) and n > 0 else 1,
                   "max_tokens" if limit is None else "max_completion_tokens")


def _model_name(body: dict) -> str:
    model = body.get("model")
    if model is None or model == "":
        raise bad("model", "model is required: the name of a variant of this deployment (see GET /v1/models)")
    if not isinstance(model, str):
        raise bad("model", f"model must be a string, the name of a variant of this deployment, got {model!r}")
    return model


def _only(body: dict, keys: tuple[str, ...], endpoint: str) -> None:
    """A key the endpoint does not take is refused (a misspelt `copies` would otherwise load one)."""
    unknown = sorted(body.keys() - set(keys))
    if unknown:
        raise _unknown(unknown[0], f": {endpoint} takes {', '.join(keys)}")


def load_args(body: dict) -> dict:
    """POST /v1/models/load's body: {model, copies (all wanted, default 1), pin (default false)};
    null is the default, as for a completion's parameters."""
    _only(body, ("model", "copies", "pin"), "/v1/models/load")
    copies = 1 if body.get("copies") is None else body["copies"]
    pin = False if body.get("pin") is None else body["pin"]
    if not is_int(copies) or copies < 1:
        raise bad("copies", f"copies must be an integer >= 1 (the copies wanted in all), got {copies!r}")
    if copies > MAX_COPIES:
        raise bad("copies", f"copies ({copies}) exceeds the limit of {MAX_COPIES} copies of a model (a worker "
                            "process each)")
    if not isinstance(pin, bool):
        raise bad("pin", f"pin must be true or false, got {pin!r}")
    return {"model": _model_name(body), "copies": copies, "pin": pin}


def unload_args(body: dict) -> dict:
    """POST /v1/models/unload's body: {model (a name, or `name:id` for one copy), copies (how many,
    highest model IDs first; default all)}."""
    _only(body, ("model", "copies"), "/v1/models/unload")
    model, copies = _model_name(body), body.get("copies")
    if copies is not None and (not is_int(copies) or copies < 1):
        raise bad("copies", f"copies must be an integer >= 1 (how many to unload) or null (all), got {copies!r}")
    return {"model": model, "copies": copies}
