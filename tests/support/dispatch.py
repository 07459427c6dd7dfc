"""What a Dispatch queued, decoded as its peers read it (for the router's socket-free tests)."""

from __future__ import annotations

import msgpack

from routing.dispatch import BACK, SUPER, Dispatch
from wire import protocol as P


def sent(d: Dispatch) -> list[tuple[str, bytes | None, list]]:
    """(side, peer, decoded frames) of every message queued since the last call; the requests one
    drain bundled for a worker come apart as the worker takes them: one entry [header, request] each."""
    out: list[tuple[str, bytes | None, list]] = []
    for s in d.take():
        if s.side == SUPER:
            out.append((SUPER, None, [msgpack.unpackb(s.frames[0], raw=False)]))
            continue
        turn = P.unbundle(s.frames[1]) if s.side == BACK and len(s.frames) == 2 else None
        if turn is not None:
            out += [(s.side, s.frames[0], [msgpack.unpackb(f, raw=False) for f in turn[i:i + 2]])
                    for i in range(0, len(turn), 2)]
        else:
            out.append((s.side, s.frames[0], [msgpack.unpackb(f, raw=False) for f in s.frames[1:]]))
    return out
