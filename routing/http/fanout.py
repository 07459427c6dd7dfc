"""A request's prompts on the router. A completion may carry many prompts (lm-evaluation-harness
sends a batch of them in one request); each is a router request of its own. At most
PROMPTS_IN_FLIGHT of one request's prompts are on the router at once, the next starting as one
ends: a model's queue holds `max_queue` requests (1024 by default) and answers `busy` past it, so a
request of more prompts, sent all at once, was refused whatever the load, and no retry could help.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
PROMPTS_IN_FLIGHT = 256  # a quarter of the default queue: the engines' batches stay full, others get room


async def all_of(fn: Callable[[object], Awaitable[T]], items: Sequence, limit: int = PROMPTS_IN_FLIGHT) -> list[T]:
    """[await fn(item) for item in items], at most `limit` at once, in the items' order; a failure
    cancels the others (and so their work on the workers). fn is called only when an item's turn
    comes, so a cancelled wait leaves no coroutine unawaited."""
    if len(items) == 1:
        return [await fn(items[0])]
    gate = turns(limit)

    async def one(item):
        async with gate:
            return await fn(item)

    tasks = [asyncio.ensure_future(one(item)) for item in items]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


def turns(limit: int = PROMPTS_IN_FLIGHT) -> asyncio.Semaphore:
    """The gate a streaming request's prompts take turns through (at most `limit` at once)."""
    return asyncio.Semaphore(limit)
