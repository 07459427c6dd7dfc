"""wire/frames.py: multipart sends and receives through pyzmq's compiled methods, as pyzmq's own
send_multipart / recv_multipart behave: parts in order, whole messages, zmq.Again where a
non-blocking send cannot be queued (and then nothing of it went)."""

from __future__ import annotations

import pytest
import zmq

from wire.frames import readable, recv_frames, send_frames


def test_frames_go_whole_and_in_order_and_a_full_queue_refuses_whole_messages():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.setsockopt(zmq.SNDHWM, 2)
        b.setsockopt(zmq.RCVHWM, 2)
        a.bind("inproc://frames")
        b.connect("inproc://frames")
        assert not readable(b)
        send_frames(a, [b"one"])
        send_frames(a, [b"id", b"header", b"body"], block=True)
        assert readable(b)
        assert recv_frames(b) == [b"one"]
        assert recv_frames(b) == [b"id", b"header", b"body"]
        assert not readable(b)
        sent = 0
        with pytest.raises(zmq.Again):
            for sent in range(1, 100):  # noqa: B007 - counted for the check below
                send_frames(a, [b"h", str(sent).encode()])
        got = []
        while readable(b):
            got.append(recv_frames(b))
        # every message that was accepted arrives whole; the refused one left no part behind
        assert got == [[b"h", str(i).encode()] for i in range(1, sent)]
        # the pyzmq way reads what this way wrote, and the reverse
        a.send_multipart([b"x", b"y"])
        assert recv_frames(b) == [b"x", b"y"]
        send_frames(a, [b"p", b"q"])
        assert b.recv_multipart() == [b"p", b"q"]
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()
