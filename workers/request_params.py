"""A request's OpenAI-style parameters as the engine's SamplingParams, parsed on the worker. A bad
value raises ParamError naming its key (the gateway checks only what it consumes itself:
routing.openai_requests)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from wire.protocol import MAX_SAMPLES
from workers.validate import ParamError, is_int

if TYPE_CHECKING:
    from workers.engine.params import SamplingParams

MAX_LOGPROBS = 20
# OpenAI parameter -> SamplingParams field (vLLM's extensions: top_k, stop_token_ids, ignore_eos,
# repetition_penalty, min_tokens)
DIRECT = {"max_tokens", "temperature", "top_p", "top_k", "n", "best_of", "seed", "stop", "stop_token_ids",
          "ignore_eos", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"}
HANDLED = DIRECT | {"logprobs", "echo"}
# no effect on sampling: routing and bookkeeping fields (return_token_ids is the clients': their
# OpenAI object then keeps each choice's token_ids)
# (parallel_tool_calls: either value means nothing without tools)
IGNORED = {"user", "stream", "model", "engine", "prompt", "return_token_ids", "parallel_tool_calls"}
# OpenAI parameters not implemented: accepted only at their no-op value (clients and SDKs send them
# so), refused otherwise, never ignored: an answer that is not the JSON or the tool call asked for
# would pass for one (no guided decoding, no tool calling)
UNSUPPORTED = {"suffix": "", "response_format": {"type": "text"}, "tools": [], "functions": [], "tool_choice": "none",
               "function_call": "none"}


def sampling_params(req: dict, defaults: dict | None = None) -> tuple[SamplingParams, bool]:
    """SamplingParams and `echo` from OpenAI-style parameters (a router request's, over `defaults`).
    A bad value raises ParamError naming its key."""
    # here, not at the top: the gateway imports MAX_LOGPROBS from this module and never loads the engine
    from workers.engine.params import SamplingParams

    merged = dict(defaults or {})
    # null is "not given" (clients send it for fields left unset): the deployment's default holds
    merged.update({k: v for k, v in req.items() if v is not None})
    unknown = sorted((set(merged) | set(req)) - HANDLED - IGNORED - set(UNSUPPORTED))
    if unknown:
        raise ParamError(unknown[0], f"unknown parameter {unknown[0]!r}")
    for key, noop in UNSUPPORTED.items():
        if merged.get(key) not in (None, noop):
            raise ParamError(key, f"{key} is not supported by this server (got {merged[key]!r}); leave it out or "
                             f"set it to {noop!r}")
    kw = {k: merged[k] for k in DIRECT if merged.get(k) is not None}
    lp = merged.get("logprobs")
    if lp is not None:
        if not is_int(lp) or not 0 <= lp <= MAX_LOGPROBS:
            raise ParamError("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {lp!r}")
        kw["logprobs"] = lp
    echo = merged.get("echo", False)
    if not isinstance(echo, bool):
        raise ParamError("echo", f"echo must be true or false, got {echo!r}")
    if not isinstance(merged.get("return_token_ids", False), bool):
        raise ParamError("return_token_ids", f"return_token_ids must be true or false, got {merged['return_token_ids']!r}")
    if not isinstance(merged.get("parallel_tool_calls", False), bool):
        raise ParamError("parallel_tool_calls", "parallel_tool_calls must be true or false, got "
                         f"{merged['parallel_tool_calls']!r}")
    if merged.get("user") is not None and not isinstance(merged["user"], str):
        raise ParamError("user", f"user must be a string (an end user's ID), got {type(merged['user']).__name__}")
    if echo and lp is not None:
        kw["prompt_logprobs"] = lp
    params = SamplingParams(**kw)
    if params.num_samples > MAX_SAMPLES:  # a stream's chunk names each sample's count in its header
        name = "best_of" if params.best_of else "n"
        raise ParamError(name, f"{name} ({params.num_samples}) exceeds the limit of {MAX_SAMPLES} samples a request")
    return params, echo
