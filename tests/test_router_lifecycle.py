"""Router behaviour over time: queueing before workers are up, busy, dead workers, cancel, restart."""

from __future__ import annotations

import subprocess
import time

import pytest
from support.cluster import ROOT, one_worker, start_router, start_worker, wait_for, wait_loaded

from routing.client import Client, RouterError
from routing.entrypoints import CLIENT, command
from routing.router import ModelEntry, Router, RouterConfig
from wire import protocol as P
from workers.spec import ModelSpec


def test_queue_until_workers_are_up_then_busy():
    router, thread = start_router(max_queue=2)
    worker = None
    try:
        with Client(router.frontend_addr, timeout=60) as a, Client(router.frontend_addr, timeout=60) as b, \
                Client(router.frontend_addr, timeout=10) as c:
            a.sock.send(P.pack({"type": P.COMPLETE, "id": "q1", "model": "llama", "prompt": [1, 2], "params": {}}))
            b.sock.send(P.pack({"type": P.COMPLETE, "id": "q2", "model": "llama", "prompt": [3, 4], "params": {}}))
            wait_for(lambda: c.status()["queued"]["0"] == 2)
            with pytest.raises(RouterError) as info:
                c.complete(model="llama", prompt=[5], max_tokens=1)
            assert info.value.code == P.BUSY
            worker = start_worker(router.backend_addr)  # the queued requests are served once it loads
            assert a.recv(time.monotonic() + 60)["type"] == P.RESULT
            assert b.recv(time.monotonic() + 60)["type"] == P.RESULT
    finally:
        router.stop()
        thread.join(10)
        if worker:
            worker.wait(10)


def test_dead_worker_is_dropped_and_cancel_frees_the_slot():
    with one_worker() as (router, worker, c):
        stream = c.stream(model="llama", prompt=[1, 2, 3], max_tokens=400, ignore_eos=True)
        next(stream)
        stream.close()  # the client gives up: a cancel reaches the worker and frees its slot
        wait_for(lambda: c.status()["workers"][0]["inflight"] == 0 and c.status()["pending"] == 0)
        wait_for(lambda: c.status()["workers"][0]["engine"].get("aborted") == 1, timeout=10)  # slot freed
        assert c.complete(model="llama", prompt=[4], max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2
        worker.kill()
        worker.wait()
        wait_for(lambda: not c.status()["workers"][0]["alive"], timeout=10)
        assert c.models()[0]["workers"] == []


def test_a_second_router_on_a_taken_address_says_which_and_what_to_do():
    entry = [ModelEntry(0, "x", ModelSpec("x", "tiny:llama"))]
    first = Router(entry, RouterConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*"))
    try:
        taken = first.frontend_addr
        with pytest.raises(RuntimeError, match=f"cannot bind {taken}: the address is in use.*--frontend"):
            Router(entry, RouterConfig(frontend=taken, backend="tcp://127.0.0.1:*"))
    finally:
        first.shutdown()


def test_worker_reconnects_after_router_restart():
    probe = Router([ModelEntry(0, "x", ModelSpec("x", "tiny:llama"))], RouterConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*"))
    backend = probe.backend_addr
    probe.shutdown()
    router, thread = start_router(backend=backend)
    worker = start_worker(backend)
    try:
        with Client(router.frontend_addr, timeout=60) as c:
            wait_loaded(c)
        router.stop(release_workers=False)  # as if the router crashed: nobody tells the worker
        thread.join(10)
        router, thread = start_router(backend=backend)  # same backend address, fresh state
        with Client(router.frontend_addr, timeout=60) as c:
            wait_loaded(c, timeout=30)
            assert c.complete(model="llama", prompt=[1, 2], max_tokens=2)["choices"]
    finally:
        router.stop()
        thread.join(10)
        worker.wait(10)


def test_client_cli():
    with one_worker() as (router, _, _):
        out = subprocess.run([*command(CLIENT), "--router", router.frontend_addr, "--model",
                              "llama", "--max-tokens", "4", "Hello"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and out.stdout.startswith("Hello")
        bad = subprocess.run([*command(CLIENT), "--router", router.frontend_addr, "--model",
                              "nope", "Hello"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "unknown_model" in bad.stderr


def test_async_client_hands_a_turns_requests_over_together():
    """Requests made in one event-loop turn reach zmq together on the next; one dropped before
    that (its caller gave up) never reaches the router, and the others are answered."""
    import asyncio

    from routing.client import AsyncClient

    with one_worker() as (router, worker, c):
        served = c.status()["workers"][0]["served"]

        async def go():
            async with AsyncClient(router.frontend_addr, timeout=60) as ac:
                tasks = [asyncio.ensure_future(ac.complete("llama", [1, 2, i], max_tokens=2, temperature=0))
                         for i in range(8)]
                await asyncio.sleep(0)  # each task has queued its request; the hand-over is due next turn
                queued = list(ac._sender.outbox)
                assert len(queued) == 8
                ac._sender.cancel(queued[0])  # as a timeout does: taken out unsent, no CANCEL to send
                results = await asyncio.gather(*tasks[1:])
                assert not ac._sender.outbox
                tasks[0].cancel()  # it waited for an answer that never comes
                return results

        results = asyncio.run(go())
        assert len(results) == 7
        assert all(r["usage"]["completion_tokens"] == 2 for r in results)
        wait_for(lambda: c.status()["workers"][0]["served"] == served + 7, 10)
        time.sleep(0.3)
        assert c.status()["workers"][0]["served"] == served + 7  # the dropped one was never sent
