"""Copies of a model on one CPU share one read-only mapping of its weights (workers.weights.shared):
in-process checks of the mapping, then real worker processes of a deployment."""

from __future__ import annotations

import gc
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import torch
from support.cluster import loaded_deployment
from support.models import ARCHS

from fusion.deploy import build_fusion
from fusion.local import LocalDeployment
from fusion.plan import make_plan
from routing.client import Client
from workers.models import load_engine, load_model
from workers.request_params import sampling_params
from workers.weights import shared as S

PROMPTS = [[5, 17, 33, 2, 99, 4], [100, 7, 8], [42] * 12]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_copy_computes_exactly_what_a_private_one_does(arch, cache):
    private = load_model(f"tiny:{arch}", dtype="float32")
    first = load_model(f"tiny:{arch}", dtype="float32", share_weights=True)  # writes the file, then maps it
    second = load_model(f"tiny:{arch}", dtype="float32", share_weights=True)  # maps it, no load
    assert first.weights.shared and second.weights.shared and first.weights.path == second.weights.path
    assert not private.weights.shared
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([p])
            want = private.model(ids).logits
            assert torch.equal(first.model(ids).logits, want) and torch.equal(second.model(ids).logits, want)
    assert second.tokenizer.chat_template == private.tokenizer.chat_template
    assert second.eos_token_ids == private.eos_token_ids
    # every parameter is a view of the mapping (no private copy made by a cast or a re-tie)
    path = Path(second.weights.path)
    header, _, start = S.read_header(path)
    size = path.stat().st_size
    views = [p for p in second.model.parameters()]
    base = min(p.data_ptr() for p in views)
    assert all(0 <= p.data_ptr() - base < size for p in views)
    tied = second.model.get_output_embeddings().weight is second.model.get_input_embeddings().weight
    assert tied == (private.model.get_output_embeddings().weight is private.model.get_input_embeddings().weight)


def test_engine_greedy_unchanged_in_mixed_batches(cache):
    sp, _ = sampling_params({"max_tokens": 12, "temperature": 0.0, "ignore_eos": True})
    outs = []
    for share in (False, True):
        eng = load_engine("tiny:llama", dtype="float32", share_weights=share, max_batch_size=4,
                                 max_batch_tokens=64)
        outs.append([o.outputs[0].token_ids for o in eng.generate(PROMPTS, sp)])
    assert outs[0] == outs[1]


def test_a_stale_or_corrupt_file_is_written_again(cache):
    lm = load_model("tiny:gpt2", dtype="float32", share_weights=True)
    path = Path(lm.weights.path)
    del lm
    path.write_bytes(path.read_bytes()[:1000])  # truncated: the header no longer fits the data
    again = load_model("tiny:gpt2", dtype="float32", share_weights=True)
    ref = load_model("tiny:gpt2", dtype="float32")
    with torch.inference_mode():
        assert torch.equal(again.model(torch.tensor([PROMPTS[0]])).logits, ref.model(torch.tensor([PROMPTS[0]])).logits)
    # a file for another model is refused by the check, not bound
    other = load_model("tiny:llama", dtype="float32")
    with pytest.raises(S.SharedWeightsError):
        S.attach(other.model, Path(again.weights.path))


def test_copies_of_a_hugging_face_directory_share_too(cache, tmp_path):
    src = load_model("tiny:mistral", dtype="float32")
    hf = tmp_path / "hf-mistral"
    src.model.save_pretrained(str(hf))
    src.tokenizer.save_pretrained(str(hf))
    a = load_model(str(hf), dtype="float32", share_weights=True)
    b = load_model(str(hf), dtype="float32", share_weights=True)
    assert a.weights.shared and a.weights.path == b.weights.path and "hf-mistral" in a.weights.path
    with torch.inference_mode():
        ids = torch.tensor([PROMPTS[2]])
        assert torch.equal(b.model(ids).logits, src.model(ids).logits)
    (hf / "config.json").touch()  # the directory changed: its key changes, nothing stale is used
    c = load_model(str(hf), dtype="float32", share_weights=True)
    assert c.weights.path != a.weights.path
    # the old directory's key can never come back, but a and b still map it: it stays
    old = Path(a.weights.path).parent
    assert old.is_dir()
    del a, b
    gc.collect()
    os.utime(hf / "config.json", ns=(0, (hf / "config.json").stat().st_mtime_ns + 10**9))
    d = load_model(str(hf), dtype="float32", share_weights=True)  # a third key: writing it prunes the first
    assert not old.exists() and Path(c.weights.path).exists() and Path(d.weights.path).exists()


def test_the_dtype_is_part_of_the_key(cache):
    a = load_model("tiny:llama", dtype="float32", share_weights=True)
    b = load_model("tiny:llama", dtype="bfloat16", share_weights=True)
    assert a.weights.path != b.weights.path and b.weights.bytes * 2 == a.weights.bytes
    assert next(b.model.parameters()).dtype == torch.bfloat16


# --- the plan ---------------------------------------------------------------------------------------------

def _fusion(share: bool, copies: int):
    params = {"variants": {"m": {"model": {"source": "smollm2-135m", "dtype": "bfloat16", "share_weights": share,
                                           "max_batch_size": 8, "max_model_len": 512,
                                           "kv_cache_memory": "64MiB"}}},
              "runconfig": {}, "_path": "test"}
    return build_fusion(params, [f"m,{copies}"])


def test_plan_counts_shared_weights_once_per_device(monkeypatch):
    monkeypatch.setattr("fusion.plan.available_bytes", lambda d: None)
    shared = make_plan(_fusion(True, 8), None, "cpu", 1)
    full = make_plan(_fusion(False, 8), None, "cpu", 1)
    w = shared.workers[0]
    assert all(x.shares_weights for x in shared.workers) and not any(x.shares_weights for x in full.workers)
    # the weights and (quantization: auto, SmolLM2's Q4_1 file) the file of quantized linears, once
    assert w.shared_packed_bytes > 0 and full.workers[0].packed_bytes == w.shared_packed_bytes + w.shared_batch_bytes
    saved = full.devices["cpu"]["estimated_bytes"] - shared.devices["cpu"]["estimated_bytes"]
    # each full copy holds its quantized linears and, of its 16-bit weights, the embedding (it lets
    # the 16-bit linears of its blocks go); the sharing copies hold the linears and the embedding once
    f = full.workers[0]
    assert w.weight_bytes == 49152 * 576 * 2 == f.weight_bytes
    assert saved == 8 * (f.weight_bytes + f.packed_bytes) - (w.weight_bytes + w.shared_packed_bytes + w.shared_batch_bytes)
    assert "counted once, shared by 8 copies" in shared.describe()
    # a device with room for the shared plan but not for 8 full copies: one fits, the other is refused
    room = (shared.devices["cpu"]["estimated_bytes"] + full.devices["cpu"]["estimated_bytes"]) // 2
    monkeypatch.setattr("fusion.plan.available_bytes", lambda d: room)
    make_plan(_fusion(True, 8), None, "cpu", 1)
    with pytest.raises(ValueError, match="need ~"):
        make_plan(_fusion(False, 8), None, "cpu", 1)


# --- real worker processes --------------------------------------------------------------------------------

def _mapping(pid: int, path: str) -> dict | None:
    """The smaps entry of `path` in process `pid`: its device:inode, permissions, Rss and Pss (kB)."""
    found, current = None, None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:  # a mapping's header line
            current = None
            if len(parts) >= 6 and parts[5] == path:
                found = current = found or {"perms": parts[1], "inode": (parts[3], parts[4]), "Rss": 0, "Pss": 0}
        elif current is not None and parts and parts[0] in ("Rss:", "Pss:"):
            current[parts[0][:-1]] += int(parts[1])
    return found


def _deployment(share: bool, copies: int) -> LocalDeployment:
    params = {"variants": {"m": {"model": {"source": "tiny:llama", "dtype": "float32", "share_weights": share,
                                           "max_batch_size": 8, "max_batch_tokens": 64}}},
              "runconfig": {}, "_path": "test"}
    return loaded_deployment(params, [f"m,{copies}"])


def _answers(c: Client, copies: int, ids=None) -> list[list[int]]:
    return [c.complete(mid, PROMPTS[0], max_tokens=8, temperature=0.0, ignore_eos=True,
                       return_token_ids=True)["choices"][0]["token_ids"]
            for mid in (ids if ids is not None else range(copies))]


def test_four_copies_map_one_set_of_pages_and_survive_a_killed_copy(cache):
    shm_before = set(os.listdir("/dev/shm"))
    ref = load_engine("tiny:llama", dtype="float32", max_batch_size=4, max_batch_tokens=64)
    sp, _ = sampling_params({"max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    want = ref.generate([PROMPTS[0]], sp)[0].outputs[0].token_ids
    d = _deployment(True, 4)
    try:
        with Client(d.frontend, timeout=60) as c:
            assert _answers(c, 4) == [want] * 4
            workers = [w for w in c.status()["workers"] if w["alive"]]
            assert all(w["weights"]["shared"] and w["weights"]["bytes"] > 0 for w in workers)
            (path,) = {w["weights"]["path"] for w in workers}
            maps = [_mapping(w["pid"], path) for w in workers]
            assert all(m is not None for m in maps)
            assert len({m["inode"] for m in maps}) == 1  # one file: one set of pages in the page cache
            assert all(m["perms"].startswith("r-") and "w" not in m["perms"] for m in maps)  # read-only
            rss = max(m["Rss"] for m in maps)
            assert sum(m["Pss"] for m in maps) <= rss + 4 * 4  # each page counted once in all (+ rounding)

            victim = next(w for w in workers if w["model_id"] == 1)  # status lists them in the order they registered
            os.kill(victim["pid"], signal.SIGKILL)
            # the other copies keep serving while it is gone; then a new process maps the same file
            assert [_answers(c, 4, ids=(0, 2, 3))] == [[want] * 3]
            deadline = time.monotonic() + 60
            while True:
                ws = [w for w in c.status()["workers"] if w["alive"] and w["loaded"]]
                if len(ws) == 4 and victim["pid"] not in {w["pid"] for w in ws}:
                    break
                assert time.monotonic() < deadline, "the killed copy did not come back"
                time.sleep(0.2)
            new = next(w for w in ws if w["pid"] not in {x["pid"] for x in workers})
            assert _mapping(new["pid"], path)["inode"] == maps[0]["inode"]
            assert _answers(c, 4) == [want] * 4
            pids = [w["pid"] for w in ws]
    finally:
        d.__exit__(None, None, None)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    # nothing left in shared memory. multiprocessing's named semaphores (sem.mp-*) are left out: a
    # test running beside this one in another process makes them (pytest-xdist), and none of the
    # deployment's processes do (its workers are forked by the fork server, with no semaphore)
    left = {name for name in set(os.listdir("/dev/shm")) - shm_before if not name.startswith("sem.mp-")}
    assert left == set()


def test_sharing_turned_off_gives_full_copies(cache):
    d = _deployment(False, 2)
    try:
        with Client(d.frontend, timeout=60) as c:
            workers = [w for w in c.status()["workers"] if w["alive"]]
            assert all(not w["weights"]["shared"] and w["weights"]["path"] is None for w in workers)
            assert _answers(c, 2)[0] == _answers(c, 2)[1]
    finally:
        d.__exit__(None, None, None)
    assert not (cache / "shared").exists() or not any((cache / "shared").iterdir())


HOLD_SCRIPT = """
import os, sys
from fusion import launcher
from workers.weights.held_tokenizers import HOLD_ENV

if __name__ == "__main__":
    launcher.start_server(sys.argv[1:])
    try:
        print(launcher.call_in_server("workers.weights.held_tokenizers:held_count"), HOLD_ENV in os.environ)
    finally:
        launcher.stop_server()
"""


def test_the_fork_server_holds_the_tokenizers_of_cached_sources(cache, tmp_path):
    """A serving deployment names the sources it may load; its fork server builds, once, the
    tokenizer of each whose shared weights are cached, and every process forked from it starts with
    that tokenizer at hand (a large vocabulary takes seconds to build). A source with nothing cached,
    or none at all, is skipped; the starter's environment is left as it was."""
    import subprocess
    import sys

    from workers.weights import held_tokenizers

    lm = load_model("tiny:llama", dtype="float32", share_weights=True)  # writes the shared directory
    other = load_model("tiny:llama", dtype="bfloat16", share_weights=True)  # the same tokenizer, another dtype
    built = held_tokenizers.build(["tiny:llama", "tiny:gpt2", "/no/such/model"])
    dirs = [str(Path(x.weights.path).parent.resolve()) for x in (lm, other)]
    assert sorted(built) == sorted(dirs) and built[dirs[0]] is built[dirs[1]]  # built once for both
    tok = built[str(Path(lm.weights.path).parent.resolve())]
    for text in ("Hello, world", "<|im_start|>user\nhi"):
        assert tok(text).input_ids == lm.tokenizer(text).input_ids
    assert tok.chat_template == lm.tokenizer.chat_template and tok.eos_token == lm.tokenizer.eos_token
    assert held_tokenizers.held_count() == 0  # this process was not forked holding any
    script = tmp_path / "hold.py"
    script.write_text(HOLD_SCRIPT)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, str(script), "tiny:llama", "tiny:gpt2", "/no/such/model"], env=env,
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "False"]  # both directories, from one build


def test_loads_of_the_same_tokenizer_files_share_one_tokenizer_while_it_is_in_use(cache, tmp_path):
    """A process that loads a model again (another dtype, a reload after an eviction, the same
    model saved elsewhere) builds its tokenizer once while a load still uses it (a large vocabulary
    takes seconds): by the files' content, not their directory. Other files build their own, and
    one that no load holds any more is let go."""
    import gc
    import json
    import shutil
    import weakref

    from workers.weights.held_tokenizers import from_directory

    lm = load_model("tiny:llama", dtype="float32")
    lm.model.save_pretrained(str(tmp_path / "a"))
    lm.tokenizer.save_pretrained(str(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    config = json.loads((tmp_path / "b" / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    (tmp_path / "b" / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "b" / "chat_template.jinja").unlink(missing_ok=True)
    first, second = load_model(str(tmp_path / "a"), dtype="float32"), load_model(str(tmp_path / "a"), dtype="bfloat16")
    assert first.tokenizer is second.tokenizer is from_directory(tmp_path / "a")
    assert first.tokenizer("Hello, world").input_ids == lm.tokenizer("Hello, world").input_ids
    other = load_model(str(tmp_path / "b"), dtype="float32")
    assert other.tokenizer is not first.tokenizer and other.tokenizer.chat_template == config["chat_template"]
    gone = weakref.ref(first.tokenizer)
    del first, second
    gc.collect()
    assert gone() is None


def test_the_cache_lock_lets_one_holder_in_at_a_time_and_leaves_no_file(tmp_path):
    """Four processes add to one counter under one_at_a_time, 40 times each, a read, a pause and
    a write each time: no addition is lost (one holder at a time, though each holder removes the
    lock file before it lets go), and no lock file is left beside the counter."""
    import subprocess
    import sys

    counter = tmp_path / "counter"
    counter.write_text("0")
    body = ("import sys, time; from pathlib import Path; from workers.files import one_at_a_time\n"
            "p = Path(sys.argv[1])\n"
            "for _ in range(40):\n"
            "    with one_at_a_time(p):\n"
            "        n = int(p.read_text()); time.sleep(0.0005); p.write_text(str(n + 1))\n")
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", body, str(counter)], cwd=root) for _ in range(4)]
    assert [p.wait(60) for p in procs] == [0] * 4
    assert counter.read_text() == "160"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["counter"]


def test_files_written_whole_get_the_modes_the_umask_gives(tmp_path):
    """atomic_replace's temporaries are private (mkstemp, mkdtemp); what they become is an ordinary
    output or cache entry, readable as the umask says (a predictions file was 0600)."""
    from workers.files import atomic_replace

    old = os.umask(0o027)
    try:
        atomic_replace(tmp_path / "f", lambda t: t.write_text("x"))
        atomic_replace(tmp_path / "d", lambda t: (t / "inner").write_text("x"), is_dir=True)
    finally:
        os.umask(old)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o750
