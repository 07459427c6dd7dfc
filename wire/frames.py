"""Multipart sends and receives on the hot paths (the router, a worker's I/O and output threads),
through pyzmq's compiled socket methods with plain integer flags.

pyzmq's `send_multipart` combines its flags as `zmq.Flag` enum members, which Python's enum module
ORs at a microsecond or more each, and `recv_multipart` and `getsockopt` go through the same enum
conversions. At a router's tens of thousands of messages a second these were a fifth of its time.
A drain reads until nothing waits: checking the socket's events before each message costs a
getsockopt (and the system call behind it, ~3 us) a message, where a receive that finds nothing
costs one exception (~5 us) a drain. The semantics are pyzmq's own: the parts of a message go out
together or not at all (ZeroMQ queues a multipart message atomically once its first part is
accepted)."""

from __future__ import annotations

from collections.abc import Sequence

import zmq

_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_get = zmq.backend.Socket.get
NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | NOBLOCK
_MORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)


def send_frames(sock: zmq.Socket, frames: Sequence[bytes], block: bool = False) -> None:
    """`sock.send_multipart(frames, zmq.NOBLOCK)` (or blocking): raises zmq.Again where the message
    cannot be queued now, and then nothing of it was sent."""
    last = len(frames) - 1
    more, end = (_MORE_NOBLOCK, NOBLOCK) if not block else (_MORE, 0)
    for i, frame in enumerate(frames):
        _send(sock, frame, more if i < last else end)


def recv_waiting(sock: zmq.Socket) -> list[bytes] | None:
    """The next multipart message's frames, or None where none waits."""
    try:
        frames = [_recv(sock, NOBLOCK)]
    except zmq.Again:
        return None
    while _get(sock, _RCVMORE):
        frames.append(_recv(sock, 0))
    return frames


def recv_routed(sock: zmq.Socket) -> list[bytes] | None:
    """`recv_waiting` for a ROUTER socket: its first frame is always the peer's identity with more to
    follow, so the check for more comes after the second."""
    try:
        frames = [_recv(sock, NOBLOCK), _recv(sock, 0)]
    except zmq.Again:
        return None
    while _get(sock, _RCVMORE):
        frames.append(_recv(sock, 0))
    return frames
