"""The open-files limit of a process that clients connect to (the HTTP gateway, the router).

Every client connection is a file descriptor. Where the soft limit is 1,024 (a common default), a
gateway holding a thousand idle connections answered the next client's request by closing it
unanswered. Raised at start to the hard limit (at most TARGET), as vLLM's API server does.
"""

from __future__ import annotations

import resource

TARGET = 65536


def raise_open_files(target: int = TARGET) -> int:
    """Raise this process's soft limit of open files to the hard limit, at most `target` (never
    lower it); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(hard, target)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):  # a container may forbid it: the process runs with what it has
        return soft
    return want
