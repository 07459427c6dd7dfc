"""wire/frames.py: multipart sends and receives through pyzmq's compiled methods, as pyzmq's own
send_multipart / recv_multipart behave: parts in order, whole messages, zmq.Again where a
non-blocking send cannot be queued (and then nothing of it went)."""

from __future__ import annotations

import pytest
import zmq

from wire.frames import recv_routed, recv_waiting, send_frames


def test_frames_go_whole_and_in_order_and_a_full_queue_refuses_whole_messages():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.setsockopt(zmq.SNDHWM, 2)
        b.setsockopt(zmq.RCVHWM, 2)
        a.bind("inproc://frames")
        b.connect("inproc://frames")
        assert recv_waiting(b) is None
        send_frames(a, [b"one"])
        send_frames(a, [b"id", b"header", b"body"], block=True)
        assert recv_waiting(b) == [b"one"]
        assert recv_waiting(b) == [b"id", b"header", b"body"]
        assert recv_waiting(b) is None
        sent = 0
        with pytest.raises(zmq.Again):
            for sent in range(1, 100):  # noqa: B007 - counted for the check below
                send_frames(a, [b"h", str(sent).encode()])
        got = []
        while (frames := recv_waiting(b)) is not None:
            got.append(frames)
        # every message that was accepted arrives whole; the refused one left no part behind
        assert got == [[b"h", str(i).encode()] for i in range(1, sent)]
        # the pyzmq way reads what this way wrote, and the reverse
        a.send_multipart([b"x", b"y"])
        assert recv_waiting(b) == [b"x", b"y"]
        send_frames(a, [b"p", b"q"])
        assert b.recv_multipart() == [b"p", b"q"]
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def test_a_drain_reads_whole_messages_until_none_waits():
    ctx = zmq.Context()
    router, dealer, a, b = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER), ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        router.bind("inproc://routed")
        dealer.setsockopt(zmq.ROUTING_ID, b"peer")
        dealer.connect("inproc://routed")
        a.bind("inproc://waiting")
        b.connect("inproc://waiting")
        assert recv_routed(router) is None and recv_waiting(b) is None
        dealer.send(b"one")
        dealer.send_multipart([b"two", b"three"])
        dealer.send(b"")
        send_frames(a, [b"x"])
        send_frames(a, [b"y", b"z"])
        got = []
        while (frames := recv_routed(router)) is not None:
            got.append(frames)
        assert got == [[b"peer", b"one"], [b"peer", b"two", b"three"], [b"peer", b""]]
        assert [recv_waiting(b), recv_waiting(b), recv_waiting(b)] == [[b"x"], [b"y", b"z"], None]
    finally:
        for s in (router, dealer, a, b):
            s.close(linger=0)
        ctx.term()
