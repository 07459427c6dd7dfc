"""Server-sent events for the gateway's streaming completions: every prompt's router stream merged,
as OpenAI chunks (completion or chat), with time-to-first-token and inter-token latency recorded.
The first event is awaited before answering, so that a request the worker refuses gets its HTTP
error status; later failures are an error event, then [DONE]. Closing the connection cancels
every part of the stream on the workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

from starlette.responses import JSONResponse, Response, StreamingResponse

from routing.client import AsyncClient
from routing.http import openai as O
from routing.http.fanout import turns
from routing.http.metrics import Metrics
from routing.openai_objects import StreamState, chat_chunk, completion_chunk, new_id, usage_chunk
from wire import protocol as P

SSE_DONE = b"data: [DONE]\n\n"


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def stream_response(client: AsyncClient, metrics: Metrics, error_response: Callable[[Exception], JSONResponse],
                          target: O.Target, prompts: list, params: dict, n: int, include_usage: bool, task: str,
                          t0: float, tenant: str | None = None) -> Response:
    """The SSE response of a streaming request of `prompts` (n samples each) to `target`, for `tenant`."""
    chat = task == P.CHAT
    state = StreamState(new_id("chatcmpl" if chat else "cmpl"), int(time.time()), target.name)
    events = merged_events(client, target, prompts, params, task, tenant)
    try:
        first = await events.__anext__()
    except BaseException:
        await events.aclose()
        raise
    return StreamingResponse(sse(events, first, state, n, include_usage, chat, t0, metrics, error_response),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def merged_events(client: AsyncClient, target: O.Target, prompts: list, params: dict, task: str,
                        tenant: str | None = None):
    """(prompt index, router message) of every prompt's stream, as they come."""
    if len(prompts) == 1:  # the common case: no pump task, no queue between the two
        async with contextlib.aclosing(client.events(target.router_model, prompts[0], True, task, tenant=tenant, **params)) as msgs:
            async for msg in msgs:
                yield 0, msg
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    gate = turns()  # the prompts take turns on the router (routing/http/fanout.py)

    async def pump(i, prompt):
        try:
            async with gate:
                async for msg in client.events(target.router_model, prompt, True, task, tenant=tenant, **params):
                    await queue.put((i, msg))
            await queue.put((i, done))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which reports it
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def sse(events, first, state: StreamState, n: int, include_usage: bool, chat: bool, t0: float,
              m: Metrics, error_response: Callable[[Exception], JSONResponse]):
    model = state.model
    last = None
    try:
        pending = [first]
        while True:
            i, msg = pending.pop() if pending else await events.__anext__()
            if msg["type"] == P.RESULT:
                state.usage.add(msg["response"]["usage"], msg.get("timing"))
                continue
            now = time.perf_counter()
            for out in msg["outputs"]:
                index = i * n + out["index"]
                if out["token_ids"]:
                    if last is None:
                        m.child(m.ttft, model).observe(now - t0)
                    else:
                        m.child(m.itl, model).observe((now - last) / len(out["token_ids"]))
                    last = now
                logprobs = out.get("logprobs")  # asked for: the chunk's tokens (text may be held back)
                if chat:
                    if index not in state.started:
                        state.started.add(index)
                        yield _sse(chat_chunk(state.id, state.created, model, index,
                                              {"role": "assistant", "content": ""}))
                    if out["text"] or logprobs:
                        yield _sse(chat_chunk(state.id, state.created, model, index, {"content": out["text"]},
                                              logprobs=logprobs))
                    if out["finish_reason"]:
                        yield _sse(chat_chunk(state.id, state.created, model, index, {}, out["finish_reason"]))
                elif out["text"] or out["finish_reason"] or logprobs:
                    yield _sse(completion_chunk(state.id, state.created, model, index, out["text"],
                                                out["finish_reason"], logprobs))
    except StopAsyncIteration:
        if include_usage:
            yield _sse(usage_chunk(state.id, state.created, model, chat, state.usage))
        m.observe_usage(model, state.usage.as_dict())
    except Exception as exc:  # noqa: BLE001 - a stream that fails part-way: an error event, then [DONE]
        resp = error_response(exc)
        m.child(m.requests, model, "stream", str(resp.status_code)).inc()
        yield b"data: " + resp.body + b"\n\n"
    finally:
        await events.aclose()
        m.child(m.e2e, model).observe(time.perf_counter() - t0)
    yield SSE_DONE
