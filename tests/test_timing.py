"""Each result says how long it queued, waited for a load and ran: the router's figures on a fake
clock (no sockets), the field added to a result without decoding it, and the figures through the
HTTP gateway (headers and the usage extension) in test_http.py."""

from __future__ import annotations

import msgpack
import pytest

from routing.dispatch import FRONT, Dispatch, ModelEntry, RouterConfig
from tests.test_dispatch import ready, worker_requests
from wire import protocol as P
from workers.spec import ModelSpec, WorkerSpec

A = ModelSpec("a", "tiny:llama")


def results(d: Dispatch) -> list[dict]:
    return [msgpack.unpackb(s.frames[1], raw=False) for s in d.take() if s.side == FRONT]


def ask(d: Dispatch, rid: str, now: float) -> None:
    d.client(b"c", P.pack({"type": P.COMPLETE, "id": rid, "model": "a", "prompt": [1], "params": {}}), now)


def answer(d: Dispatch, ident: bytes, key: str, now: float) -> dict:
    d.worker_data(ident, P.header(P.RESULT, key, 3), P.pack({"type": P.RESULT, "id": "?", "response": {"x": 1}}), now)
    (msg,) = [m for m in results(d) if m["type"] == P.RESULT]
    assert msg["response"] == {"x": 1}  # the worker's body is kept as it was
    return msg["timing"]


def test_a_request_that_waits_for_a_load_then_for_a_slot():
    d = Dispatch([ModelEntry(0, "a", A)], RouterConfig(max_inflight=1), [WorkerSpec(A, 0)])
    ready(d, b"w", now=0.0, loaded=False)  # registered, still loading its model
    ask(d, "r1", now=1.0)
    ask(d, "r2", now=2.0)
    d.worker(b"w", P.pack({"type": P.LOADED}), 4.0)  # r1 goes at once; r2 waits for r1's slot
    ((_, k1, _),) = worker_requests([(s.side, s.frames[0], [msgpack.unpackb(f, raw=False) for f in s.frames[1:]])
                                     for s in d.take()])
    assert answer(d, b"w", k1, 6.5) == {"queued_s": 0.0, "load_s": 3.0, "run_s": 2.5}
    (k2,) = d.workers[b"w"].inflight
    assert answer(d, b"w", k2, 7.0) == {"queued_s": 2.5, "load_s": 2.0, "run_s": 0.5}
    ask(d, "r3", now=8.0)  # a loaded copy with room: straight to the worker
    (k3,) = d.workers[b"w"].inflight
    assert answer(d, b"w", k3, 8.25) == {"queued_s": 0.0, "load_s": 0.0, "run_s": 0.25}


@pytest.mark.parametrize("count", [0, 3, 14, 15, 16, 70000])
def test_a_field_is_added_to_a_map_without_decoding_it(count):
    msg = {f"k{i}": [i, "v" * (i % 7)] for i in range(count)}
    out = msgpack.unpackb(P.with_field(msgpack.packb(msg), "timing", {"run_s": 1.5}), raw=False)
    assert out == {**msg, "timing": {"run_s": 1.5}}
    with pytest.raises(P.ProtocolError):
        P.with_field(msgpack.packb([1, 2]), "timing", {})


@pytest.mark.parametrize("values", [(0.0, 0.0, 0.0), (2.5, 1e-06, 123456.789012), (0.1, 3.0, 1e300)])
def test_the_timing_entry_is_the_bytes_with_field_writes(values):
    body = msgpack.packb({"type": P.RESULT, "id": "x", "response": {"choices": []}})
    timing = dict(zip(("queued_s", "load_s", "run_s"), values))
    assert P.with_timing(body, *values) == P.with_field(body, "timing", timing)
    assert msgpack.unpackb(P.with_timing(body, *values), raw=False)["timing"] == timing
