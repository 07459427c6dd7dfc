"""Workers placed on a Ray cluster: `run_mm.py ... --ray ADDRESS`.

The router (and the HTTP gateway, when there is one) runs in this driver process, as in a local
deployment. Each planned worker is a Ray actor that runs the ordinary worker (workers.worker) in
a thread and connects to the router over tcp: requests never go through Ray, which only places
the workers and restarts them. A restarted actor registers again naming its slot in the plan, so
it takes back its model ID, and the router resends the requests it had in flight, as for a local
worker process that died.

- Resources come from the plan: a CPU worker asks for `num_cpus` = its threads, a CUDA worker for
  `num_gpus` = its share of the device (fractional when copies share a GPU). A variant's
  `resources` model key adds custom resources (pins it to nodes that have them).
- One placement group per variant holds a bundle per copy: `placement: spread` (the default: a
  variant's copies go to different nodes where they can, so they survive the loss of a node) or
  `pack` (together on as few nodes as possible).
- The router binds `ray_router_host` (runconfig) or this node's IP as Ray sees it. The connection
  is always CurveZMQ: the driver uses `curve_keys`, or else keeps a keypair set under
  `<model_dir>/keys` (made on the first run, reused after), and hands each actor the router's
  public key and the workers' keypair through Ray; an actor keeps them in memory (it writes no key
  file, so one killed outright leaves none behind). Clients of the deployment connect with that
  directory (`--curve-keys`); serve prints it.
- On exit (Ctrl-C included) every actor is killed without restart and the placement group is
  removed: nothing of the deployment stays on the cluster.
- Models at run time: a copy loaded while serving gets a placement group of its own, one bundle
  that asks for its threads and for Ray's `memory` resource equal to the copy's size, and its
  actor starts once Ray has placed it. There is no eviction on Ray (no memory_budget): a load that
  Ray cannot place within `load_timeout` is refused. An unloaded copy's actor is killed without
  restart and its placement group removed.

Network note: on a machine whose tests must stay on loopback, every Ray node, the driver and the
router must live on 127.0.0.1 (`ray start --node-ip-address 127.0.0.1`, ray.init with
`_node_ip_address="127.0.0.1"`); see docs/operations.md.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import zmq

from fusion.local import LocalDeployment, SupervisorConfig
from fusion.model_info import MultiModelFusion
from fusion.plan import DeploymentPlan
from wire import protocol as P
from wire.security import ClientKeys, generate
from workers.devices import device_kind

RUN_KEYS = "keys"  # under model_dir: the deployment's CurveZMQ keys when runconfig gives none

PLACEMENTS = {"spread": "SPREAD", "pack": "PACK"}
KEY_FILES = ("server.key", "clients/worker.key_secret")  # what a worker's connect_curve reads


def import_ray():
    """ray, or a clear error saying how to get it."""
    try:
        import ray
    except ImportError:
        raise RuntimeError('--ray needs the Ray extra: pip install -e ".[ray]"') from None
    return ray


def placement_strategy(name: str) -> str:
    if name not in PLACEMENTS:
        raise ValueError(f"runconfig.placement must be one of {sorted(PLACEMENTS)}, got {name!r}")
    return PLACEMENTS[name]


def bundles(fusion: MultiModelFusion, plan: DeploymentPlan) -> list[dict[str, float]]:
    """The resources of each planned worker, in plan order: what its actor asks Ray for."""
    per_device: dict[str, int] = {}
    for w in plan.workers:
        per_device[w.device] = per_device.get(w.device, 0) + 1
    out = []
    for w in plan.workers:
        b = device_kind(w.device).ray_bundle(w.threads, round(1.0 / per_device[w.device], 4))
        extra = w.spec.model.resources or {}
        b.update({str(k): float(v) for k, v in extra.items()})
        out.append(b)
    return out


class WorkerActor:
    """One worker of the deployment, living in a Ray actor process (ray.remote is applied at
    deployment time, so this module imports without Ray)."""

    def __init__(self, backend: str, slot: int, threads: int, keys: dict[str, str], env: dict[str, str],
                 resources: dict[str, float]):
        import ray

        from workers.worker import Worker, WorkerConfig

        os.environ.update(env)
        # the keys stay in this process's memory: an actor killed outright leaves no private key behind
        client_keys = ClientKeys.from_texts(*(keys[name] for name in KEY_FILES))
        ctx = ray.get_runtime_context()
        self.where = {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                      "host": socket.gethostname(), "pid": os.getpid(), "resources": resources,
                      "actor_id": ctx.get_actor_id()}
        # the output work on a thread: an actor's process has Ray's threads, which a fork would not copy
        config = WorkerConfig(backend=backend, num_threads=threads, curve_keys=client_keys, slot=slot,
                              placement=dict(self.where), output="thread")
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.worker = Worker(config)
        self.thread = threading.Thread(target=self.worker.run, name="worker", daemon=True)
        self.thread.start()

    def info(self) -> dict:
        return {**self.where, "running": self.thread.is_alive()}


class RayDeployment(LocalDeployment):
    """A LocalDeployment whose workers are Ray actors: same router, same client interface."""

    def __init__(self, fusion: MultiModelFusion, plan: DeploymentPlan, run: dict, log=None, catalog=None):
        self.ray = import_ray()
        self.strategy = placement_strategy(run.get("placement") or "spread")
        # off loopback with no set-up: a keypair set kept where the user finds it, for clients too
        keys = str(Path(run["curve_keys"] or Path(run["model_dir"]) / RUN_KEYS).resolve())
        generate(keys, ["client", "worker"])
        self.address = run["ray"]
        self.host = run.get("ray_router_host")
        self.run_id = f"mmfusion-{os.getpid()}-{int(time.time())}"
        router = {k: run[k] for k in ("autoload", "load_timeout", "unload_timeout", "idle_unload_s", "tenants", "min_resident_s",
                                  "max_loads_per_minute") if k in run}
        super().__init__(fusion, plan, run["frontend"], run["backend"],
                         SupervisorConfig(max_restarts=run["max_restarts"]), log=log, curve_keys=keys,
                         insecure=run["insecure"], restart_wait=run["restart_wait"], catalog=catalog, router=router)
        self.bundles = bundles(fusion, plan)
        self.actors: list = []  # by slot; None: a copy loaded at run time that Ray has not placed (or unloaded)
        self.pgs: list = []
        self.where: list[dict | None] = []
        self.pending: dict[int, tuple] = {}  # slot -> (placement group, its ready ref, deadline, bundle, threads)
        self.slot_pgs: dict[int, object] = {}  # slot -> the placement group of a copy loaded at run time
        self.to_stop: set[int] = set()  # slots the router unloaded, stopped on the next look

    @classmethod
    def from_runconfig(cls, fusion: MultiModelFusion, plan: DeploymentPlan, run: dict,
                       catalog=None) -> RayDeployment:
        return cls(fusion, plan, run, catalog=catalog)

    def _connect(self) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        if self.address != "auto" and not self.address.startswith("ray://"):
            # ray.init retries an unreachable host:port for ever: say so now instead
            host, _, port = self.address.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=5).close()
            except (OSError, ValueError) as exc:
                raise RuntimeError(f"--ray {self.address}: no Ray cluster answers there ({exc}); start one with "
                                   "`ray start --head` and give its HOST:PORT, or use --ray auto") from None
        kw = {"address": self.address, "namespace": "mmfusion", "log_to_driver": True,
              "configure_logging": False}
        if self.host:
            kw["_node_ip_address"] = self.host
        ray.init(**kw)

    def __enter__(self) -> RayDeployment:
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._connect()
        host = self.host or ray.util.get_node_ip_address()
        port = self.config.backend.rsplit(":", 1)[1]
        self.config.backend = f"tcp://{host}:{port}"
        # an actor sees only the GPUs Ray gave it (its share is device 0), and Ray places the actors
        # and their CPUs (the plan's cores are this machine's)
        self._start_router([w.spec.placed(device=device_kind(w.device).actor_device(w.device), cpus=None)
                            for w in self.plan.workers])
        slots: dict[str, list[int]] = {}  # variant -> its workers (slots), in plan order
        for i, w in enumerate(self.plan.workers):
            slots.setdefault(self.fusion.models[w.model_id].name, []).append(i)
        where: dict[int, tuple] = {}  # slot -> (placement group, bundle index)
        for name, idx in slots.items():
            pg = placement_group([self.bundles[i] for i in idx], strategy=self.strategy, name=f"{self.run_id}-{name}")
            self.pgs.append(pg)
            where.update({i: (pg, k) for k, i in enumerate(idx)})
        ready, _ = ray.wait([pg.ready() for pg in self.pgs], num_returns=len(self.pgs), timeout=120)
        if len(ready) < len(self.pgs):
            need = ", ".join(f"{b}" for b in self.bundles)
            self.__exit__(None, None, None)
            raise RuntimeError(f"the Ray cluster at {self.address} has no room for this deployment's workers "
                               f"(placement {self.strategy}; bundles {need}); add nodes or resources")
        self._keys = {name: (Path(self.config.curve_keys) / name).read_text() for name in KEY_FILES}
        self._env = {"TQDM_DISABLE": "1", **{k: v for k, v in os.environ.items() if k.startswith(("MMFUSION_", "HF_"))}}
        self._strategy = PlacementGroupSchedulingStrategy
        for i, (w, b) in enumerate(zip(self.plan.workers, self.bundles)):
            self.actors.append(self._actor(i, w.threads, b, *where[i]))
        self.where = [None] * len(self.actors)
        self.restarts = [0] * len(self.actors)
        self._watcher = threading.Thread(target=self._supervise, name="ray-supervisor", daemon=True)
        self._watcher.start()
        return self

    def _actor(self, slot: int, threads: int | None, bundle: dict, pg, index: int):
        """The worker actor of `slot`, in bundle `index` of placement group `pg`."""
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
        return self.ray.remote(WorkerActor).options(
            name=f"{self.run_id}-worker-{slot}", num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            memory=bundle.get("memory"), resources=custom or None, max_restarts=self.supervisor.max_restarts,
            max_task_retries=0, scheduling_strategy=self._strategy(pg, placement_group_bundle_index=index),
        ).remote(self.router.backend_addr, slot, threads, self._keys, self._env, bundle)

    def _order(self, msg: dict, now: float) -> None:
        """start_worker: a placement group for the copy, its actor once Ray placed it (_runtime_slots);
        stop_worker: kill it, for good."""
        from ray.util.placement_group import placement_group

        slot = msg.get("slot")
        if msg["type"] == P.START_WORKER and isinstance(slot, int) and slot >= len(self.actors):
            gpu = min([b["GPU"] for b in self.bundles if "GPU" in b] or [1.0])
            bundle = device_kind(msg.get("device") or "cpu").ray_bundle(msg.get("threads"), gpu)
            bundle["memory"] = float(msg.get("memory") or 0) or None
            bundle.update({str(k): float(v) for k, v in (msg.get("resources") or {}).items()})
            bundle = {k: v for k, v in bundle.items() if v is not None}
            pg = placement_group([bundle], strategy="PACK", name=f"{self.run_id}-slot-{slot}")
            grow = slot + 1 - len(self.actors)  # one that waited for evictions may come after a later one
            self.actors += [None] * grow
            self.where += [None] * grow
            self.restarts += [0] * grow
            self.pending[slot] = (pg, pg.ready(), now + self.config.load_timeout, bundle, msg.get("threads"))
            self.log(f"ray: placing worker slot {slot} ({bundle})")
        elif msg["type"] == P.STOP_WORKER and isinstance(slot, int) and 0 <= slot < len(self.actors):
            self.to_stop.add(slot)

    def _runtime_slots(self, tell: zmq.Socket, now: float) -> None:
        """Start what Ray has placed, refuse what it could not place in time, stop what was unloaded."""
        from ray.util.placement_group import remove_placement_group

        ray = self.ray
        for slot, (pg, ready, deadline, bundle, threads) in list(self.pending.items()):
            done, _ = ray.wait([ready], timeout=0)
            if done:
                self.actors[slot] = self._actor(slot, threads, bundle, pg, 0)
                self.slot_pgs[slot] = pg
                del self.pending[slot]
            elif now > deadline or slot in self.to_stop:
                remove_placement_group(pg)
                del self.pending[slot]
                self.to_stop.discard(slot)
                tell.send(P.pack({"type": P.WORKER_EXITED, "slot": slot, "restart": False,
                                  "why": f"Ray could not place it within load_timeout ({self.config.load_timeout:g}s):"
                                         f" no node has {bundle} free"}))
        for slot in sorted(self.to_stop):
            actor, info = self.actors[slot], self.where[slot] or {}
            if actor is not None:
                ray.kill(actor, no_restart=True)
            if slot in self.slot_pgs:
                remove_placement_group(self.slot_pgs.pop(slot))
            self.actors[slot] = None
            self.to_stop.discard(slot)
            tell.send(P.pack({"type": P.WORKER_EXITED, "pid": info.get("pid"), "host": info.get("host"), "slot": slot,
                              "restart": False}))

    def _watch(self, tell: zmq.Socket, orders: zmq.Socket) -> None:
        """Ask each actor where it is: a changed pid is a restart Ray made, a failed call a death
        (the router hears of it at once, and resends that worker's requests). Start and stop the
        copies loaded and unloaded at run time."""
        ray = self.ray
        period = max(self.supervisor.poll_interval, 0.5)
        while not self._closing.wait(period):
            now = time.monotonic()
            self._orders(orders, now)
            self._runtime_slots(tell, now)
            calls = {a.info.remote(): i for i, a in enumerate(self.actors) if a is not None}
            done, _ = ray.wait(list(calls), num_returns=len(calls), timeout=5)
            for ref in done:
                i = calls[ref]
                try:
                    info = ray.get(ref)
                except Exception as exc:  # the actor died or is restarting
                    self._lost(tell, i, exc)
                    continue
                old = self.where[i]
                if old is not None and old["pid"] != info["pid"]:
                    self._lost(tell, i, None)  # died and came back between two looks
                if old is None or old["pid"] != info["pid"]:
                    if old is not None:
                        self.restarts[i] += 1
                        self.log(f"ray: worker slot {i} restarted by Ray as process {info['pid']} on node "
                                 f"{info['node_ip']} ({info['host']})")
                    self.where[i] = info

    def _lost(self, tell: zmq.Socket, i: int, exc: Exception | None) -> None:
        old = self.where[i]
        if old is None or old.get("reported"):
            return
        old["reported"] = True
        tell.send(P.pack({"type": P.WORKER_EXITED, "pid": old["pid"], "host": old["host"], "slot": i,
                          "restart": True}))
        if exc is not None:
            self.log(f"ray: worker slot {i} (process {old['pid']} on {old['node_ip']}) is gone: "
                     f"{type(exc).__name__}; Ray restarts it (max_restarts {self.supervisor.max_restarts})")

    def _stop_workers(self) -> None:
        ray = self.ray
        for a in self.actors:
            try:
                if a is not None:
                    ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        from ray.util.placement_group import remove_placement_group

        for pg in [*self.pgs, *self.slot_pgs.values(), *(p[0] for p in self.pending.values())]:
            try:
                remove_placement_group(pg)
            except Exception:  # already removed
                pass
        self.actors = []

