"""The heavy stack (torch, transformers, the engine) imported with Python's cyclic collector paused.

Those imports allocate millions of objects that live as long as the process, and the collector
walks them again and again while they are made: a fifth of the imports' CPU (10.5 s against 8.5 s
on a 2-core AVX2 CPU), paid by every fork server, Ray actor and worker started on its own. After
them the new objects are frozen (gc.freeze): later collections skip them, and a worker forked from
a server that froze them does not touch, and so copy, the pages it shares with the server.
"""

from __future__ import annotations

import gc
import importlib
import sys


def import_paused(*modules: str) -> None:
    """Import `modules` (dotted names) with the collector paused, freezing what they made. Only
    when one is not imported yet: a freeze later in a process's life would also keep whatever
    garbage of its own it held at that moment."""
    missing = [m for m in modules if m not in sys.modules]
    if not missing:
        return
    was = gc.isenabled()
    gc.disable()
    try:
        for name in missing:
            importlib.import_module(name)
    finally:
        gc.freeze()
        if was:
            gc.enable()
