"""Faults: a worker killed mid-request, a router restarted under a client, crashed workers restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.cluster import (
    engine_reference,
    one_worker,
    run_stream,
    start_router,
    start_worker,
    wait_for,
)

from routing.client import AsyncClient, Client, RouterError
from wire import protocol as P


def test_worker_killed_mid_stream_is_redispatched_without_duplicates():
    router, thread = start_router()
    workers = [start_worker(router.backend_addr) for _ in range(2)]
    try:
        with Client(router.frontend_addr, timeout=60) as c:
            wait_for(lambda: sum(w["loaded"] for w in c.status()["workers"]) == 2)
            prompts = [[(i * 11 + j) % 250 + 1 for j in range(4 + i)] for i in range(8)]
            # greedy, seeded, and unseeded sampling (the router fixes a stream's seed for a resend)
            params = [dict(max_tokens=300, ignore_eos=True, temperature=0.0 if i % 3 == 0 else 0.9,
                           seed=i if i % 3 == 1 else None) for i in range(8)]
            started = [threading.Event() for _ in range(8)]
            with ThreadPoolExecutor(8) as pool:
                futs = [pool.submit(run_stream, router.frontend_addr, prompts[i], started[i], **params[i])
                        for i in range(8)]
                for ev in started:
                    assert ev.wait(60)
                st = c.status()["workers"]
                victim = max(st, key=lambda w: w["inflight"])
                assert victim["inflight"] > 0
                os.kill(victim["pid"], signal.SIGKILL)
                got = [f.result(timeout=120) for f in futs]
            st = c.status()
            assert st["resent"] == victim["inflight"]
            assert [w["alive"] for w in st["workers"] if w["id"] == victim["id"]] == [False]  # status shows it
            for i, g in enumerate(got):
                choice = g["response"]["choices"][0]
                assert g["tokens"] == choice["token_ids"] and len(g["tokens"]) == 300  # nothing twice, nothing lost
                assert g["text"] == choice["text"]
                if params[i]["seed"] is not None or params[i]["temperature"] == 0.0:
                    assert g["tokens"] == engine_reference("llama", prompts[i], **params[i])
            # a restarted worker registers again and takes back a model ID
            workers.append(start_worker(router.backend_addr))
            wait_for(lambda: sum(w["alive"] and w["loaded"] for w in c.status()["workers"]) == 2)
            assert len(c.models()[0]["workers"]) == 2
    finally:
        router.stop()
        thread.join(10)
        for w in workers:
            w.kill()
            w.wait()


def test_no_replica_left_gives_worker_lost_at_once():
    with one_worker() as (router, worker, c):
        started = threading.Event()
        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(run_stream, router.frontend_addr, [1, 2, 3 + i], started, max_tokens=480,
                                ignore_eos=True, temperature=0.0) for i in range(4)]
            assert started.wait(60)
            worker.kill()
            killed = time.monotonic()
            for f in futs:
                with pytest.raises(RouterError) as info:
                    f.result(timeout=30)
                assert info.value.code == P.WORKER_LOST and "no other live worker" in str(info.value)
        # liveness is 6 heartbeats of 0.2 s: the errors come right after, not at a client timeout
        assert time.monotonic() - killed < 5
        assert c.status()["pending"] == 0


def test_client_timeout_reaches_the_worker_and_frees_the_slot():
    with one_worker() as (router, _, c):
        # 8 samples of 480 tokens take about 0.3 s in-process on a fast CPU: a third of that times out
        with Client(router.frontend_addr, timeout=0.1) as impatient:
            with pytest.raises(TimeoutError):
                impatient.complete("llama", [1, 2, 3], max_tokens=480, ignore_eos=True, n=8)
        # the cancel reached the engine while the request ran (it was aborted, not finished)
        wait_for(lambda: c.status()["workers"][0]["engine"].get("aborted") == 1, timeout=10)
        wait_for(lambda: c.status()["workers"][0]["engine"]["running"] == 0 and c.status()["pending"] == 0)
        assert c.complete("llama", [4, 5], max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2


def test_async_client_timeout_reaches_the_worker_and_frees_the_slot():
    """AsyncClient's timeouts come from one sweep timer for all requests: a wait past it fails
    on time, only that request, and its cancel reaches the engine."""
    async def go(address):
        # 7 samples of 480 tokens (one slot left for the quick request) take about 0.25 s on a fast CPU
        async with AsyncClient(address, timeout=0.15) as ac:
            quick = asyncio.ensure_future(ac.complete("llama", [1, 2], max_tokens=2, ignore_eos=True))
            t = time.monotonic()
            with pytest.raises(TimeoutError):
                await ac.complete("llama", [1, 2, 3], max_tokens=480, ignore_eos=True, n=7)
            waited = time.monotonic() - t
            return waited, (await quick)["usage"]["completion_tokens"], ac._queues

    with one_worker() as (router, _, c):
        c.complete("llama", [1, 2], max_tokens=2)  # the first step's one-off set-up, outside the timeouts
        waited, quick_tokens, left = asyncio.run(go(router.frontend_addr))
        assert 0.15 <= waited < 0.75 and quick_tokens == 2 and not left
        wait_for(lambda: c.status()["workers"][0]["engine"].get("aborted") == 1, timeout=10)
        wait_for(lambda: c.status()["workers"][0]["engine"]["running"] == 0 and c.status()["pending"] == 0)


def test_router_restart_fails_in_flight_at_once_and_serves_new_requests():
    router, thread = start_router()
    backend, front = router.backend_addr, router.frontend_addr  # the restarted router binds these again
    worker = start_worker(backend)
    try:
        with Client(front, timeout=60) as c:
            wait_for(lambda: c.status()["workers"] and c.status()["workers"][0]["loaded"])
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(run_stream, front, [5, 6, 7], started, max_tokens=480, ignore_eos=True)
            assert started.wait(60)
            router.stop(release_workers=False)  # as if the router crashed
            stopped = time.monotonic()
            with pytest.raises(RouterError) as info:
                fut.result(timeout=30)
            assert info.value.code == P.ROUTER_LOST and time.monotonic() - stopped < 5
        thread.join(10)
        router, thread = start_router(backend=backend, frontend=front)  # same addresses, fresh state
        t0 = time.monotonic()
        with Client(front, timeout=60) as c:
            wait_for(lambda: c.status()["workers"] and c.status()["workers"][0]["loaded"], timeout=30)
            assert c.complete(model="llama", prompt=[1, 2], max_tokens=2)["choices"]
        assert time.monotonic() - t0 < 15  # the worker reconnected with its capped backoff
    finally:
        router.stop()
        thread.join(10)
        worker.wait(10)


