"""Property tests (hypothesis) of the router's dispatch state: whatever clients and workers send, in
any order, it never raises and its tables stay consistent."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.dispatch import Dispatch, ModelEntry, RouterConfig
from wire import protocol as P
from workers.spec import ModelSpec, WorkerSpec

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=12) | st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=4), max_leaves=12)
good_params = st.fixed_dictionaries({}, optional={"max_tokens": st.integers(0, 64), "temperature": st.floats(0, 2),
                                                  "seed": st.none() | st.integers(0, 2**62)})
client_msgs = st.fixed_dictionaries(
    {"v": st.sampled_from([P.VERSION, P.VERSION, P.VERSION, 0, None]),
     "type": st.sampled_from([P.COMPLETE, P.COMPLETE, P.CANCEL, P.MODELS, P.STATUS, "bogus", 7])},
    optional={"id": st.sampled_from(["a", "b", "c"]) | values, "model": st.sampled_from(["m", "n", 0, 1, 9]) | values,
              "prompt": st.lists(st.integers(0, 300), max_size=5) | st.text(max_size=5) | values,
              "params": good_params | values, "stream": st.booleans() | values})
client_frames = client_msgs.map(lambda m: msgpack.packb(m, use_bin_type=True)) | st.binary(max_size=40)
clients = st.sampled_from([b"c1", b"c2"])
worker_ids = st.sampled_from([b"w1", b"w2", b"w3"])
worker_msgs = st.fixed_dictionaries(
    {"v": st.just(P.VERSION), "type": st.sampled_from([P.READY, P.LOADED, P.LOAD_FAILED, P.HEARTBEAT, "x"])},
    optional={"capabilities": st.fixed_dictionaries({}, optional={"slot": st.integers(-1, 3) | values,
                                                                  "pid": st.integers(1, 5)}) | values,
              "message": values, "engine": values})
headers = st.tuples(st.sampled_from([P.CHUNK, P.RESULT, P.ERROR, "zz"]), st.text(max_size=20),
                    st.integers(0, 9) | st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=2), max_size=3)
                    ).map(lambda h: msgpack.packb(list(h)))
events = st.one_of(
    st.tuples(st.just("client"), clients, client_frames),
    st.tuples(st.just("worker"), worker_ids, worker_msgs.map(lambda m: msgpack.packb(m, use_bin_type=True))),
    st.tuples(st.just("data"), worker_ids, headers | st.binary(max_size=20)),
    st.tuples(st.just("data-real"), worker_ids, st.sampled_from([P.CHUNK, P.RESULT, P.ERROR])),
    st.tuples(st.just("tick"), st.floats(0, 5), st.none()),
    st.tuples(st.just("exit"), st.integers(1, 5), st.booleans()),
    st.tuples(st.just("undeliverable"), st.integers(0, 10), st.none()),
)


def check(d: Dispatch) -> None:
    assert len(d.client_keys) == len(d.pending)
    for key, p in d.pending.items():
        assert d.client_keys[(p.client, p.client_id)] == key
        if p.worker is not None:
            assert key in d.workers[p.worker].inflight
        else:
            assert p in d.models[p.model_id].queue
    for w in d.workers.values():
        assert w.alive and all(k in d.pending and d.pending[k].worker == w.ident for k in w.inflight)
    for m in d.models.values():
        assert all(p.key in d.pending for p in m.queue) and len(m.queue) <= d.config.max_queue


@settings(max_examples=300, deadline=None)
@given(st.lists(events, max_size=40))
def test_any_sequence_of_messages_keeps_the_tables_consistent(seq):
    specs = [ModelSpec("m", "tiny:llama"), ModelSpec("n", "tiny:gpt2"), ModelSpec("m", "tiny:llama")]
    d = Dispatch([ModelEntry(i, s.name, s) for i, s in enumerate(specs)],
                 RouterConfig(max_queue=3, max_inflight=2, restart_wait=1.0),
                 [WorkerSpec(s, i) for i, s in enumerate(specs)])
    now, sent = 0.0, []
    for kind, a, b in seq:
        if kind == "client":
            d.client(a, b, now)
        elif kind == "worker":
            d.worker(a, b, now)
        elif kind == "data":
            d.worker_data(a, b, b"body", now)
        elif kind == "data-real" and d.pending:  # an answer for a request that exists, from anyone
            key = sorted(d.pending)[0]
            d.worker_data(a, P.header(b, key, 1 if b != P.CHUNK else [[0, 1]]), b"body", now)
        elif kind == "tick":
            now += a
            d.tick(now)
        elif kind == "exit":
            d.control(P.pack({"type": P.WORKER_EXITED, "pid": a, "host": None, "slot": a % 3, "restart": b}), now)
        elif kind == "undeliverable" and sent:
            d.undeliverable_send(sent[a % len(sent)], "test", now)
        sent = d.take() or sent
        check(d)
