"""Bursts of allocations with the cyclic collector paused (workers.gc_pause): back on after, a
block's objects still collectable, an import's frozen, and nothing frozen for a module already there."""

from __future__ import annotations

import gc
import sys
import weakref

from workers.gc_pause import collector_paused, import_paused


class _Node:
    pass


def test_the_collector_is_back_after_a_block_and_its_cycles_are_collected():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        gone = weakref.ref(a)
        del a, b
    assert gc.isenabled()
    gc.collect()
    assert gone() is None
    gc.disable()
    try:  # a block inside code that turned it off leaves it off
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_import_freezes_what_it_made_once():
    name = "colorsys"  # small, of the standard library, imported by nothing here
    sys.modules.pop(name, None)
    before = gc.get_freeze_count()
    import_paused(name)
    assert name in sys.modules and gc.isenabled()
    frozen = gc.get_freeze_count()
    assert frozen > before
    # already imported: nothing more frozen, these fresh objects included (a freeze would take
    # them). The count may still fall: a frozen object that dies (another test's thread letting go
    # of one, in this process) leaves the frozen generation
    fresh = [[] for _ in range(100)]
    import_paused(name)
    assert gc.get_freeze_count() <= frozen and len(fresh) == 100
