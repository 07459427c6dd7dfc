"""Request and response bodies of the HTTP gateway as plain ASGI: a JSON body read within a size
limit (413 past it), and a JSON answer without a Response object."""

from __future__ import annotations

import asyncio
import json

from routing.openai_requests import OpenAIError
from wire.protocol import printable, text_error, unencodable

BODY_IDLE_SECONDS = 60.0  # as nginx's client_body_timeout: the longest wait for the next part of a body


def parse_body(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise OpenAIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    except RecursionError:  # arrays or objects nested past the parser's depth (a few thousand)
        raise OpenAIError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, f"the body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    # JSON's escapes can spell half of a UTF-16 pair ("\\ud800"), which no later step can encode:
    # refused here, by where it is, before any echo of it (an error naming the model) or its send
    found = unencodable(data) if b"\\u" in body else None
    if found is not None:
        path, text = found
        raise OpenAIError(400, f"malformed JSON body: {text_error(path, text)}", param=printable(path[0]),
                          code="invalid_json")
    return data


async def read_body(scope, receive, limit: int, idle: float = BODY_IDLE_SECONDS) -> bytes:
    """The request body, at most `limit` bytes (413 past it, from Content-Length when it says so);
    408 where none of it arrives for `idle` seconds (uvicorn waits for a body without limit, so a
    client that stops half-way, or promises more than it sends, held its connection for ever)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            if value.isdigit() and int(value) > limit:
                raise OpenAIError(413, f"request body of {value.decode()} bytes exceeds the limit of {limit}",
                                    code="too_large")
            break
    body = b""
    while True:
        try:
            msg = await asyncio.wait_for(receive(), idle)
        except TimeoutError:
            raise OpenAIError(408, f"the request body stopped arriving: nothing for {idle:g} s after "
                                   f"{len(body)} bytes", code="timeout") from None
        if msg["type"] == "http.disconnect":
            raise ClientGone()
        body += msg.get("body", b"")
        if len(body) > limit:
            raise OpenAIError(413, f"request body exceeds the limit of {limit} bytes", code="too_large")
        if not msg.get("more_body", False):
            return body


JSON_HEADERS = (b"content-type", b"application/json")


async def send_json(send, obj, headers: dict[str, str] | None = None) -> None:
    """A 200 JSON response in two ASGI messages, without a Response object (the hot path's answer)."""
    body = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": 200,
                "headers": [JSON_HEADERS, (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def read_json(scope, receive, limit: int, idle: float = BODY_IDLE_SECONDS) -> dict:
    """The body as a JSON object."""
    return parse_body(await read_body(scope, receive, limit, idle))
