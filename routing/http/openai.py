"""OpenAI's errors over HTTP: the router's error codes as HTTP statuses, and the model a request
names resolved against the deployment's (routing/openai_requests.py parses the bodies,
routing/openai_objects.py builds the answers)."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from routing.client import RouterError
from routing.openai_requests import OpenAIError, bad
from wire import protocol as P

log = logging.getLogger("mmfusion.http")

# router error code -> HTTP status
STATUS = {P.BAD_REQUEST: 400, P.UNKNOWN_MODEL: 404, P.TOO_LARGE: 413, P.BUSY: 429, P.WORKER_LOST: 503,
          P.NO_WORKER: 503, P.ROUTER_LOST: 503, P.REFUSED: 503, P.INTERNAL: 500, "bad_reply": 502,
          P.NO_MEMORY: 507, P.CONFLICT: 409, P.UNLOADED: 503, P.NOT_SUPPORTED: 501, P.RATE_LIMITED: 429}


def from_router(code: str, message: str, param: str | None = None, retry_after: float | None = None) -> OpenAIError:
    """The HTTP error for a router error; a worker's refusal names the parameter it refuses. A 429
    says when to retry: a quota's own figure (whole seconds, rounded up), else 1."""
    status = STATUS.get(code, 500)
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)) if retry_after is not None else 1)} if status == 429 else None
    return OpenAIError(status, message, param=param, code=code, headers=headers)


def error_for(exc: Exception, request_timeout: float = 0.0) -> OpenAIError:
    """The OpenAI error object for whatever a request failed with."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RouterError):
        return from_router(exc.code, exc.message, exc.param, exc.retry_after)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return OpenAIError(504, f"no answer from the router within {request_timeout:g}s", code="timeout")
    log.exception("gateway: unexpected error")
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal")


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
    known = sorted(names | {f"{m['name']}:{m['id']}" for m in models if m["id"] is not None})
    raise OpenAIError(404, f"The model '{value}' does not exist; this deployment serves {', '.join(known)}",
                      param="model", code="model_not_found")

