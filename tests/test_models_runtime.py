"""Models at run time, for real: a deployment of tiny models whose memory budget holds two copies
loads, evicts and unloads worker processes while clients keep sending to all four variants."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from support.cluster import ANY_PORT, ROOT, engine_reference

from fusion import launcher
from fusion.catalog import PlanPlacer, make_catalog
from fusion.deploy import build_fusion
from fusion.local import LocalDeployment
from fusion.plan import make_plan
from routing.client import AsyncClient, Client, RouterError
from routing.entrypoints import CLIENT, command
from wire import protocol as P
from workers.spec import ModelSpec

ARCHS = {"llama": "llama", "gpt2": "gpt2", "mistral": "mistral", "opt": "opt"}
PROMPTS = [[5, 6, 7], [9, 3], [40, 41, 42, 43]]
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}


def params() -> dict:
    variants = {n: {"model": {"source": f"tiny:{a}", "dtype": "float32", "max_batch_size": 4, "max_batch_tokens": 64}}
                for n, a in ARCHS.items()}
    return {"variants": variants, "runconfig": {}}


def two_copies_budget(specs: dict[str, ModelSpec]) -> int:
    """Room for any two copies, never three."""
    sizes = sorted(PlanPlacer(["cpu"], "auto", {"cpu": 2**40}).size(s, "cpu").alone for s in specs.values())
    budget = sizes[-1] + sizes[-2] + sizes[0] // 2
    assert sum(sizes[:3]) > budget
    return budget


def deployment(pin_first: bool = False, **router) -> tuple[LocalDeployment, int]:
    p = params()
    p["variants"]["llama"]["model"]["pin"] = pin_first
    fusion = build_fusion(p, ["llama,1"])
    plan = make_plan(fusion, None, "cpu", threads_per_worker=1)
    specs = {n: ModelSpec.from_params(n, v["model"]) for n, v in p["variants"].items()}
    budget = two_copies_budget(specs)
    catalog = make_catalog(fusion, plan, specs, {"memory_budget": budget, "kv_cache_memory": "auto"})
    assert PlanPlacer(["cpu"], "auto", {"cpu": budget}).size(specs["gpt2"], "cpu") == \
        PlanPlacer(["cpu"], "auto", {"cpu": 2**40}).size(specs["gpt2"], "cpu")  # sized as the budget check assumed
    dep = LocalDeployment(fusion, plan, ANY_PORT, ANY_PORT, catalog=catalog, router=router)
    return dep, budget


def workers_pss() -> int:
    """The summed PSS of this process's worker processes (forked by its fork server)."""
    total = 0
    for proc in launcher.forked_workers(os.getpid()):
        try:
            total += proc.memory_full_info().pss
        except psutil.Error:
            pass  # exited between the listing and the read
    return total


def test_alternating_models_under_a_two_copy_budget_answer_every_request_exactly():
    dep, budget = deployment(pin_first=True, unload_timeout=30.0)
    refs = {(n, i): engine_reference(a, PROMPTS[i], max_tokens=6, temperature=0.0, ignore_eos=True)
            for n, a in ARCHS.items() for i in range(len(PROMPTS))}
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], workers_pss())
            stop.wait(0.1)

    with dep:
        dep.wait_loaded(120)
        pinned = Client(dep.frontend, timeout=30).status()["workers"][0]
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        def client(k: int) -> list:
            got = []
            with Client(dep.frontend, timeout=300) as c:
                for r in range(2):
                    for j, name in enumerate(ARCHS):
                        i = (k + r + j) % len(PROMPTS)
                        out = c.complete(name, PROMPTS[i], **GREEDY)
                        got.append(((name, i), out["choices"][0]["token_ids"]))
            return got

        with ThreadPoolExecutor(4) as pool:
            answers = [a for f in [pool.submit(client, k) for k in range(4)] for a in f.result()]
        stop.set()
        sampler.join(5)
        with Client(dep.frontend, timeout=30) as c:
            status, models = c.status(), c.models()
    assert len(answers) == 4 * 2 * 4
    assert all(tokens == refs[key] for key, tokens in answers)
    life = status["models"]
    assert life["loads"] >= 3 and life["load_failures"] == 0 and life["evictions"].get("evicted", 0) >= 2
    assert life["loads"] == life["autoloads"]  # each load started by a request, one per copy
    assert peak[0] <= 1.1 * budget, f"workers' PSS peaked at {peak[0] / 2**20:.0f} MiB, budget {budget / 2**20:.0f}"
    # the pinned model's first worker served throughout: never evicted, never replaced
    (w0,) = [w for w in status["workers"] if w["model_id"] == 0]
    assert w0["alive"] and w0["pid"] == pinned["pid"] and w0["id"] == pinned["id"]
    assert {m["state"] for m in models if m["id"] is not None} <= {P.STATE_LOADED, P.STATE_LOADING,
                                                                     P.STATE_UNLOADING}


def test_load_unload_and_bad_input_through_the_clients():
    dep, budget = deployment(unload_timeout=20.0)
    with dep:
        dep.wait_loaded(120)
        with Client(dep.frontend, timeout=120) as c:
            c.complete("llama", [1, 2], max_tokens=2)
            alone = workers_pss()  # llama's worker, warmed up
            c.load("opt")
            assert workers_pss() > alone + 32 * 2**20  # (forked workers share pages: PSS splits them)
            assert c.unload("opt")["copies"] == []
            assert workers_pss() <= 1.1 * alone  # the unloaded worker's memory came back
            out = c.load("gpt2", copies=1, pin=True)
            assert [x["state"] for x in out["copies"]] == [P.STATE_LOADED] and out["copies"][0]["pinned"]
            assert out["copies"][0]["resident_bytes"] > 0
            assert c.load("llama", pin=True)["copies"][0]["pinned"]  # pins the running copy, loads nothing
            before = {m["id"] for m in c.models()}
            for bad, code in [(dict(model="nope"), P.UNKNOWN_MODEL), (dict(model="gpt2", copies=0), P.BAD_REQUEST),
                              (dict(model="opt", copies=1, pin=True), P.NO_MEMORY)]:
                with pytest.raises(RouterError) as err:
                    c.load(**bad)
                assert err.value.code == code
            assert {m["id"] for m in c.models()} == before  # nothing changed, nothing evicted
            with pytest.raises(RouterError) as err:
                c.unload("opt")
            assert err.value.code == P.BAD_REQUEST and "not loaded" in str(err.value)

            # an unload waits for the request in flight, which completes
            done = {}
            t = threading.Thread(target=lambda: done.update(r=Client(dep.frontend, timeout=120).complete(
                "llama", [1, 2, 3], max_tokens=200, temperature=0.0, ignore_eos=True)))
            t.start()
            time.sleep(0.5)
            left = c.unload("llama")  # pinned, but an explicit unload is allowed
            t.join(60)
            assert left["copies"] == [] and done["r"]["choices"][0]["finish_reason"] == "length"
            assert len(done["r"]["choices"][0]["text"]) > 0
            names = {m["name"]: m for m in c.models()}
            assert names["llama"]["id"] is None and names["llama"]["state"] == P.STATE_AVAILABLE

        async def async_load():
            async with AsyncClient(dep.frontend, timeout=120) as ac:
                out = await ac.load("llama")
                return out, await ac.models()

        out, models = asyncio.run(async_load())
        assert out["copies"][0]["state"] == P.STATE_LOADED and out["copies"][0]["id"] > 1  # IDs are never reused
        assert sorted(m["name"] for m in models if m["id"] is not None) == ["gpt2", "llama"]

        # the client's command line: --unload, --load NAME --copies N --pin, --models
        def cli(*args: str) -> dict | list:
            done = subprocess.run([*command(CLIENT, "--router", dep.frontend, *args)], cwd=ROOT, capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)

        assert cli("--unload", "llama")["copies"] == []
        (copy,) = cli("--load", "llama", "--copies", "1", "--pin")["copies"]
        assert copy["state"] == P.STATE_LOADED and copy["pinned"]
        assert {m["name"]: m["state"] for m in cli("--models")}["opt"] == P.STATE_AVAILABLE


def test_load_and_unload_over_http_behind_the_api_keys():
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from routing.http.app import GatewaySettings
    from routing.http.server import GatewayThread

    dep, _ = deployment(unload_timeout=20.0)
    with dep:
        dep.wait_loaded(120)
        g = GatewayThread(GatewaySettings(router=dep.frontend, api_keys=("k",)), "127.0.0.1", 0).start()
        auth = {"Authorization": "Bearer k"}
        try:
            with httpx.Client(base_url=g.url, timeout=120) as h:
                assert h.post("/v1/models/load", json={"model": "gpt2"}).status_code == 401
                r = h.post("/v1/models/load", json={"model": "gpt2", "copies": 1}, headers=auth)
                assert r.status_code == 200, r.text
                (copy,) = r.json()["data"]
                assert copy["id"].startswith("gpt2:") and copy["state"] == "loaded" and copy["resident_bytes"] > 0
                h.post("/v1/models/load", json={"model": "llama", "pin": True}, headers=auth).raise_for_status()
                full = h.post("/v1/models/load", json={"model": "opt", "copies": 2}, headers=auth)
                assert full.status_code == 507 and full.json()["error"]["code"] == "no_memory"  # pinned llama stays
                bad = h.post("/v1/models/load", json={"model": "gpt2", "copies": "two"}, headers=auth)
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "copies"
                assert h.post("/v1/models/unload", json={"model": "nope"}, headers=auth).status_code == 404
                # name:id names that copy, and must match: model ID 0 is llama's, not gpt2's
                assert h.post("/v1/models/unload", json={"model": "gpt2:0"}, headers=auth).status_code == 404
                listed = {m["id"]: m for m in h.get("/v1/models", headers=auth).json()["data"]}
                assert listed["opt"]["state"] == "available" and listed["llama"]["pinned"]
                assert listed[copy["id"]]["state"] == "loaded"
                r = h.post("/v1/completions", json={"model": "mistral", "prompt": [5, 6, 7], "max_tokens": 4,
                                                    "temperature": 0}, headers=auth)
                assert r.status_code == 200, r.text  # autoload evicts gpt2 (unpinned) for mistral
                want = engine_reference("mistral", [5, 6, 7], max_tokens=4, temperature=0.0)
                assert r.json()["choices"][0]["text"] == h.post(
                    "/detokenize", json={"model": "mistral", "tokens": want}, headers=auth).json()["prompt"]
                # the listing is the router's table now: the copy that the completion loaded is in it
                listed = h.get("/v1/models", headers=auth).json()["data"]
                copy_id = next(m["id"] for m in listed if m["id"].startswith("mistral:") and m["state"] == "loaded")
                r = h.post("/v1/models/unload", json={"model": copy_id}, headers=auth)  # that one copy
                assert r.status_code == 200 and r.json()["data"] == []
                assert h.get("/health").json()["status"] == "ok"
                families = {f.name: f for f in text_string_to_metric_families(h.get("/metrics").text)}
                assert families["mmfusion_model_loads"].samples[0].value == 2
                reasons = {s.labels["reason"]: s.value for s in families["mmfusion_model_unloads"].samples}
                assert reasons == {"evicted": 1, "unload": 1}
        finally:
            g.stop()


@pytest.mark.slow
def test_real_smollm2_and_gemma3_take_turns_in_a_budget_that_holds_one(smollm2_fp32, gemma3_fp32):
    from workers.engine import Engine
    from workers.engine.params import SamplingParams

    models = {"smollm2": ("smollm2-135m", smollm2_fp32), "gemma3": ("gemma3-270m", gemma3_fp32)}
    p = {"variants": {n: {"model": {"source": src, "dtype": "float32", "max_batch_size": 4, "max_model_len": 512}}
                      for n, (src, _) in models.items()}, "runconfig": {}}
    specs = {n: ModelSpec.from_params(n, v["model"]) for n, v in p["variants"].items()}
    sizes = sorted(PlanPlacer(["cpu"], "auto", {"cpu": 2**40}).size(s, "cpu").alone for s in specs.values())
    budget = sizes[1] + sizes[0] // 2  # one copy of either, never both
    fusion = build_fusion(p, ["smollm2,1"])
    plan = make_plan(fusion, None, "cpu", threads_per_worker=1)
    catalog = make_catalog(fusion, plan, specs, {"memory_budget": budget, "kv_cache_memory": "auto"})
    prompts = ["The three primary colours are", "Once upon a time"]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    refs = {(n, t): o.outputs[0].token_ids for n, (_, lm) in models.items()
            for t, o in zip(prompts, Engine(lm).generate(prompts, sp), strict=True)}
    with LocalDeployment(fusion, plan, ANY_PORT, ANY_PORT, catalog=catalog, router={"unload_timeout": 120.0}) as dep:
        dep.wait_loaded(300)

        def ask(name: str, prompt: str) -> tuple:
            with Client(dep.frontend, timeout=600) as c:
                out = c.complete(name, prompt, max_tokens=8, temperature=0.0, ignore_eos=True, return_token_ids=True)
            return (name, prompt), out["choices"][0]["token_ids"]

        # all at once: smollm2 serves its share while gemma3 waits for its memory, then gemma3 loads
        # in its place; a last request loads smollm2 again
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda a: ask(*a), [(n, t) for n in models for t in prompts for _ in range(2)]))
        answers.append(ask("smollm2", prompts[1]))
        with Client(dep.frontend, timeout=30) as c:
            life = c.status()["models"]
    assert all(tokens == refs[key] for key, tokens in answers) and len(answers) == 9
    assert life["loads"] == 2 and life["evictions"] == {"evicted": 2} and life["load_failures"] == 0
