"""Workers placed on a Ray cluster: a two-node cluster simulated on this machine (ray.cluster_utils),
every node, the driver and the router on 127.0.0.1 (the network rule of these machines)."""

from __future__ import annotations

import os

# Ray's "this machine only" mode: its own addresses resolve to loopback. Without it a
# cluster_utils node advertises this machine's interface address, which these machines may not
# use (and ray.init hangs on it). Read once, when ray is first imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml
from support.cluster import free_port
from support.models import tiny

from fusion.deploy import build_fusion
from fusion.params import load_params
from fusion.plan import make_plan
from fusion.ray_cluster import RayDeployment, bundles
from routing.client import Client
from routing.entrypoints import CLI, command
from workers.engine import Engine
from workers.engine.params import SamplingParams

# the ray extra (make install puts it in the test set-up; without it these tests have nothing to run on)
ray = pytest.importorskip("ray")
Cluster = pytest.importorskip("ray.cluster_utils").Cluster

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = "127.0.0.1"


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on this machine; node_a and node_b are custom resources naming them."""
    # nothing goes through Ray's object store: keep /dev/shm free. Ray's files (its sessions' logs
    # and sockets, the current cluster's address) go to a directory of this fixture's, removed
    # after (Ray leaves /tmp/ray behind); a short path, since the sockets inside must fit a unix
    # socket's 107 bytes. RAY_TMPDIR, not a node's temp_dir: the address file ignores the latter
    scratch = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = scratch
    small = {"object_store_memory": 100 * 2**20}
    try:
        c = Cluster(initialize_head=True, head_node_args={
            "node_ip_address": LOOPBACK, "num_cpus": 3, "resources": {"node_a": 4}, "include_dashboard": False,
            **small})
        c.add_node(node_ip_address=LOOPBACK, num_cpus=3, resources={"node_b": 4}, **small)
        c.wait_for_nodes()
        ray.init(address=c.address, _node_ip_address=LOOPBACK, namespace="mmfusion", configure_logging=False)
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        yield c, {("node_a" if "node_a" in r else "node_b"): nid for nid, r in nodes.items()}
        ray.shutdown()
        c.shutdown()
    finally:  # a cluster that failed to start leaves nothing either
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before
        shutil.rmtree(scratch, ignore_errors=True)


def _params(tmp_path: Path, variants: dict, **run) -> dict:
    data = {"variants": {name: {"model": {"source": f"tiny:{arch}", "dtype": "float32", "max_batch_size": 4,
                                          "max_batch_tokens": 64, "temperature": 0.0, **model}}
                         for name, (arch, model) in variants.items()},
            "runconfig": {"threads_per_worker": 1, "devices": "cpu", "max_restarts": 3, "restart_wait": 60,
                          "frontend": f"tcp://{LOOPBACK}:*",
                          "backend": f"tcp://{LOOPBACK}:*", "ray_router_host": LOOPBACK, **run}}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_params(path)


def _deployment(params: dict, address: str, variants: list[tuple[str, int]]) -> RayDeployment:
    run = params["runconfig"]
    run["ray"] = address
    fusion = build_fusion(params, [f"{n},{k}" for n, k in variants])
    plan = make_plan(fusion, None, "cpu", 1)
    return RayDeployment.from_runconfig(fusion, plan, run)


def _greedy(prompt: list[int], n: int, arch: str) -> list[int]:
    out = Engine(tiny(arch, "float32")).generate([prompt], SamplingParams(max_tokens=n, temperature=0,
                                                                         ignore_eos=True))
    return out[0].outputs[0].token_ids


def test_bundles_ask_for_threads_gpu_shares_and_custom_resources(tmp_path):
    params = _params(tmp_path, {"llama": ("llama", {}), "gpt2": ("gpt2", {"resources": {"node_b": 1}})})
    fusion = build_fusion(params, ["llama,2", "gpt2,1"])
    plan = make_plan(fusion, None, "cpu", 1)
    assert bundles(fusion, plan) == [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0, "node_b": 1.0}]
    gpu = make_plan(fusion, None, "cuda:0", 1)
    assert [b.get("GPU") for b in bundles(fusion, gpu)] == [0.3333] * 3
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"variants": {"x": {"model": {"source": "tiny:llama", "resources": {"a": -1}}}}}))
    with pytest.raises(ValueError, match="variants.x.model.resources must be a mapping of Ray resource names"):
        load_params(bad)


def _tmp_leftovers() -> set[str]:
    """What a deployment may have put in the temporary directory (its keys, its owners' sockets)."""
    return {p.name for p in Path(tempfile.gettempdir()).glob("mmfusion-*")}


def test_workers_on_both_nodes_answer_as_locally_survive_sigkill_and_leave_nothing(cluster, tmp_path):
    c, node = cluster
    before = _tmp_leftovers()
    params = _params(tmp_path, {"llama": ("llama", {}), "gpt2": ("gpt2", {"resources": {"node_b": 1}})})
    dep = _deployment(params, c.address, [("llama", 2), ("gpt2", 1)])
    with dep:
        dep.wait_loaded(timeout=300)
        with Client(dep.frontend, timeout=60, **dep.client_kw()) as cl:
            workers = cl.status()["workers"]
            where = {w["slot"]: w["placement"] for w in workers}
            # spread: the llama copies on both nodes; the pinned gpt2 copy only where node_b is
            assert {where[0]["node_id"], where[1]["node_id"]} == {node["node_a"], node["node_b"]}
            assert where[2]["node_id"] == node["node_b"]
            assert all(p["resources"]["CPU"] == 1.0 for p in where.values()) and where[2]["resources"]["node_b"] == 1
            assert all(w["pid"] == where[w["slot"]]["pid"] for w in workers)
            # answers equal the engine's (what a local deployment answers), for every copy
            prompt = [5, 17, 29, 41, 53]
            for model, arch in ((0, "llama"), (1, "llama"), (2, "gpt2")):
                res = cl.complete(model=model, prompt=prompt, max_tokens=6, temperature=0, return_token_ids=True)
                assert res["choices"][0]["token_ids"] == _greedy(prompt, 6, arch), model

            # SIGKILL the worker streaming a long request: Ray restarts it, the stream completes
            # long enough to be still streaming when status is asked (this model makes thousands of
            # tokens a second: 60 were done once before the question)
            want = _greedy(prompt, 480, "llama")
            got, errors = [], []

            def consume():
                try:
                    with Client(dep.frontend, timeout=120, **dep.client_kw()) as c2:
                        for ch in c2.stream(model="llama", prompt=prompt, max_tokens=480, temperature=0, ignore_eos=True,
                                            return_token_ids=True):
                            got.extend(ch["token_ids"])
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            t = threading.Thread(target=consume)
            t.start()
            deadline = time.monotonic() + 60
            busy = []
            while not busy and len(got) < len(want) and time.monotonic() < deadline:
                if len(got) >= 3:
                    busy = [w for w in cl.status()["workers"] if w["inflight"] and w["slot"] in (0, 1)]
                time.sleep(0.005)
            assert len(got) >= 3 and len(busy) == 1, (len(got), busy)
            slot, old_pid = busy[0]["slot"], busy[0]["pid"]
            os.kill(old_pid, signal.SIGKILL)
            t.join(180)
            assert not errors and got == want  # resent to the other copy, the stream continued
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                ws = cl.status()["workers"]
                back = [w for w in ws if w["slot"] == slot and w["alive"] and w["loaded"]]
                if back and back[0]["pid"] != old_pid:
                    break
                time.sleep(0.5)
            else:
                raise AssertionError(f"slot {slot} not restarted by Ray: {ws}")
            # status shows the restart: the old process dead, the new one on the same slot and model
            assert back[0]["model_id"] == slot and any(w["slot"] == slot and not w["alive"] for w in ws)
            assert back[0]["placement"]["actor_id"] == where[slot]["actor_id"]  # the same actor, restarted
            res = cl.complete(model=slot, prompt=prompt, max_tokens=6, temperature=0, return_token_ids=True)
            assert res["choices"][0]["token_ids"] == _greedy(prompt, 6, "llama")
        names = [f"{dep.run_id}-worker-{i}" for i in range(3)]
        pgs = list(dep.pgs)
    for name in names:  # no actor of the deployment left, and its placement groups removed
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace="mmfusion")
    assert len(pgs) == 2 and all(ray.util.placement_group_table(pg)["state"] == "REMOVED" for pg in pgs)
    # no private key left behind, the SIGKILLed actor's included: the actors hold them in memory
    assert _tmp_leftovers() <= before, _tmp_leftovers() - before


def test_run_mm_serve_with_ray_names_its_keys_and_stops_every_actor_on_sigint(cluster, tmp_path):
    """With no curve_keys the run's keypairs live under model_dir/keys, serve prints where, and a
    ZeroMQ client connects with them; a model loaded at run time is an actor placed with its memory,
    and unloading it kills that actor; SIGINT then leaves nothing on the cluster."""
    c, _ = cluster
    params = _params(tmp_path, {"llama": ("llama", {}), "gpt2": ("gpt2", {})})
    path = tmp_path / "serve.yaml"
    run = params["runconfig"]
    path.write_text(yaml.safe_dump({"variants": {n: {"model": params["variants"][n]["model"]} for n in ("llama", "gpt2")},
                                    "runconfig": {**{k: run[k] for k in ("threads_per_worker", "devices", "frontend",
                                                                         "backend", "ray_router_host", "restart_wait")},
                                                  "model_dir": str(tmp_path / "md")}}))
    env = {**os.environ, "RAY_ADDRESS": c.address}
    proc = subprocess.Popen([*command(CLI), "--mode", "serve", "--params", str(path), "--variants",
                             "llama,2", "--ray", c.address], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serving: CurveZMQ keys in"):
                break
        keys = tmp_path / "md" / "keys"
        assert f"--curve-keys {keys}" in lines[-1], "".join(lines)
        deadline = time.monotonic() + 300
        alive = []
        while time.monotonic() < deadline:  # the actors of this run, alive on the cluster
            alive = [a for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["namespace"] == "mmfusion" and "-worker-" in a["name"]]
            if len(alive) == 2:
                break
            time.sleep(0.5)
        assert len(alive) == 2, "".join(lines)
        frontend = next(ln for ln in lines if ln.startswith("serving: clients")).split()[4]
        with Client(frontend, timeout=120, curve_keys=str(keys)) as cl:
            got = cl.complete(model="llama", prompt=[5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True,
                              return_token_ids=True)
            assert got["choices"][0]["token_ids"] == _greedy([5, 6, 7], 4, "llama")
            loaded = cl.load("gpt2", timeout=300)["copies"]
            assert [x["state"] for x in loaded] == ["loaded"] and loaded[0]["id"] == 2
            (w,) = [w for w in cl.status()["workers"] if w["model_id"] == 2 and w["alive"]]
            assert w["placement"]["resources"]["memory"] > 2**20  # the copy's size, asked of Ray
            got = cl.complete(model="gpt2", prompt=[5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True,
                              return_token_ids=True)
            assert got["choices"][0]["token_ids"] == _greedy([5, 6, 7], 4, "gpt2")
            assert cl.unload("gpt2", timeout=120)["copies"] == []
            names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "mmfusion"}
            assert f"{alive[0]['name'].rsplit('-', 1)[0]}-2" not in names  # the unloaded copy's actor is gone
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, "".join(lines) + out
        assert "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
    left = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] in {x["name"] for x in alive}]
    assert left == []


def test_losing_a_node_moves_its_requests_and_workers_to_the_survivor(cluster, tmp_path):
    """Runs last in this module: it takes node_b away (and puts a fresh one back for anything after)."""
    c, node = cluster
    params = _params(tmp_path, {"llama": ("llama", {})})
    prompt = [7, 8, 9, 10]
    want = _greedy(prompt, 40, "llama")
    with _deployment(params, c.address, [("llama", 2)]) as dep:
        dep.wait_loaded(timeout=300)
        with Client(dep.frontend, timeout=120, **dep.client_kw()) as cl:
            where = {w["slot"]: w["placement"] for w in cl.status()["workers"]}
            on_b = next(s for s, p in where.items() if p["node_id"] == node["node_b"])
            on_a = 1 - on_b
            got: list[int] = []
            errors: list[Exception] = []

            def consume():
                try:
                    with Client(dep.frontend, timeout=120, **dep.client_kw()) as c2:
                        for ch in c2.stream(model="llama", prompt=prompt, max_tokens=40, temperature=0,
                                            ignore_eos=True, return_token_ids=True):
                            got.extend(ch["token_ids"])
                except Exception as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            # keep node_a's copy busy, so that the least-loaded choice for the stream is node_b's: one
            # request after another until the stream is placed (a single 400-token request finished
            # before the stream's third token on a fast CPU)
            placed = threading.Event()

            def occupy():  # a client per thread: a Client is not shared between threads
                with Client(dep.frontend, timeout=120, **dep.client_kw()) as c3:
                    while not placed.is_set():
                        c3.complete(model=on_a, prompt=prompt, max_tokens=400, n=4, temperature=0, ignore_eos=True)

            # two of them, so that one is in flight while the other sends its next request
            busy = [threading.Thread(target=occupy, daemon=True) for _ in range(2)]
            for b in busy:
                b.start()
            while not [w for w in cl.status()["workers"] if w["slot"] == on_a and w["inflight"]]:
                time.sleep(0.01)
            t = threading.Thread(target=consume)
            t.start()
            deadline = time.monotonic() + 60
            while len(got) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            try:
                assert sorted(w["slot"] for w in cl.status()["workers"] if w["inflight"]) == sorted([on_a, on_b])
            finally:
                placed.set()
            c.remove_node(next(iter(c.worker_nodes)))  # node_b, its raylet and every worker on it
            t.join(180)
            for b in busy:
                b.join(180)
            assert not errors and got == want  # resent to the copy on node_a
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                ws = cl.status()["workers"]
                back = [w for w in ws if w["slot"] == on_b and w["alive"] and w["loaded"]]
                if back:
                    break
                time.sleep(0.5)
            else:
                raise AssertionError(f"slot {on_b} did not come back: {ws}")
            assert back[0]["placement"]["node_id"] == node["node_a"]  # Ray found room on the survivor
            res = cl.complete(model="llama", prompt=prompt, max_tokens=5, temperature=0, return_token_ids=True)
            assert res["choices"][0]["token_ids"] == want[:5]
    c.add_node(node_ip_address=LOOPBACK, num_cpus=3, resources={"node_b": 4}, object_store_memory=100 * 2**20)
    c.wait_for_nodes()


def test_without_ray_installed_the_error_says_how_to_get_it(monkeypatch):
    from fusion.ray_cluster import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where the extra is missing
    with pytest.raises(RuntimeError, match=r'--ray needs the Ray extra: pip install -e "\.\[ray\]"'):
        import_ray()


def test_a_ray_address_where_nothing_answers_is_a_clear_error(tmp_path):
    params = _params(tmp_path, {"llama": ("llama", {})})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"variants": {"llama": {"model": params["variants"]["llama"]["model"]}}}))
    out = subprocess.run([*command(CLI), "--mode", "serve", "--params", str(path), "--variants",
                          "llama,1", "--ray", f"{LOOPBACK}:{free_port()}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "no Ray cluster answers there" in out.stderr, out.stderr[-2000:]
