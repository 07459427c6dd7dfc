"""The weight owner (workers.weights.owner): one process holds a model's weights, copies attach.
On CPU the seam is torch's file_system sharing; the CUDA test (only where CUDA is present) runs the
same path over CUDA IPC."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from support.owner_copy import Copy

from routing.entrypoints import WEIGHT_OWNER, command
from workers.models import load_engine, load_model

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 33, 2, 99, 4]


def _owner(tmp_path: Path, device: str, source: str = "tiny:llama", quantization: str = "none"):
    """(process, address, key, env) of an owner, started: it prints "weight owner:" once it serves."""
    key = secrets.token_hex(16)
    addr = str(tmp_path / "owner.sock")
    env = {**os.environ, "MMFUSION_OWNER_KEY": key, "MMFUSION_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([*command(WEIGHT_OWNER), "--source", source, "--dtype", "float32", "--quantization",
                             quantization, "--device", device, "--address", addr, "--parent-pid", str(os.getpid())],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    return proc, addr, key, env


def _attached(copies: list[Copy]) -> list[tuple[Copy, dict]]:
    """Each started copy with what it reported once attached."""
    return [(c, c.attached()) for c in copies]


def _start_copies(addr: str, key: str, n: int) -> list[Copy]:
    """Copies attach once the owner answers (attach_remote waits for it)."""
    return [Copy(addr, key, PROMPT) for _ in range(n)]


def _check_owner(tmp_path: Path, device: str) -> None:
    from workers.weights.owner_ipc import ipc_files, remove_ipc_files

    ref = load_model("tiny:llama", dtype="float32", device=device)
    with torch.inference_mode():
        want = ref.model(torch.tensor([PROMPT], device=device)).logits[0].float().cpu()
    owner, addr, key, env = _owner(tmp_path, device)
    stopped = False
    copies = _start_copies(addr, key, 2)  # they start while the owner loads
    try:
        assert "weight owner:" in owner.stdout.readline()
        (a, ra), (b, rb) = _attached(copies)
        for r in (ra, rb):
            assert r["shared"] and r["all_shared"] and r["device"].startswith(device.split(":")[0])
            assert torch.equal(torch.tensor(r["logits"]), want)
            assert r["cuda_allocated_by_copy"] < r["bytes"]  # the weights are the owner's memory
            # q/k/v and gate/up arrive side by side: the lean forward fuses them with no copy
            assert r["groups"] == 2 * 2 and r["groups_apart"] == 0
        a.kill()  # a copy that dies leaves the weights to the others, and a new copy attaches
        ((c, rc),) = _attached(_start_copies(addr, key, 1))
        copies.append(c)
        assert torch.equal(torch.tensor(rc["logits"]), want) and owner.poll() is None
        # a wrong key gets nothing, and the owner goes on serving
        from multiprocessing import AuthenticationError

        from workers.weights.owner import attach_remote

        with pytest.raises(AuthenticationError):
            attach_remote(addr, b"wrong", timeout=10)
        time.sleep(0.5)
        assert owner.poll() is None
        # told to stop while copies hold its tensors (Ctrl-C to the group, then SIGTERM), the owner
        # waits for them to let go, and then exits cleanly
        owner.send_signal(signal.SIGINT)
        owner.terminate()
        stopped = True
        time.sleep(1.5)
        assert owner.poll() is None
    finally:
        for c in copies:
            c.release()
        if not stopped:
            owner.terminate()
        code = owner.wait(30)
    assert code == 0
    remove_ipc_files(owner.pid)  # what the deployment does once an owner has exited (fusion.owners)
    pids = [owner.pid, *(p.pid for p in copies)]
    deadline = time.monotonic() + 10
    while any(ipc_files(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)  # torch's shared-memory manager removes its files once its last user is gone
    assert [f for p in pids for f in ipc_files(p)] == []


def test_owner_shares_weights_with_its_copies_on_cpu(tmp_path):
    _check_owner(tmp_path, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the same path over CUDA IPC")
def test_owner_shares_weights_over_cuda_ipc(tmp_path):
    _check_owner(tmp_path, "cuda:0")


def _check_owner_blocks(tmp_path: Path, device: str, kind: str) -> None:
    from workers.engine import Engine, EngineConfig
    from workers.engine.params import SamplingParams
    from workers.platform import CudaPlatform, for_model

    lm = load_model("tiny:llama", dtype="float32", device=device)
    linears = {f"{n}.weight" for n, m in lm.model.named_modules() if isinstance(m, torch.nn.Linear)}
    if lm.model.lm_head.weight is lm.model.model.embed_tokens.weight:
        linears.discard("lm_head.weight")  # the embedding's: the lookup reads it
    whole = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    cfg = EngineConfig(max_batch_size=4, max_batch_tokens=64, kv_block_size=4, kv_cache_memory=4 << 20,
                       quantization=kind)
    ref = Engine(lm, cfg, platform=for_model(lm, True, kind, cls=CudaPlatform))
    want = ref.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    ref.close()
    owner, addr, key, _env = _owner(tmp_path, device, quantization=kind)
    copies = [Copy(addr, key, PROMPT, quantization=kind, device=device) for _ in range(2)]
    try:
        assert f"its linears as {kind} blocks" in owner.stdout.readline()
        for _c, r in _attached(copies):
            assert r["tokens"] == want
            assert set(r["meta"]) == linears and r["quantized"] == 1 + 4 * lm.model.config.num_hidden_layers
            assert r["own_bytes"] == 0 and (r["blocks_shared"] or device != "cpu")
            assert r["bytes"] < whole / 2  # the embedding and norms, and the blocks
        # a copy asking for other linears than the owner holds is refused by name, and the owner
        # goes on serving
        other = Copy(addr, key, PROMPT, quantization="int4" if kind == "int8" else "int8", device=device)
        copies.append(other)
        assert f"holds its linears as {kind} blocks only" in other.attached()["error"] and owner.poll() is None
    finally:
        for c in copies:
            c.release()
        owner.terminate()
        code = owner.wait(30)
    assert code == 0


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_an_owner_holds_the_blocks_its_quantized_copies_run_in_place_of_their_16_bit_weights(tmp_path, kind):
    """Copies that run weight-only blocks (`quantization: int8`/`int4` on the lean forward) attach
    to an owner that built them once and let the linears' 16-bit weights go: a copy holds no linear
    of its own (the blocks are the owner's memory), leaves those weights on `meta`, and answers as a
    copy with weights of its own and the same quantization does."""
    _check_owner_blocks(tmp_path, "cpu", kind)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the same path over CUDA IPC")
def test_an_owner_holds_the_blocks_of_its_quantized_copies_over_cuda_ipc(tmp_path):
    _check_owner_blocks(tmp_path, "cuda:0", "int4")


def test_an_owner_whose_copies_let_go_frees_its_memory_and_exits_cleanly(tmp_path):
    """Copies that let go of the tensors before they exit leave the owner the last user of its
    shared memory: stopping, it frees the tensors (torch removes those files), removes what is
    left, and exits 0. Removing the files before letting go aborts it at exit, on the CPU as on a
    GPU ("could not unlink the shared memory file")."""
    from workers.weights.owner_ipc import ipc_files

    owner, addr, key, _env = _owner(tmp_path, "cpu")
    copies = _start_copies(addr, key, 2)
    try:
        assert "weight owner:" in owner.stdout.readline()
        for _c, report in _attached(copies):
            assert report["shared"] and report["all_shared"]
        assert ipc_files(owner.pid)  # the owner's tensors in shared memory
    finally:
        for c in copies:
            c.release()
        owner.terminate()
        code = owner.wait(30)
    assert code == 0 and [c.proc.exitcode for c in copies] == [0, 0]
    assert ipc_files(owner.pid) == []


def test_owner_exits_with_its_parent(tmp_path):
    key = secrets.token_hex(16)
    env = {**os.environ, "MMFUSION_OWNER_KEY": key, "MMFUSION_CACHE": str(tmp_path / "cache")}
    spawn = ("import os, subprocess, sys, time; "
             f"p = subprocess.Popen({command(WEIGHT_OWNER, '--source', 'tiny:gpt2', '--device', 'cpu', '--address', str(tmp_path / 'o.sock'))!r}"
             " + ['--parent-pid', str(os.getpid())]); "
             "print(p.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", spawn], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        owner = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 60
        while not (tmp_path / "o.sock").exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        parent.kill()
        parent.wait()
        owner.wait(15)
    finally:
        parent.kill()


def _plan(devices: str, copies: int, share: bool = True):
    from fusion.deploy import build_fusion
    from fusion.plan import make_plan

    params = {"variants": {"m": {"model": {"source": "tiny:llama", "dtype": "float32", "share_weights": share,
                                           "max_batch_size": 8, "max_batch_tokens": 64}},
                           "g": {"model": {"source": "tiny:gpt2", "dtype": "float32"}}},
              "runconfig": {}, "_path": "test"}
    fusion = build_fusion(params, [f"m,{copies}", "g,1"])
    return fusion, make_plan(fusion, None, devices, threads_per_worker=1)


def test_one_owner_per_device_source_and_dtype(monkeypatch):
    from fusion.owners import WeightOwners, owner_groups

    monkeypatch.setattr("fusion.plan.available_bytes", lambda d: None)  # plan for GPUs this machine lacks
    fusion, plan = _plan("cuda:0,cuda:1", 4)  # planning needs no GPU: workers alternate devices
    groups = owner_groups(fusion, plan)
    # worker k serves model k mod 5 (four llama copies, then gpt2) on device k mod 2
    assert groups == {("cuda:0", "tiny:llama", "float32", "none"): [0, 2],
                      ("cuda:1", "tiny:llama", "float32", "none"): [1, 3], ("cuda:0", "tiny:gpt2", "float32", "none"): [4]}
    owners = WeightOwners(fusion, plan, print)
    owners.address = {g: f"/x/{i}" for i, g in enumerate(groups)}
    assert owners.addresses() == {0: "/x/0", 2: "/x/0", 1: "/x/1", 3: "/x/1", 4: "/x/2"}
    assert owner_groups(*_plan("cpu", 4)) == {}  # CPU copies map a file: no owner
    assert owner_groups(*_plan("cuda:0", 2, share=False)) == {("cuda:0", "tiny:gpt2", "float32", "none"): [2]}


def test_an_owner_that_cannot_load_is_given_up_on_with_a_clear_error(tmp_path, capfd):
    from fusion.owners import WeightOwners

    fusion, plan = _plan("cpu", 1)
    lines = []
    owners = WeightOwners(fusion, plan, lines.append, max_restarts=1, backoff=0.01)
    owners.groups = {("cpu", "/no/such/model", "float32", "none"): [0]}  # as a CUDA group would be planned
    owners.start()
    try:
        deadline = time.monotonic() + 120
        while not owners.gave_up:
            assert time.monotonic() < deadline
            owners.check()
            time.sleep(0.05)
    finally:
        owners.stop()
    assert len(owners.pids) == 2 and "restart 1/1" in lines[0] and "not starting it again" in lines[-1]
    assert "weight owner: cannot serve /no/such/model on cpu: unknown model source" in capfd.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: copies on one GPU attach to its owner")
def test_deployment_copies_on_one_gpu_share_an_owner(tmp_path, monkeypatch):
    import signal

    from fusion.local import LocalDeployment
    from routing.client import Client
    from workers.request_params import sampling_params

    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path / "cache"))
    fusion, plan = _plan("cuda:0", 3)
    sp, _ = sampling_params({"max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    want = load_engine("tiny:llama", dtype="float32", device="cuda:0", max_batch_size=4,
                              max_batch_tokens=64).generate([PROMPT], sp)[0].outputs[0].token_ids
    d = LocalDeployment(fusion, plan, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    d.__enter__()
    try:
        d.wait_loaded(300)
        owner_pids = [p.pid for p in d.owners.procs.values()]
        with Client(d.frontend, timeout=120) as c:
            def answers(ids):
                return [c.complete(i, PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True,
                                   return_token_ids=True)["choices"][0]["token_ids"] for i in ids]

            assert answers([0, 1, 2]) == [want] * 3  # the three llama copies (model 3 is gpt2)
            ws = [w for w in c.status()["workers"] if w["alive"] and w["model_id"] in (0, 1, 2)]
            assert all(w["weights"]["shared"] and w["weights"]["path"].startswith("owner:") for w in ws)
            print(subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"],
                                 capture_output=True, text=True).stdout)
            victim = ws[0]
            os.kill(victim["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 120
            while not any(w["alive"] and w["loaded"] and w["model_id"] == victim["model_id"]
                          and w["pid"] != victim["pid"] for w in c.status()["workers"]):
                assert time.monotonic() < deadline, "the killed copy did not come back"
                time.sleep(0.5)
            assert answers([0, 1, 2]) == [want] * 3  # the restarted copy attached again
    finally:
        d.__exit__(None, None, None)
    from workers.weights.owner_ipc import ipc_files

    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in owner_pids)
    assert [f for p in owner_pids for f in ipc_files(p)] == []


def test_the_plan_counts_cuda_contexts_and_each_owner(monkeypatch):
    from workers.devices import CPU_WORKER_OVERHEAD_BYTES as OVERHEAD_BYTES
    from workers.devices import CUDA_OWNER_OVERHEAD_BYTES, CUDA_WORKER_OVERHEAD_BYTES

    monkeypatch.setattr("fusion.plan.available_bytes", lambda d: 64 * 2**30)
    fusion, plan = _plan("cuda:0", 3)  # three llama copies share an owner; gpt2 has one of its own
    ws = plan.workers
    assert all(w.est_bytes == w.weight_bytes + w.packed_bytes + w.kv_cache_bytes + CUDA_WORKER_OVERHEAD_BYTES
               for w in ws)
    # the llama copies' lean forward fuses q/k/v and gate/up over the owner's weights: no copy of its own
    assert [w.packed_bytes for w in ws] == [0] * 4
    weights = ws[0].weight_bytes + ws[3].weight_bytes  # once per owner
    assert plan.devices["cuda:0"]["estimated_bytes"] == (sum(w.kv_cache_bytes + w.packed_bytes for w in ws) + weights
                                                         + 4 * CUDA_WORKER_OVERHEAD_BYTES + 2 * CUDA_OWNER_OVERHEAD_BYTES)
    _, cpu = _plan("cpu", 3)
    assert all(w.est_bytes == w.weight_bytes + w.packed_bytes + w.kv_cache_bytes + OVERHEAD_BYTES for w in cpu.workers)
    assert "owner process" in plan.describe() and "owner process" not in cpu.describe()


def test_quantized_copies_on_a_gpu_share_an_owner_of_blocks_and_the_plan_counts_them_once(monkeypatch):
    """Copies of one model on one GPU that run weight-only blocks attach to an owner of their own,
    which holds the blocks and the embedding, not the 16-bit linears: the plan counts those once,
    and copies of the same model without blocks keep their owner of 16-bit weights."""
    from fusion.deploy import build_fusion
    from fusion.owners import owner_groups
    from fusion.plan import make_plan

    monkeypatch.setattr("fusion.plan.available_bytes", lambda d: 64 * 2**30)
    model = {"source": "smollm2-135m", "dtype": "bfloat16", "share_weights": True, "max_batch_size": 8,
             "max_batch_tokens": 64, "kv_cache_memory": "64MiB"}
    params = {"variants": {"q": {"model": {**model, "quantization": "int8"}}, "d": {"model": model}},
              "runconfig": {}, "_path": "test"}
    fusion = build_fusion(params, ["q,3", "d,1"])
    plan = make_plan(fusion, None, "cuda:0", threads_per_worker=1)
    assert owner_groups(fusion, plan) == {("cuda:0", "smollm2-135m", "bfloat16", "int8"): [0, 1, 2],
                                          ("cuda:0", "smollm2-135m", "bfloat16", "none"): [3]}
    q, d = plan.workers[0], plan.workers[3]
    assert q.packed_bytes == 0 and 0 < q.shared_packed_bytes < d.weight_bytes * 0.55  # 34 bytes a block of 32
    assert q.weight_bytes == 49152 * 576 * 2 < d.weight_bytes  # the embedding alone
    from workers.devices import CUDA_OWNER_OVERHEAD_BYTES, CUDA_WORKER_OVERHEAD_BYTES

    assert plan.devices["cuda:0"]["estimated_bytes"] == (
        q.weight_bytes + q.shared_packed_bytes + d.weight_bytes + 2 * CUDA_OWNER_OVERHEAD_BYTES
        + sum(w.kv_cache_bytes + CUDA_WORKER_OVERHEAD_BYTES for w in plan.workers))
    assert "its int8 linears" in plan.describe()
    # a copy loaded at run time there attaches to no owner: its blocks and the embedding are its own
    from fusion.catalog import PlanPlacer

    placer = PlanPlacer(["cuda:0"], "64MiB", {"cuda:0": None})
    size = placer.size(fusion.models[0].spec, "cuda:0")
    assert size.own == q.weight_bytes + q.shared_packed_bytes + q.kv_cache_bytes + CUDA_WORKER_OVERHEAD_BYTES
