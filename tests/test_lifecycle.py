"""Models at run time, decided by the router's dispatch without sockets (routing/lifecycle.py and
routing/residency.py): loads, evictions by LRU with pins, autoload, draining unloads, bad input.
Sizes come from the deployment's own placer (fusion.catalog.PlanPlacer) on tiny models."""

from __future__ import annotations

import pytest
from support.dispatch import sent

from fusion.catalog import PlanPlacer
from routing.dispatch import BACK, FRONT, SUPER, Catalog, Dispatch, ModelEntry, RouterConfig
from routing.residency import CopySize, NoMemory, Residency, Resident
from wire import protocol as P
from workers.spec import ModelSpec, WorkerSpec

SPECS = {n: ModelSpec(n, f"tiny:{arch}") for n, arch in
         (("a", "llama"), ("b", "gpt2"), ("c", "llama:2"), ("d", "qwen2"))}


def one_copy() -> int:
    return PlanPlacer(["cpu"], "auto", {"cpu": 2**31}).size(SPECS["a"], "cpu").alone


def make(budget_copies: float | None = 2.5, started=("a",), pin=(), **cfg) -> Dispatch:
    """A dispatch whose CPU budget holds `budget_copies` copies of a tiny model, started with `started`."""
    budget = None if budget_copies is None else int(one_copy() * budget_copies)
    placer = PlanPlacer(["cpu"], "auto", {"cpu": budget})
    specs = {n: ModelSpec(n, s.source, pin=n in pin) for n, s in SPECS.items()}
    models = [ModelEntry(i, n, specs[n]) for i, n in enumerate(started)]
    workers = [placer.worker_spec(specs[n], i, "cpu", None, 1) for i, n in enumerate(started)]
    sizes = {i: placer.size(specs[n], "cpu") for i, n in enumerate(started)}
    catalog = Catalog(specs, placer, {"cpu": budget}, sizes)
    return Dispatch(models, RouterConfig(heartbeat_interval=0.5, liveness=4, **cfg), workers, catalog=catalog)


def orders(out) -> list[tuple[str, int]]:
    return [(f[0]["type"], f[0]["slot"]) for side, _, f in out if side == SUPER]


def replies(out, client=b"c") -> list[dict]:
    return [f[0] for side, peer, f in out if side == FRONT and peer == client and len(f) == 1]


def ready(d: Dispatch, ident: bytes, slot: int, now: float = 0.0, loaded: bool = True) -> dict:
    d.worker(ident, P.pack({"type": P.READY, "capabilities": {"pid": 100 + slot, "host": "h", "slot": slot}}), now)
    assign = next(f[0] for side, peer, f in sent(d) if side == BACK and peer == ident)
    if loaded:
        d.worker(ident, P.pack({"type": P.LOADED}), now)
    return assign


def exited(d: Dispatch, slot: int, now: float = 0.0) -> None:
    d.control(P.pack({"type": P.WORKER_EXITED, "pid": 100 + slot, "host": "h", "slot": slot, "restart": False}), now)


def admin(d: Dispatch, mtype: str, rid: str, now: float = 0.0, **fields) -> None:
    d.client(b"c", P.pack({"type": mtype, "id": rid, **fields}), now)


def request(d: Dispatch, rid: str, model, now: float = 0.0, client: bytes = b"u") -> None:
    d.client(client, P.pack({"type": P.COMPLETE, "id": rid, "model": model, "prompt": [1, 2],
                             "params": {"temperature": 0}}), now)


def worker_keys(out, ident: bytes) -> list[str]:
    return [f[0][1] for side, peer, f in out if side == BACK and peer == ident and len(f) == 2]


def answer(d: Dispatch, ident: bytes, key: str, rid: str, now: float = 0.0) -> None:
    d.worker_data(ident, P.header(P.RESULT, key, 1), P.pack({"type": P.RESULT, "id": rid, "response": {}}), now)


def by_id(d: Dispatch) -> dict:
    return {m["id"]: m for m in d.models_info() if m["id"] is not None}


def test_a_load_starts_one_worker_per_new_copy_and_answers_when_it_serves():
    d = make()
    ready(d, b"w0", 0)
    sent(d)
    admin(d, P.LOAD, "l1", model="b")
    out = sent(d)
    assert orders(out) == [(P.START_WORKER, 1)] and replies(out) == []
    assert by_id(d)[1]["state"] == P.STATE_LOADING and d.registry.worker_specs[1].model_id == 1
    assign = ready(d, b"w1", 1, now=2.0)
    assert assign["model_id"] == 1 and assign["model"]["model"]["name"] == "b"
    (reply,) = replies(sent(d))
    assert reply["type"] == P.REPLY and reply["data"]["model"] == "b"
    assert [c["state"] for c in reply["data"]["copies"]] == [P.STATE_LOADED]
    admin(d, P.LOAD, "l2", model="b")  # already there: a retry adds nothing
    out = sent(d)
    assert orders(out) == [] and replies(out)[0]["type"] == P.REPLY and len(d.models) == 2
    names = {m["name"]: m for m in d.models_info()}
    assert names["c"]["id"] is None and names["c"]["state"] == P.STATE_AVAILABLE
    assert d.status()["models"]["loads"] == 1


def test_a_load_past_the_budget_evicts_the_least_recently_used_idle_copy_first():
    d = make(started=("a", "b"))
    ready(d, b"w0", 0)
    ready(d, b"w1", 1)
    request(d, "r", "b", now=5.0)  # b is used last, and stays busy
    sent(d)
    admin(d, P.LOAD, "l", model="c", now=6.0)
    out = sent(d)
    assert orders(out) == [(P.STOP_WORKER, 0)]  # a: idle and least recently used; c waits for it
    assert by_id(d)[0]["state"] == P.STATE_UNLOADING
    exited(d, 0, now=7.0)
    out = sent(d)
    assert orders(out) == [(P.START_WORKER, 2)] and 0 not in d.models
    request(d, "r2", "a", now=7.5)  # a request for `a` loads it again: only busy b can make room
    out = sent(d)
    assert d.status()["models"]["autoloads"] == 1 and by_id(d)[1]["state"] == P.STATE_UNLOADING
    assert orders(out) == []  # b drains r first; `a` starts once b has exited
    assert d.status()["models"]["evictions"] == {"evicted": 2}
    last = d.status()["models"]["last_evictions"]  # each unload with its reason, newest last
    assert [(e["model_id"], e["model"], e["reason"]) for e in last] == [(0, "a", "evicted"), (1, "b", "evicted")]
    assert last[0]["at"] == pytest.approx(6.0 + d.wall, abs=1e-3)


def test_pinned_copies_are_never_evicted_and_a_load_that_cannot_fit_changes_nothing():
    d = make(started=("a", "b"), pin=("a", "b"))
    ready(d, b"w0", 0)
    ready(d, b"w1", 1)
    sent(d)
    admin(d, P.LOAD, "l", model="c")
    (err,) = replies(sent(d))
    assert err["code"] == P.NO_MEMORY and "MiB" in err["message"] and "pinned" in err["message"]
    assert {m["state"] for m in by_id(d).values()} == {P.STATE_LOADED} and len(d.models) == 2
    assert all(m["pinned"] for m in by_id(d).values())


def test_a_model_too_big_for_the_budget_is_refused_at_once():
    d = make(budget_copies=0.5, started=())
    admin(d, P.LOAD, "l", model="a")
    (err,) = replies(sent(d))
    assert err["code"] == P.NO_MEMORY and "even alone" in err["message"] and not d.models


def test_concurrent_first_requests_cause_exactly_one_load_and_are_answered_when_it_serves():
    d = make(started=())
    for i in range(5):
        request(d, f"r{i}", "b", now=0.1 * i)
    out = sent(d)
    assert orders(out) == [(P.START_WORKER, 0)] and len(d.models) == 1
    ready(d, b"w", 0, now=3.0)
    keys = worker_keys(sent(d), b"w")
    assert len(keys) == 5
    st = d.status()["models"]
    assert st["autoloads"] == 1 and st["queue_wait_seconds"]["count"] == 5


def test_autoload_off_refuses_a_request_for_a_model_not_loaded():
    d = make(started=(), autoload=False)
    request(d, "r", "b")
    (err,) = replies(sent(d), b"u")
    assert err["code"] == P.UNLOADED and "autoload" in err["message"] and not d.models


def test_an_unload_drains_its_requests_then_stops_the_worker_and_forgets_the_id():
    d = make(started=("a", "b"))
    ready(d, b"w0", 0)
    ready(d, b"w1", 1)
    request(d, "r", "b")
    (key,) = worker_keys(sent(d), b"w1")
    admin(d, P.UNLOAD, "u", model="b", now=1.0)
    out = sent(d)
    assert orders(out) == [] and replies(out) == []  # draining: r is in flight
    request(d, "r2", 1, now=1.5)  # the leaving ID refuses new work
    assert replies(sent(d), b"u")[0]["code"] == P.UNLOADED
    answer(d, b"w1", key, "r", now=2.0)
    assert replies(sent(d), b"u")[0]["type"] == P.RESULT  # nothing lost
    d.tick(2.5)
    assert orders(sent(d)) == [(P.STOP_WORKER, 1)]
    exited(d, 1, now=3.0)
    (reply,) = replies(sent(d))
    assert reply["type"] == P.REPLY and reply["data"]["copies"] == []
    request(d, "r3", 1, now=4.0)
    assert replies(sent(d), b"u")[0]["code"] == P.UNKNOWN_MODEL


def test_requests_still_running_at_unload_timeout_fail_once_with_unloaded():
    d = make(started=("a", "b"), unload_timeout=5.0)
    ready(d, b"w0", 0)
    ready(d, b"w1", 1)
    request(d, "r", "b")
    (key,) = worker_keys(sent(d), b"w1")
    admin(d, P.UNLOAD, "u", model="b", now=1.0)
    for w in (b"w0", b"w1"):
        d.worker(w, P.pack({"type": P.HEARTBEAT}), 6.4)
    d.tick(6.5)
    out = sent(d)
    assert [e["code"] for e in replies(out, b"u")] == [P.UNLOADED]
    assert any(side == BACK and f[0].get("type") == P.CANCEL for side, _, f in out)
    answer(d, b"w1", key, "r", now=7.0)  # the worker's late answer reaches no one
    assert replies(sent(d), b"u") == []
    assert d.status()["models"]["unloaded_requests"] == 1


def test_a_load_and_an_unload_of_one_model_at_once_conflict():
    d = make(started=("a",))
    ready(d, b"w0", 0)
    admin(d, P.LOAD, "l", model="b")
    sent(d)
    admin(d, P.UNLOAD, "u", model="b")
    assert replies(sent(d))[0]["code"] == P.CONFLICT
    admin(d, P.UNLOAD, "u2", model="a")
    sent(d)
    admin(d, P.LOAD, "l2", model="a")
    assert replies(sent(d))[0]["code"] == P.CONFLICT


@pytest.mark.parametrize("mtype, fields, code", [
    (P.LOAD, {"model": "nope"}, P.UNKNOWN_MODEL),
    (P.LOAD, {"model": "b", "copies": 0}, P.BAD_REQUEST),
    (P.LOAD, {"model": "b", "copies": True}, P.BAD_REQUEST),
    (P.LOAD, {"model": "b", "copies": P.MAX_COPIES + 1}, P.BAD_REQUEST),  # a worker process each
    (P.LOAD, {"model": "b", "pin": "yes"}, P.BAD_REQUEST),
    (P.UNLOAD, {"model": "c"}, P.BAD_REQUEST),  # not loaded
    (P.UNLOAD, {"model": "a", "copies": -1}, P.BAD_REQUEST),
    (P.UNLOAD, {"model": 7}, P.UNKNOWN_MODEL),
])
def test_bad_loads_and_unloads_are_refused_and_change_nothing(mtype, fields, code):
    d = make()
    ready(d, b"w0", 0)
    sent(d)
    admin(d, mtype, "x", **fields)
    out = sent(d)
    (err,) = replies(out)
    assert err["code"] == code and err["message"] and orders(out) == []
    assert list(d.models) == [0] and d.models[0].state == P.STATE_LOADED


def test_a_router_without_a_supervisor_answers_not_supported():
    d = Dispatch([ModelEntry(0, "a", SPECS["a"])])
    admin(d, P.LOAD, "l", model="a")
    assert replies(sent(d))[0]["code"] == P.NOT_SUPPORTED


def test_idle_models_unload_after_idle_unload_s_but_pinned_ones_stay():
    d = make(started=("a", "b"), pin=("a",), idle_unload_s=30.0)
    ready(d, b"w0", 0)
    ready(d, b"w1", 1)
    d.tick(10.0)
    assert orders(sent(d)) == []
    d.tick(31.0)
    assert orders(sent(d)) == [(P.STOP_WORKER, 1)] and d.models[0].state == P.STATE_LOADED
    assert d.status()["models"]["evictions"] == {"idle": 1}


def test_a_failed_load_fails_its_waiters_and_queue_and_frees_its_memory():
    d = make(started=())
    admin(d, P.LOAD, "l", model="b")
    request(d, "r", "b")
    sent(d)
    ready(d, b"w", 0, loaded=False)
    d.worker(b"w", P.pack({"type": P.LOAD_FAILED, "message": "RuntimeError: boom"}), 1.0)
    out = sent(d)
    assert {e["code"] for e in replies(out)} | {e["code"] for e in replies(out, b"u")} == {P.NO_WORKER}
    assert "boom" in replies(out)[0]["message"] and orders(out) == [(P.STOP_WORKER, 0)]
    exited(d, 0, 2.0)
    assert not d.models and d.lifecycle.residency.used("cpu") == 0


def test_residency_counts_shared_weights_once_per_device_and_frees_them_with_the_last_copy():
    r = Residency({"cpu": 1000})
    r.add(Resident(0, CopySize("cpu", 100, "w", 500)))
    r.add(Resident(1, CopySize("cpu", 100, "w", 500)))
    assert r.used("cpu") == 700 and r.resident_bytes(0) == 350
    p = r.choose("x", [CopySize("cpu", 400)], lambda i: False)
    assert p.evict == (0,)  # one sharer leaving frees only its own 100: the other keeps the weights
    assert r.used("cpu", frozenset(p.evict), CopySize("cpu", 400)) <= 1000
    r.copies[0].pinned = r.copies[1].pinned = True
    with pytest.raises(NoMemory):
        r.choose("x", [CopySize("cpu", 400)], lambda i: False)


def test_worker_spec_of_a_loaded_copy_takes_the_evicted_cores():
    placer = PlanPlacer(["cpu"], "auto", {"cpu": None})
    spec = placer.worker_spec(SPECS["a"], 9, "cpu", (3,), 2)
    assert isinstance(spec, WorkerSpec) and spec.cpus == (3,) and spec.threads == 1 and spec.model_id == 9


def test_a_load_that_fits_only_once_the_loading_copies_serve_waits_for_them():
    d = make(budget_copies=1.5, started=())
    request(d, "ra", "a")
    request(d, "rb", "b")  # no room while `a` loads: b waits, it is not refused
    assert orders(sent(d)) == [(P.START_WORKER, 0)] and d.models[1].state == P.STATE_LOADING
    ready(d, b"wa", 0, now=2.0)
    out = sent(d)
    (key,) = worker_keys(out, b"wa")  # a serves what waited for it, then leaves for b
    assert orders(out) == [] and d.models[0].state == P.STATE_UNLOADING
    answer(d, b"wa", key, "ra", now=3.0)
    d.worker(b"wa", P.pack({"type": P.HEARTBEAT}), 3.0)
    d.tick(3.5)
    assert orders(sent(d)) == [(P.STOP_WORKER, 0)]
    exited(d, 0, now=4.0)
    assert orders(sent(d)) == [(P.START_WORKER, 1)]
    ready(d, b"wb", 1, now=5.0)
    assert len(worker_keys(sent(d), b"wb")) == 1


def test_a_load_of_several_copies_never_counts_on_evicting_its_own():
    d = make(started=("a",), pin=("a",))
    ready(d, b"w0", 0)
    sent(d)
    admin(d, P.LOAD, "l", model="b", copies=2)
    (err,) = replies(sent(d))
    assert err["code"] == P.NO_MEMORY and list(d.models) == [0]


def test_a_budget_smaller_than_the_copies_that_start_is_refused_before_anything_starts():
    from fusion.catalog import make_catalog
    from fusion.deploy import build_fusion
    from fusion.plan import make_plan

    params = {"variants": {n: {"model": {"source": s.source}} for n, s in SPECS.items()}, "runconfig": {}}
    fusion = build_fusion(params, ["a,1"])
    plan = make_plan(fusion, None, "cpu", 1)
    with pytest.raises(ValueError, match="memory_budget: the copies started on cpu need ~.* MiB, more than its budget"):
        make_catalog(fusion, plan, SPECS, {"memory_budget": "10MiB"})
    assert make_catalog(fusion, plan, SPECS, {"memory_budget": "auto"}).budgets["cpu"] > 2**20
    unbudgeted = make_catalog(fusion, plan, SPECS, {"memory_budget": None})
    assert unbudgeted.budgets == {"cpu": None} and unbudgeted.ceilings["cpu"] > 2**20  # the memory available now
    assert make_catalog(fusion, plan, SPECS, {"memory_budget": None, "ray": True}).ceilings == {}  # Ray places it


def _serve(d: Dispatch, ident: bytes, rid: str, model: str, now: float) -> None:
    request(d, rid, model, now=now)
    (key,) = worker_keys(sent(d), ident)
    answer(d, ident, key, rid, now=now)
    sent(d)


def test_eviction_weighs_how_often_a_copy_is_used_not_only_when_last():
    """a answered ten requests, b one, later: LRU would evict a; b is worth less to keep."""
    d = make(started=("a", "b"))
    ready(d, b"w0", 0)
    ready(d, b"w1", 1)
    sent(d)
    for i in range(10):
        _serve(d, b"w0", f"a{i}", "a", now=float(i))
    _serve(d, b"w1", "b0", "b", now=11.0)
    admin(d, P.LOAD, "l", model="c", now=12.0)
    assert orders(sent(d)) == [(P.STOP_WORKER, 1)]


def test_the_measured_reload_time_makes_a_copy_worth_keeping():
    res = Residency({"cpu": 300})
    quick, slow = Resident(0, CopySize("cpu", 100)), Resident(1, CopySize("cpu", 100))
    for r in (quick, slow):
        res.add(r)
        r.use(0.0)
    quick.reload_s, slow.reload_s = 0.6, 9.0
    p = res.choose("x", [CopySize("cpu", 150)], lambda i: False, now=1.0)
    assert p.evict == (0,)  # equal use and bytes: the one that reloads quickly goes
    slow.reload_s = 0.0  # not timed yet: counted as MIN_RELOAD_S, less than 0.6
    assert res.choose("x", [CopySize("cpu", 150)], lambda i: False, now=1.0).evict == (1,)


def test_a_copy_that_just_loaded_is_not_evicted_for_a_request_started_load():
    d = make(started=("a",), pin=("a",), min_resident_s=30.0)
    ready(d, b"w0", 0)
    request(d, "rb", "b", now=0.0)  # fits beside a: b loads at once
    assert orders(sent(d)) == [(P.START_WORKER, 1)]
    ready(d, b"w1", 1, now=1.0)
    sent(d)
    request(d, "rc", "c", now=5.0)  # only b could make room, and it serves since 1.0: c waits
    assert orders(sent(d)) == [] and d.status()["models"]["held"] == 1
    d.tick(20.0)
    assert orders(sent(d)) == []
    d.tick(31.5)
    assert orders(sent(d)) == [(P.STOP_WORKER, 1)]  # b drains rb (answered or not) and goes; c follows


def test_past_max_loads_per_minute_a_request_started_load_waits_rather_than_evicts():
    d = make(started=("a",), pin=("a",), max_loads_per_minute=1)
    ready(d, b"w0", 0)
    request(d, "rb", "b", now=0.0)
    assert orders(sent(d)) == [(P.START_WORKER, 1)]
    ready(d, b"w1", 1, now=1.0)
    (key,) = worker_keys(sent(d), b"w1")
    answer(d, b"w1", key, "rb", now=1.5)
    request(d, "rc", "c", now=2.0)  # evicting b would be the minute's second load
    assert orders(sent(d)) == [] and d.status()["models"]["held"] == 1
    d.tick(40.0)
    assert orders(sent(d)) == []
    d.tick(60.5)  # the load of b left the minute
    assert orders(sent(d)) == [(P.STOP_WORKER, 1)]


def test_an_operators_load_is_never_held_back():
    d = make(started=("a",), pin=("a",), max_loads_per_minute=1, min_resident_s=600.0)
    ready(d, b"w0", 0)
    request(d, "rb", "b", now=0.0)  # the minute's one request-started load
    ready(d, b"w1", 1, now=1.0)
    (key,) = worker_keys(sent(d), b"w1")
    answer(d, b"w1", key, "rb", now=1.5)
    admin(d, P.LOAD, "l1", model="c", now=2.0)  # evicts b, serving for 1 s, past the minute's cap
    assert orders(sent(d)) == [(P.STOP_WORKER, 1)] and d.status()["models"]["held"] == 0


def test_with_no_budget_a_load_past_the_memory_the_device_had_at_start_is_refused_at_once():
    """memory_budget null evicts nothing; a load still takes no more copies than the memory the
    device had available at start holds (6,948 copies of a tiny model were once started,
    a worker process each, until the machine ran out of memory): refused whole, at once, naming
    the figures, nothing started; a load that fits starts; with no ceiling known, no limit."""
    copy = one_copy()
    placer = PlanPlacer(["cpu"], "auto", {"cpu": None})
    catalog = Catalog(SPECS, placer, {"cpu": None}, {0: placer.size(SPECS["a"], "cpu")}, {"cpu": int(copy * 3.5)})
    d = Dispatch([ModelEntry(0, "a", SPECS["a"])], RouterConfig(heartbeat_interval=0.5, liveness=4),
                 [placer.worker_spec(SPECS["a"], 0, "cpu", None, 1)], catalog=catalog)
    ready(d, b"w0", 0)
    admin(d, P.LOAD, "big", model="b", copies=P.MAX_COPIES)
    out = sent(d)
    (err,) = replies(out)
    assert err["type"] == P.ERROR and err["code"] == P.NO_MEMORY, err
    assert f"no memory for {P.MAX_COPIES} copies of 'b', only for " in err["message"]
    assert "the device had available when the deployment started (memory_budget is null" in err["message"]
    assert orders(out) == [] and set(d.models) == {0}
    admin(d, P.LOAD, "two", model="b", copies=2)
    assert [t for t, _ in orders(sent(d))] == [P.START_WORKER] * 2
    unbounded = Residency({"cpu": None})
    size = CopySize("cpu", copy)
    assert len(unbounded.choose_many("b", [size], 1000, lambda _: False)) == 1000
    bounded = Residency({"cpu": None}, {"cpu": copy * 3})
    assert len(bounded.choose_many("b", [size], 3, lambda _: False)) == 3
    with pytest.raises(NoMemory, match="only for 3"):
        bounded.choose_many("b", [size], 4, lambda _: False)
    assert Residency({"cpu": 10 * copy}, {"cpu": copy}).choose_many("b", [size], 5, lambda _: False)  # a budget rules
