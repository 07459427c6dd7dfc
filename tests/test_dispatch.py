"""The router's dispatch state driven directly: no sockets, a fake clock, every decision checked."""

from __future__ import annotations

import pytest
from support.dispatch import sent

from routing.dispatch import BACK, FRONT, Dispatch, ModelEntry, RouterConfig
from wire import protocol as P
from workers.spec import ModelSpec, WorkerSpec

A, B = ModelSpec("a", "tiny:llama"), ModelSpec("b", "tiny:gpt2")
PLANNED = [WorkerSpec(A, 0, "cuda:0"), WorkerSpec(B, 1, "cuda:1"), WorkerSpec(A, 0, "cuda:1")]


def make(**cfg) -> Dispatch:
    models = [ModelEntry(0, "a", A), ModelEntry(1, "b", B)]
    return Dispatch(models, RouterConfig(heartbeat_interval=0.5, liveness=4, **cfg), PLANNED)


def ready(d: Dispatch, ident: bytes, now: float = 0.0, slot: int | None = None, loaded: bool = True) -> dict:
    d.worker(ident, P.pack({"type": P.READY, "capabilities": {"pid": hash(ident) % 1000, "host": "h", "slot": slot}}),
             now)
    assign = next(P.unpack(s.frames[1], {P.ASSIGN}) for s in d.take() if s.frames[0] == ident)
    if loaded:
        d.worker(ident, P.pack({"type": P.LOADED}), now)
    return assign


def request(d: Dispatch, client: bytes, rid: str, model="a", now: float = 0.0, **params) -> None:
    d.client(client, P.pack({"type": P.COMPLETE, "id": rid, "model": model, "prompt": [1, 2], "params": params}), now)


def worker_requests(out) -> list[tuple[bytes, str, dict]]:
    return [(peer, f[0][1], f[1]) for side, peer, f in out if side == BACK and len(f) == 2 and f[0][0] == P.REQUEST]


def client_errors(out) -> list[dict]:
    return [f[0] for side, _, f in out if side == FRONT and f[0].get("type") == P.ERROR]


def test_keys_carry_an_epoch_new_for_every_router():
    d1, d2 = make(), make()
    ready(d1, b"w")
    ready(d2, b"w")
    request(d1, b"c", "x")
    request(d2, b"c", "x")
    (_, k1, _), = worker_requests(sent(d1))
    (_, k2, _), = worker_requests(sent(d2))
    assert k1.startswith(d1.epoch + "-") and k2.startswith(d2.epoch + "-") and k1 != k2


def test_data_only_from_the_assigned_worker():
    d = make()
    ready(d, b"w0", slot=0)
    ready(d, b"w2", slot=2)  # a second copy of model 0
    request(d, b"c", "x")
    (peer, key, _), = worker_requests(sent(d))
    other = b"w2" if peer == b"w0" else b"w0"
    body = P.pack({"type": P.RESULT, "id": "x", "response": {"forged": True}})
    d.worker_data(other, P.header(P.RESULT, key, 1), body, 0.1)
    assert sent(d) == [] and d.stray == 1 and key in d.pending
    d.worker_data(peer, P.header(P.RESULT, key, 1), body, 0.2)
    (side, client, frames), = sent(d)
    assert (side, client) == (FRONT, b"c") and frames[0]["response"] == {"forged": True} and not d.pending


def test_queued_requests_fail_with_no_worker_after_restart_wait():
    d = make(restart_wait=10.0)
    request(d, b"c", "x", now=0.0)
    assert sent(d) == [] and len(d.models[0].queue) == 1
    d.tick(5.0)
    assert client_errors(sent(d)) == []
    d.tick(10.5)
    (err,) = client_errors(sent(d))
    assert err["id"] == "x" and err["code"] == P.NO_WORKER and "restart_wait" in err["message"]
    assert not d.pending and not d.models[0].queue and d.no_worker == 1


def test_a_worker_that_registers_in_time_serves_the_queue():
    d = make(restart_wait=10.0)
    request(d, b"c", "x", now=0.0)
    d.tick(5.0)
    ready(d, b"w", now=6.0, slot=0)
    (peer, _, _), = worker_requests(sent(d))
    d.tick(7.0)
    assert peer == b"w" and client_errors(sent(d)) == [] and len(d.pending) == 1


def test_load_failure_fails_the_queue_after_restart_wait_with_the_reason():
    d = make(restart_wait=2.0)
    ready(d, b"w", slot=0, loaded=False)
    d.worker(b"w", P.pack({"type": P.LOAD_FAILED, "message": "OSError: no such file"}), 0.1)
    request(d, b"c", "x", now=0.2)
    d.tick(1.0)
    assert client_errors(sent(d)) == []
    d.worker(b"w", P.pack({"type": P.HEARTBEAT}), 2.5)
    d.tick(2.5)
    (err,) = client_errors(sent(d))
    assert err["code"] == P.NO_WORKER and "no such file" in err["message"]


def test_supervisor_giving_up_fails_the_queue_at_once_and_new_requests_too():
    d = make(restart_wait=1000.0)
    ready(d, b"w", slot=1)  # model 1's only worker
    d.take()
    d.control(P.pack({"type": P.WORKER_EXITED, "pid": hash(b"w") % 1000, "host": "h", "slot": 1, "restart": True}),
              1.0)
    request(d, b"c", "x", model="b", now=1.1)
    assert client_errors(sent(d)) == []  # a restart is coming: it waits
    d.control(P.pack({"type": P.WORKER_EXITED, "pid": 4321, "host": "h", "slot": 1, "restart": False}), 2.0)
    (err,) = client_errors(sent(d))
    assert err["id"] == "x" and err["code"] == P.NO_WORKER
    request(d, b"c", "y", model="b", now=2.1)
    (err,) = client_errors(sent(d))
    assert err["id"] == "y" and err["code"] == P.NO_WORKER
    ready(d, b"w-new", now=3.0, slot=1)  # a worker started by hand takes the model back
    request(d, b"c", "z", model="b", now=3.1)
    assert [r[0] for r in worker_requests(sent(d))] == [b"w-new"]


def test_undeliverable_client_message_cancels_the_request_on_the_worker():
    d = make()
    ready(d, b"w", slot=0)
    request(d, b"c", "x")
    (peer, key, _), = worker_requests(sent(d))
    d.worker_data(peer, P.header(P.CHUNK, key, [[0, 1]]), P.pack({"type": P.CHUNK, "id": "x", "outputs": []}), 0.1)
    (chunk,) = d.take()
    d.undeliverable_send(chunk, "its receive queue is full", 0.2)
    out = sent(d)
    assert [(s, p, f[0]["type"], f[0]["id"]) for s, p, f in out] == [(BACK, b"w", P.CANCEL, key)]
    assert d.undeliverable == 1 and not d.pending and d.status()["undeliverable"] == 1


def test_a_client_gone_has_all_its_requests_cancelled_in_one_line():
    """A client that left (Ctrl-C'd predict) with many requests in flight: the first reply that cannot
    reach it cancels every one of them, in one log line, not a line for each reply."""
    lines: list[str] = []
    d = make()
    d.log = lines.append
    ready(d, b"w", slot=0)
    for i in range(5):
        request(d, b"gone", f"g{i}")
    request(d, b"stays", "s")
    on_worker = {key: body["id"] for _, key, body in worker_requests(sent(d))}
    first = next(k for k, rid in on_worker.items() if rid == "g0")
    d.worker_data(b"w", P.header(P.CHUNK, first, [[0, 1]]), P.pack({"type": P.CHUNK, "id": "g0", "outputs": []}), 0.1)
    (chunk,) = d.take()
    d.undeliverable_send(chunk, "it is no longer connected", 0.2, gone=True)
    cancels = {f[0]["id"] for s, _, f in sent(d) if s == BACK and f[0]["type"] == P.CANCEL}
    assert cancels == {k for k, rid in on_worker.items() if rid != "s"} and len(cancels) >= 2
    assert [p.client_id for p in d.pending.values()] == ["s"]  # the other client's request goes on
    assert len(lines) == 1 and "'g0'" in lines[0] and "and 2 more" in lines[0], lines


def test_resends_count_against_max_queue():
    d = make(max_queue=2, max_inflight=1)
    ready(d, b"w0", slot=0)
    ready(d, b"w2", slot=2)
    for i in range(4):
        request(d, b"c", f"r{i}")  # one in flight on each worker, two queued: the queue is full
    d.take()
    assert len(d.models[0].queue) == 2
    d.tick(1.0)
    d.worker(b"w2", P.pack({"type": P.HEARTBEAT}), 2.5)
    d.take()
    d.tick(2.6)  # w0 silent for 2.6 s > 4 x 0.5 s: dropped; its request can't be queued again
    errs = client_errors(sent(d))
    assert len(errs) == 1 and errs[0]["code"] == P.WORKER_LOST and "queue is full" in errs[0]["message"]
    assert len(d.models[0].queue) == 2 and d.requests.resent == 0


def test_dead_workers_are_pruned():
    d = make(keep_dead=3)
    for i in range(10):
        ready(d, f"w{i}".encode())
        d.control(P.pack({"type": P.WORKER_EXITED, "pid": hash(f"w{i}".encode()) % 1000, "host": "h"}), 1.0)
    assert d.workers == {}
    workers = d.status()["workers"]
    assert len(workers) == 3 and not any(w["alive"] for w in workers)
    assert all(w["lost"] == "its process exited" for w in workers)


def test_every_unseeded_sampled_request_gets_a_seed_on_arrival():
    d = make()
    ready(d, b"w", slot=0)
    request(d, b"c", "sampled", temperature=0.8)
    request(d, b"c", "default")
    request(d, b"c", "seeded", temperature=0.8, seed=5)
    request(d, b"c", "greedy", temperature=0)
    # a client's own top-level `seed` is not where the router's goes: it is dropped, not taken
    d.client(b"c", P.pack({"type": P.COMPLETE, "id": "smuggled", "model": "a", "prompt": [1], "params": {},
                           "seed": 7}), 0.0)
    d.client(b"c", P.pack({"type": P.COMPLETE, "id": "greedy-smuggled", "model": "a", "prompt": [1],
                           "params": {"temperature": 0}, "seed": 7}), 0.0)
    got = {}
    for _, _, msg in worker_requests(sent(d)):
        P.take_router_seed(msg)  # what the worker does
        got[msg["id"]] = msg["params"]
    assert isinstance(got["sampled"]["seed"], int) and isinstance(got["default"]["seed"], int)
    assert got["sampled"]["seed"] != got["default"]["seed"]
    assert got["seeded"]["seed"] == 5 and "seed" not in got["greedy"]
    assert got["smuggled"]["seed"] != 7 and "seed" not in got["greedy-smuggled"]


def test_a_planned_slot_gets_its_model_and_device_again_after_a_restart():
    d = make()
    assert ready(d, b"w1", slot=1)["model"]["device"] == "cuda:1"
    first = ready(d, b"w2", slot=2)
    assert (first["model_id"], first["model"]["device"], first["worker_id"]) == (0, "cuda:1", 2)
    d.control(P.pack({"type": P.WORKER_EXITED, "pid": hash(b"w2") % 1000, "host": "h", "slot": 2, "restart": True}),
              1.0)
    again = ready(d, b"w2-again", slot=2)  # round-robin alone would have given it model 0 on PLANNED[0]
    assert (again["model_id"], again["model"]["device"]) == (0, "cuda:1") and again["worker_id"] == 3


def test_re_registration_drops_the_old_state_and_resends_its_work():
    d = make()
    ready(d, b"w0", slot=0)
    ready(d, b"w2", slot=2)
    request(d, b"c", "x")
    (peer, key, _), = worker_requests(sent(d))
    # the same identity says READY again: whatever it held is gone, and it is sent to the other copy
    d.worker(peer, P.pack({"type": P.READY, "capabilities": {"slot": 0 if peer == b"w0" else 2}}), 1.0)
    (peer2, key2, _), = worker_requests(sent(d))
    assert key2 == key and peer2 != peer and d.requests.resent == 1


@pytest.mark.parametrize("frame", [b"", b"\xc1", P.pack({"type": P.COMPLETE, "id": "x"}),
                                   P.pack({"type": "nonsense", "id": 3})])
def test_bad_client_frames_get_an_error_and_change_nothing(frame):
    d = make()
    d.client(b"c", frame, 0.0)
    out = sent(d)
    assert len(out) == 1 and out[0][2][0]["type"] == P.ERROR and not d.pending
