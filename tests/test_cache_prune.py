"""The cache drops derived weights whose source changed or is gone, and never one a process maps."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.quant.weight import quantize
from workers.weights import cache_prune
from workers.weights import shared as S
from workers.weights.quantized_cache import cache_path, shared_quantized
from workers.weights.shared import map_tensors

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("MMFUSION_CACHE", str(root))
    return root


def fake_source(tmp_path: Path, name: str = "model") -> Path:
    """A Hugging Face directory as source_key reads it: its files' sizes and times name it."""
    src = tmp_path / name
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "model.safetensors").write_bytes(b"\0" * 64)
    return src


def build(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return lambda: {"w": quantize(torch.randn(32, 64, generator=gen), "int4")}


def touch_later(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_a_changed_source_leaves_its_entry_only_once_unmapped(cache, tmp_path):
    src = fake_source(tmp_path)
    first = shared_quantized(str(src), torch.bfloat16, "int4", build(0))
    old = cache_path(str(src), torch.bfloat16, "int4")
    record = cache_prune.record_path(old)
    assert old.exists() and record.exists()
    assert json.loads(record.read_text())["source"] == str(src)
    assert not cache_prune.stale(record)

    touch_later(src / "config.json")  # a reinstall: same files, new times, a new key
    assert cache_prune.stale(record)
    second = shared_quantized(str(src), torch.bfloat16, "int4", build(1))
    new = cache_path(str(src), torch.bfloat16, "int4")
    assert new != old and new.exists()
    # the first entry is still mapped by this process (`first`): writing the new one kept it
    assert old.exists() and cache_prune.mapped(old)
    assert torch.equal(first["w"].qs, build(0)()["w"].qs)

    del first
    gc.collect()
    assert not cache_prune.mapped(old)
    assert cache_prune.prune_stale(old.parent) == [old]
    assert not old.exists() and not record.exists()
    # the live entry, its record and its mapping are untouched
    assert new.exists() and cache_prune.record_path(new).exists()
    assert torch.equal(second["w"].qs, build(1)()["w"].qs)
    assert cache_prune.prune_stale(old.parent) == []
    assert not list(old.parent.glob(".*.lock"))


def test_a_deleted_source_is_stale_and_unrecorded_entries_stay(cache, tmp_path):
    gone = fake_source(tmp_path, "gone")
    kept = fake_source(tmp_path, "kept")
    shared_quantized(str(gone), torch.bfloat16, "int4", build(0))
    shared_quantized(str(kept), torch.bfloat16, "int4", build(0))
    gc.collect()
    gone_entry = cache_path(str(gone), torch.bfloat16, "int4")
    kept_entry = cache_path(str(kept), torch.bfloat16, "int4")
    foreign = gone_entry.parent / "written-before-records.safetensors"
    foreign.write_bytes(b"x")
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()  # a checkout deleted with its packages

    assert cache_prune.prune_stale(gone_entry.parent) == [gone_entry]
    assert kept_entry.exists() and foreign.exists()


def test_an_entry_opened_without_a_record_is_adopted(cache, tmp_path):
    src = fake_source(tmp_path)
    shared_quantized(str(src), torch.bfloat16, "int4", build(0))
    entry = cache_path(str(src), torch.bfloat16, "int4")
    cache_prune.record_path(entry).unlink()  # as an entry written before records existed
    shared_quantized(str(src), torch.bfloat16, "int4", build(0))  # read back, not built
    assert cache_prune.record_path(entry).exists()


def test_an_unreadable_record_is_not_stale(tmp_path):
    record = tmp_path / ("x.safetensors" + cache_prune.RECORD_SUFFIX)
    record.write_text("{not json")
    assert not cache_prune.stale(record)
    record.write_text(json.dumps({"format": "something else", "files": [["/nonexistent", 1, 1]]}))
    assert not cache_prune.stale(record)


def test_a_directory_entry_mapped_by_another_process_stays_until_it_dies(cache, tmp_path):
    """A shared weights directory (workers.weights.shared), mapped by a live process: kept; once
    that process is killed, the kernel drops its lock and the entry goes."""
    from safetensors.torch import save_file

    src = fake_source(tmp_path)
    entry = cache / "shared" / "model-abc-bfloat16"
    entry.mkdir(parents=True)
    save_file({"w": torch.ones(4)}, str(entry / S.WEIGHTS_FILE))
    cache_prune.write_record(entry, str(src))
    touch_later(src / "model.safetensors")

    code = ("import sys, time; from pathlib import Path; from workers.weights.shared import map_tensors; "
            "t, _ = map_tensors(Path(sys.argv[1])); print('mapped', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(entry / S.WEIGHTS_FILE)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mapped"
        assert cache_prune.prune_stale(entry.parent) == []
        assert entry.exists()
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
    assert cache_prune.prune_stale(entry.parent) == [entry]
    assert not entry.exists() and not cache_prune.record_path(entry).exists()


def test_the_mapping_holds_its_lock_as_long_as_a_view_lives(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(8.0), "b": torch.ones(2)}, str(path))
    tensors, _ = map_tensors(path)
    a = tensors["a"]
    del tensors
    gc.collect()
    assert cache_prune.mapped(path)  # one view left
    assert a.sum().item() == 28.0
    del a
    gc.collect()
    assert not cache_prune.mapped(path)
