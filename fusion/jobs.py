"""What predict, eval and compile_only share: variant lookup, the retrying request, the job runner.

A batch job sends its requests through the router like any client. A transient failure (`busy`,
`worker_lost`, `no_worker`, `router_lost`, a timeout) is sent again with exponential backoff
(tenacity); every other error is the request's own fault and is returned at once. Before the first
attempt a sampled request without a seed gets one, so that every attempt gives the same tokens.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from tenacity import AsyncRetrying, RetryError, retry_if_exception, stop_after_attempt, wait_chain, wait_fixed

from fusion.data.files import DataError
from fusion.model_info import ModelInfo, MultiModelFusion
from fusion.progress import Progress
from routing.client import AsyncClient, RouterError
from wire import protocol as P

HDF5, JSONL = "GptHDF5MapDataProcessor", "JsonlCompletions"
PROCESSORS = (HDF5, JSONL)
# worth sending again; other errors are the request's fault
TRANSIENT = {P.BUSY, P.WORKER_LOST, P.NO_WORKER, P.ROUTER_LOST}


class Transient(RuntimeError):
    """A request that kept failing for reasons outside it (overload, lost worker, timeout)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or (isinstance(exc, RouterError) and exc.code in TRANSIENT)


async def complete(client: AsyncClient, model, prompt, retry_delays: tuple[float, ...], **params) -> dict:
    """client.complete, sent again after a transient failure (retry_delays: the wait before each retry)."""
    if params.get("seed") is None and params.get("temperature") != 0:
        params["seed"] = random.getrandbits(63)  # every attempt must sample the same tokens
    retrying = AsyncRetrying(stop=stop_after_attempt(len(retry_delays) + 1), reraise=False,
                             wait=wait_chain(*[wait_fixed(d) for d in retry_delays]) if retry_delays else wait_fixed(0),
                             retry=retry_if_exception(_transient))
    try:
        async for attempt in retrying:
            with attempt:
                return await client.complete(model, prompt, **params)
    except RetryError as exc:
        last = exc.last_attempt.exception()
        code = last.code if isinstance(last, RouterError) else "timeout"
        raise Transient(f"{last} (after {len(retry_delays) + 1} attempts)", code) from None
    raise AssertionError("unreachable: tenacity returns or raises")


def variant_groups(fusion: MultiModelFusion) -> dict[str, list[int]]:
    """Variant name -> its model IDs, in --variants order."""
    groups: dict[str, list[int]] = {}
    for mid, info in enumerate(fusion.models):
        groups.setdefault(info.name, []).append(mid)
    return groups


def variant_info(fusion: MultiModelFusion, name: str) -> ModelInfo:
    """The variant's model settings and input section."""
    return fusion.models[variant_groups(fusion)[name][0]]


def processor_name(fusion: MultiModelFusion, name: str) -> str:
    proc = variant_info(fusion, name).inference_input.get("data_processor")
    if proc not in PROCESSORS:
        raise DataError(f"variant {name!r}: inference_input.data_processor must be one of {', '.join(PROCESSORS)}, "
                        f"got {proc!r}")
    return proc


def run_jobs(frontend: str, jobs: list, progress: Progress, timeout: float = 3600,
             client_kw: dict | None = None) -> list[str]:
    """Run jobs (each with `async run(client, progress)`) concurrently over one connection to the
    router; returns the per-model summary lines."""
    async def go():
        async with AsyncClient(frontend, timeout=timeout, **(client_kw or {})) as client:
            await asyncio.gather(*[j.run(client, progress) for j in jobs])

    try:
        asyncio.run(go())
    finally:
        summary = progress.close()
    return summary


def job_totals(jobs: list) -> dict:
    totals: Counter = Counter()
    for j in jobs:
        totals.update(j.totals())
    return dict(totals)
