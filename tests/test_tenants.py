"""Tenants: fair queuing by weight, quotas refused at once with retry_after, without sockets (the
fair queue, the quota book, the router's dispatch on a fake clock); the HTTP answer of a refusal
through a real deployment is in test_http.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from routing.dispatch import Dispatch, ModelEntry, RouterConfig
from routing.tenants import FairQueue, Tenant, TenantBook, parse_tenants, request_tokens, tenant_keys
from tests.test_dispatch import client_errors, ready, sent, worker_requests
from wire import protocol as P
from workers.spec import ModelSpec, WorkerSpec


@dataclass(eq=False)
class Item:
    tenant: str
    cost: int
    weight: float
    n: int = 0


def served_tokens(q: FairQueue, pops: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for _ in range(pops):
        item = q.popleft()
        out[item.tenant] = out.get(item.tenant, 0) + item.cost
    return out


def test_backlogged_tenants_are_served_tokens_by_their_weights():
    q = FairQueue()
    for i in range(200):  # unequal request sizes: the share is in tokens, not in requests
        q.append(Item("a", 16 if i % 2 else 48, 3.0, i))
        q.append(Item("b", 32, 1.0, i))
    got = served_tokens(q, 160)
    assert got["a"] / got["b"] == pytest.approx(3.0, rel=0.1)
    order = [item.n for item in q if item.tenant == "a"]
    assert order == sorted(order)  # a tenant's own requests keep their order


def test_one_tenant_alone_is_first_come_first_served_and_resent_requests_go_first():
    q = FairQueue()
    items = [Item("t", c, 1.0, i) for i, c in enumerate((5, 1, 9, 2))]
    for it in items:
        q.append(it)
    again = Item("t", 3, 1.0, 99)
    q.appendleft(again)
    q.remove(items[1])
    assert len(q) == 4 and items[1] not in q and again in q
    assert [q.popleft() for _ in range(4)] == [again, items[0], items[2], items[3]]
    with pytest.raises(IndexError):
        q.popleft()


def test_an_idle_tenant_banks_no_credit():
    """b sends nothing while a is served 100 requests; then both are backlogged at equal weights:
    b gets half from then on, not everything until it has caught up."""
    q = FairQueue()
    for i in range(100):
        q.append(Item("a", 10, 1.0, i))
    served_tokens(q, 100)
    for i in range(50):
        q.append(Item("a", 10, 1.0, i))
        q.append(Item("b", 10, 1.0, i))
    got = served_tokens(q, 40)
    assert got["a"] == got["b"] == 200


def test_quota_of_tokens_a_minute_refuses_with_the_window_wait():
    book = TenantBook((Tenant("t", tokens_per_minute=100),))
    assert book.admit("t", 60, now=0.0) is None
    assert book.admit("t", 50, now=1.0) is not None  # 60 reserved + 50 > 100
    book.settle("t", 60, 30, now=2.0)  # served 30 of its 60: 30 in the window from t=2
    assert book.admit("t", 50, now=3.0) is None  # 30 + 50 reserved <= 100
    wait = book.admit("t", 40, now=4.0)  # 30 + 50 + 40 > 100: once the 30 of t=2 leave, it fits
    assert wait == pytest.approx(58.0)
    book.settle("t", 50, 50, now=5.0)
    assert book.admit("t", 40, now=61.9) is not None and book.admit("t", 40, now=62.1) is None
    s = book.status({"t": 0}, now=62.1)["t"]
    assert (s["tokens_last_minute"], s["reserved_tokens"], s["served_tokens"], s["rate_limited"]) == (50, 40, 80, 3)
    with pytest.raises(ValueError, match="more than tenant 't'"):
        book.admit("t", 101, now=63.0)


def test_quota_of_requests_in_flight():
    book = TenantBook((Tenant("t", max_inflight=2),))
    assert book.admit("t", 5, 0.0) is None and book.admit("t", 5, 0.0) is None
    assert book.admit("t", 5, 0.0) == 1.0
    book.settle("t", 5, 5, 1.0)
    assert book.admit("t", 5, 1.0) is None
    assert book.admit("default", 10**9, 1.0) is None  # the implicit default tenant: no quota


def test_settings_are_checked_and_name_the_key():
    tenants = parse_tenants({"gold": {"weight": 3, "api_keys": ["k1"]}, "free": {"tokens_per_minute": 600}})
    assert [t.name for t in tenants] == ["gold", "free"] and tenant_keys(tenants) == {"k1": "gold"}
    for bad, match in (({"x": {"weight": 0}}, "tenants.x.weight"), ({"x": {"max_inflight": 1.5}}, "tenants.x.max_inflight"),
                       ({"x": {"colour": 1}}, "tenants.x.colour"), ([], "mapping"),
                       ({"x": {"api_keys": ["k"]}, "y": {"api_keys": ["k"]}}, "a key names one tenant")):
        with pytest.raises(ValueError, match=match):
            parse_tenants(bad)
    assert request_tokens({"max_tokens": 20, "n": 3}, 16) == 60 and request_tokens({}, 16) == 16


A = ModelSpec("a", "tiny:llama", max_batch_size=2)
TENANTS = (Tenant("gold", weight=3.0), Tenant("free", tokens_per_minute=100), Tenant("one", max_inflight=1))


def fair_dispatch(**cfg) -> Dispatch:
    return Dispatch([ModelEntry(0, "a", A)], RouterConfig(tenants=TENANTS, **cfg), [WorkerSpec(A, 0)])


def ask(d: Dispatch, rid: str, tenant: str | None, now: float = 0.0, **params) -> None:
    msg = {"type": P.COMPLETE, "id": rid, "model": "a", "prompt": [1], "params": {"max_tokens": 10, **params}}
    if tenant is not None:
        msg["tenant"] = tenant
    d.client(b"c", P.pack(msg), now)


def test_router_refuses_over_quota_at_once_and_orders_its_queue_by_weight():
    d = fair_dispatch()
    ready(d, b"w")
    for i in range(4):  # the worker takes its batch (2); the rest wait here
        ask(d, f"g{i}", "gold")
        ask(d, f"d{i}", None)
    out = sent(d)
    assert len(worker_requests(out)) == 2 and not client_errors(out) and len(d.models[0].queue) == 6
    # the free tenant: 100 tokens a minute, 10 reserved each: the eleventh is refused at once
    for i in range(11):
        ask(d, f"f{i}", "free", now=1.0)
    (err,) = client_errors(sent(d))
    assert err["id"] == "f10" and err["code"] == P.RATE_LIMITED and err["retry_after"] == 60.0
    assert "'free'" in err["message"] and "100 tokens a minute" in err["message"]
    ask(d, "u", "nobody")
    (err,) = client_errors(sent(d))
    assert err["code"] == P.BAD_REQUEST and err.get("param") == "tenant" and "gold" in err["message"]
    ask(d, "o1", "one")
    ask(d, "o2", "one")
    (err,) = client_errors(sent(d))
    assert err["id"] == "o2" and err["code"] == P.RATE_LIMITED and err["retry_after"] == 1.0
    ask(d, "big", "free", max_tokens=101)
    (err,) = client_errors(sent(d))
    assert err["code"] == P.BAD_REQUEST and err.get("param") == "max_tokens"
    status = d.status()["tenants"]
    assert status["free"]["rate_limited"] == 1 and status["one"]["rate_limited"] == 1
    assert (status["free"]["inflight"], status["free"]["queued"], status["free"]["reserved_tokens"]) == (10, 10, 100)
    assert status["gold"]["weight"] == 3.0 and status["gold"]["queued"] == 3


def test_router_serves_backlogged_tenants_by_weight_as_slots_free():
    """30 requests each of gold (weight 3) and the default tenant (1) behind a worker that holds 2:
    as results free its slots, gold is sent three requests to each of the other's one."""
    d = fair_dispatch()
    ready(d, b"w")
    for i in range(30):
        ask(d, f"g{i}", "gold")
        ask(d, f"d{i}", None)
    sent(d)
    order = []
    for step in range(24):
        key = sorted(d.workers[b"w"].inflight)[0]
        d.worker_data(b"w", P.header(P.RESULT, key, 10), P.pack({}), 1.0 + step)
        order += [req["id"][0] for _, _, req in worker_requests(sent(d))]
    assert len(order) == 24 and order.count("g") == 18, order
    status = d.status()["tenants"]
    assert status["gold"]["served_tokens"] + status["default"]["served_tokens"] == 240


def test_without_tenants_a_worker_takes_up_to_max_inflight():
    d = Dispatch([ModelEntry(0, "a", A)], RouterConfig(max_inflight=5), [WorkerSpec(A, 0)])
    ready(d, b"w")
    for i in range(7):
        ask(d, f"r{i}", None)
    assert len(worker_requests(sent(d))) == 5 and len(d.models[0].queue) == 2
    assert d.status()["tenants"]["default"]["inflight"] == 7
