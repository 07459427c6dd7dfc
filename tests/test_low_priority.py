"""A model loads behind serving (workers.low_priority): its CPU work runs in a thread of its own at
a lower priority, and the worker then serves at the priority it started with."""

from __future__ import annotations

import os
import threading

import psutil
import pytest
import torch

from fusion.deploy import build_fusion
from fusion.local import LocalDeployment
from fusion.plan import make_plan
from routing.client import Client
from workers.low_priority import LOAD_NICE, at_low_priority


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_work_runs_at_a_lower_priority_and_the_caller_keeps_its_own():
    base = _nice()
    seen = at_low_priority(lambda: (_nice(), threading.get_native_id(), torch.ones(64, 64).sum().item()))
    assert seen[0] == min(19, base + LOAD_NICE) and seen[1] != threading.get_native_id() and seen[2] == 4096
    assert _nice() == base

    def fails():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        at_low_priority(fails)
    assert _nice() == base


def test_a_worker_serves_at_the_priority_it_started_with():
    """Loaded with two torch threads (so the load starts OpenMP threads of its own), a worker serves
    on threads at the starter's priority: every thread that works on a request is at it. (An idle
    OpenMP thread of the load's may linger at the load's priority; it does no serving work.)"""
    params = {"variants": {"m": {"model": {"source": "tiny:llama", "dtype": "float32", "max_batch_size": 4,
                                           "max_batch_tokens": 64}}}, "runconfig": {}, "_path": "test"}
    fusion = build_fusion(params, ["m,1"])
    d = LocalDeployment(fusion, make_plan(fusion, None, "cpu", threads_per_worker=2), "tcp://127.0.0.1:*",
                        "tcp://127.0.0.1:*")
    with d:
        d.wait_loaded(120)
        with Client(d.frontend, timeout=60) as c:
            (worker,) = [w for w in c.status()["workers"] if w["alive"]]
            proc = psutil.Process(worker["pid"])
            before = {t.id: t.user_time + t.system_time for t in proc.threads()}
            for _ in range(3):
                out = c.complete("m", "Hello " * 30, max_tokens=300, temperature=0.0, ignore_eos=True)
                assert out["usage"]["completion_tokens"] == 300
            worked = [t.id for t in proc.threads() if t.user_time + t.system_time - before.get(t.id, 0.0) >= 0.05]
            assert worked
            assert {os.getpriority(os.PRIO_PROCESS, t) for t in worked} == {os.getpriority(os.PRIO_PROCESS, 0)}
