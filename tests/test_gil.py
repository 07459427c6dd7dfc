"""A busy worker is not a dead one: the C++ kernels let go of the GIL while they run, so a worker's
other threads (its I/O thread's heartbeats among them) go on during a long kernel call; and a
deployment whose cores are all busy serves a long prompt without its worker declared lost."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch

from workers.engine.cpu import extension
from workers.quant.weight import INT4, quantize


def _spinning(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_another_thread_runs_during_a_long_kernel_call():
    kernels = extension.kernel_module()
    if kernels is None:
        pytest.skip(f"the C++ kernels are not built here: {extension.build_error()}")
    gen = torch.Generator().manual_seed(0)
    qw = quantize(torch.randn(2048, 2048, generator=gen), INT4)
    x = torch.randn(512, 2048, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel on one core, the counting thread free to take the other
    try:
        call = lambda: kernels.qlinear_int4(x, qw.qs, qw.scales, qw.offsets, None, False)  # noqa: E731
        call()
        t = time.perf_counter()
        call()
        alone = time.perf_counter() - t
        progress = []
        running = threading.Event()

        def count():
            running.set()
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < 0.5 + 4 * alone:
                n += 1
                progress.append((time.perf_counter(), n))

        counter = threading.Thread(target=count)
        counter.start()
        running.wait()
        time.sleep(0.05)
        t0 = time.perf_counter()
        call()
        t1 = time.perf_counter()
        counter.join()
    finally:
        torch.set_num_threads(threads)
    assert alone > 0.03, alone  # a call long enough to tell: several switch intervals of 5 ms
    # the counter holds the GIL when the call starts and keeps it up to one switch interval (5 ms)
    # before the call has it, and may take it for as long again between the call's return and t1;
    # in between, a call holding the GIL would leave it nothing
    inside = [n for at, n in progress if t0 + 0.01 + 0.1 * (t1 - t0) <= at <= t1 - 0.01]
    assert len(inside) > 1000, (len(inside), t1 - t0)


@pytest.mark.slow
def test_a_deployment_with_busy_cores_serves_a_long_prompt_in_every_mode(tmp_path, smollm2_fp32):
    """Busy loops on every core (bounded in time) while SmolLM2 (in the CPU's `auto` dtype), with
    and without `deterministic`, prefills a 700-token prompt (a full chunk of 512, then the rest): no
    worker lost, both answers come."""
    import yaml
    from support.cluster import free_port

    from fusion.deploy import build_fusion
    from fusion.local import LocalDeployment
    from fusion.params import load_params
    from fusion.plan import make_plan
    from routing.client import Client

    model = {"source": "smollm2-135m", "dtype": "auto", "max_batch_tokens": 512, "max_model_len": 2048}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"variants": {"plain": {"model": model},
                                                 "fixed": {"model": {**model, "deterministic": True}}},
                                    "runconfig": {"threads_per_worker": 1}}))
    params = load_params(path)
    fusion = build_fusion(params, ["plain,1", "fixed,1"])
    plan = make_plan(fusion, None, "cpu", 1)
    prompt = [(i * 7919) % 40000 + 100 for i in range(700)]
    with LocalDeployment(fusion, plan, f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") as dep:
        dep.wait_loaded(timeout=300)
        busy = [multiprocessing.get_context("fork").Process(target=_spinning, args=(90.0,), daemon=True)
                for _ in range(multiprocessing.cpu_count() or 1)]
        for p in busy:
            p.start()
        try:
            with Client(dep.frontend, timeout=300) as c:
                for name in ("plain", "fixed"):
                    res = c.complete(model=name, prompt=prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
                    assert res["usage"]["completion_tokens"] == 4, name
                workers = c.status()["workers"]
        finally:
            for p in busy:
                p.kill()
                p.join()
    assert len(workers) == 2 and all(w["alive"] and w["lost"] is None for w in workers), workers
