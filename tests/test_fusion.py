"""ModelInfo, MultiModelFusion, params/variants loading and the deployment plan."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from support.batch import tiny_variant, write_params

from fusion.deploy import build_fusion
from fusion.model_info import ModelInfo, MultiModelFusion
from fusion.params import ParamsError, load_params, parse_variants
from fusion.plan import OVERHEAD_BYTES, batch_layouts, make_plan, weight_bytes
from routing.entrypoints import CLI, command
from workers import kernel_notes
from workers.spec import ModelSpec, WorkerSpec

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


def info(name: str, source: str, **settings) -> ModelInfo:
    return ModelInfo(ModelSpec(name, source, **settings))


def test_fusion_models_and_their_specs():
    f = MultiModelFusion([info("a", "tiny:llama"), info("b", "tiny:gpt2", deltat_scaling_factor=2)])
    assert [(m.name, m.source, m.deltat_scaling_factor) for m in f.models] == [("a", "tiny:llama", 1.0),
                                                                               ("b", "tiny:gpt2", 2.0)]
    with pytest.raises(ValueError, match="deltat_scaling_factor must be a positive number"):
        info("c", "tiny:llama", deltat_scaling_factor=0)
    with pytest.raises(ValueError, match="at least one"):
        MultiModelFusion([])


def test_model_spec_takes_every_default_from_the_key_table_and_checks_once():
    from dataclasses import fields

    from workers.config_keys import MODEL, REQUIRED

    spec = ModelSpec("m", "tiny:llama")
    assert {f.name for f in fields(ModelSpec)} == {"name", *MODEL}
    assert all(getattr(spec, k) == key.default for k, key in MODEL.items() if key.default is not REQUIRED)
    built = ModelSpec.from_params("m", {"source": "tiny:llama", "compile_buckets": [1, 8], "end_token": [2, 3]})
    assert built.compile_buckets == (1, 8) and built.end_token == (2, 3)
    for bad, match in (({"source": "tiny:llama", "max_batch_size": True}, "model.max_batch_size must be"),
                       ({"source": "tiny:llama", "colour": 1}, "model.colour: unknown key"),
                       ({"dtype": "auto"}, "model.source is required"),
                       ({"source": "tiny:llama", "compile": "sometimes"}, "model.compile"),
                       ({"source": "tiny:llama", "compile_buckets": [8, 1]}, "model.compile_buckets")):
        with pytest.raises(ValueError, match=match):
            ModelSpec.from_params("m", bad)


def test_worker_spec_crosses_the_wire_as_one_map_and_comes_back_the_same():
    import msgpack

    spec = WorkerSpec(ModelSpec("m", "tiny:llama", compile_buckets=(1, 8), temperature=0.5,
                                resources={"accel": 1}), 2, "cpu", threads=2, cpus=(0, 1), max_batch_size=8,
                      kv_cache_bytes=2**20, weights_owner="/x/0")
    back = WorkerSpec.from_wire(msgpack.unpackb(msgpack.packb(spec.to_wire())))
    assert back == spec and back.model.request_defaults() == {"temperature": 0.5}
    assert (back.batch_size, back.batch_tokens, back.kv_bytes) == (8, 512, 2**20)
    with pytest.raises(ValueError, match="unknown fields"):
        WorkerSpec.from_wire({**spec.to_wire(), "colour": 1})
    with pytest.raises(ValueError, match="model.dtype must be"):
        WorkerSpec.from_wire({**spec.to_wire(), "model": {**spec.to_wire()["model"], "dtype": "int3"}})
    with pytest.raises(ValueError, match="device must be"):
        spec.placed(device="tpu")


def test_variants_parsing():
    params = load_params(TINY)
    assert parse_variants(["llama,2", "gpt2"], params) == [("llama", 2), ("gpt2", 1)]
    assert parse_variants(["llama", 3], params) == [("llama", 3)]  # YAML [name, count]
    for bad, match in ((["llama,x"], "integer"), (["llama,0"], "from 1 to 1024"), (["llama,1025"], "from 1 to 1024"),
                       (["bert,1"], "'bert' is not in")):
        with pytest.raises(ParamsError, match=match):
            parse_variants(bad, params)


@pytest.mark.parametrize("text,match", [
    ("variants: {}\n", "non-empty mapping"),
    ("variants:\n  a: {model: {dtype: auto}}\n", r"variants\.a\.model\.source"),
    ("variants:\n  a: {model: {source: x, colour: red}}\n", r"variants\.a\.model\.colour: unknown key"),
    ("variants:\n  a: {model: {source: x}}\nrunconfig: {num_wrokers: 2}\n", r"runconfig\.num_wrokers"),
    ("variants: [\n", "not valid YAML"),
    ("variants: " + "[" * 5000 + "]" * 5000 + "\n", "not valid YAML: nested too deeply"),
    ("variants:\n  a: {model: {source: x}}\nrunconfig: {retry_delays: 5}\n", r"runconfig\.retry_delays must be a list"),
    ("variants:\n  a: {model: {source: x}}\nrunconfig: {retry_delays: [1, -2]}\n", r"runconfig\.retry_delays"),
    # runconfig keys with a table check: 0 threads is no "auto", -1 steps no "all", -1 restarts no "never"
    ("variants:\n  a: {model: {source: x}}\nrunconfig: {threads_per_worker: 0}\n",
     r"runconfig\.threads_per_worker must be a positive integer, or null, got 0"),
    ("variants:\n  a: {model: {source: x}}\nrunconfig: {inference_steps: -1}\n", r"runconfig\.inference_steps must"),
    ("variants:\n  a: {model: {source: x}}\nrunconfig: {max_restarts: -1}\n", r"runconfig\.max_restarts must"),
    ("variants:\n  a: {model: {source: x}}\nrunconfig: {restart_wait: -5}\n", r"runconfig\.restart_wait must"),
    ("variants:\n  a: {model: {source: x}}\nrunconfig: {insecure: yes please}\n", r"runconfig\.insecure must"),
    # every model key with a table check: a value of the wrong kind names the key and its valid values
    ("variants:\n  a: {model: {source: x, max_batch_size: many}}\n",
     r"variants\.a\.model\.max_batch_size must be a positive integer, got 'many'"),
    ("variants:\n  a: {model: {source: x, max_batch_tokens: 0}}\n", r"model\.max_batch_tokens must be"),
    # quietly raised to max_batch_size by the plan before; the engine refuses it as vLLM does
    ("variants:\n  a: {model: {source: x, max_batch_tokens: 8}}\n",
     r"model\.max_batch_tokens \(8\) must be >= model\.max_batch_size \(64\)"),
    ("variants:\n  a: {model: {source: x, dtype: int4}}\n", r"model\.dtype must be `auto`"),
    ("variants:\n  a: {model: {source: x, share_weights: maybe}}\n", r"model\.share_weights must be"),
    ("variants:\n  a: {model: {source: x, top_p: 1.5}}\n", r"model\.top_p must be a number in \(0, 1\]"),
    ("variants:\n  a: {model: {source: x, start_token: [1, x]}}\n", r"model\.start_token must be"),
    ("variants:\n  a: {model: {source: x, loop_dim: 2}}\n", r"model\.loop_dim must be"),
    ("variants:\n  a: {model: {source: x, max_model_len: -1}}\n", r"model\.max_model_len must be"),
    # YAML's integers have no limit; a spec travels to its workers as a message, whose have 64 bits
    ("variants:\n  a: {model: {source: x, max_tokens: 100000000000000000000}}\n",
     r"variants\.a\.model\.max_tokens is out of range: integers must be within"),
    ("variants:\n  a: {model: {source: x, end_token: [2, -9223372036854775809]}}\n",
     r"model\.end_token\[1\] is out of range"),
])
def test_params_errors_name_file_and_key(tmp_path, text, match):
    f = tmp_path / "p.yaml"
    f.write_text(text)
    with pytest.raises(ParamsError, match=match) as info:
        load_params(f)
    assert str(f) in str(info.value)


def test_retry_delays_default_and_given(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("variants:\n  a: {model: {source: x}}\n")
    assert load_params(f)["runconfig"]["retry_delays"] == (0.5, 2.0, 8.0)
    f.write_text("variants:\n  a: {model: {source: x}}\nrunconfig: {retry_delays: [0, 1]}\n")
    assert load_params(f)["runconfig"]["retry_delays"] == (0.0, 1.0)


def test_plan_round_robin_devices_and_threads():
    fusion = build_fusion(load_params(TINY), ["llama,1", "gpt2,1"])
    plan = make_plan(fusion, 3, ["cpu", "cuda:0"])
    assert [(w.worker_id, w.model_id, w.device) for w in plan.workers] == [(0, 0, "cpu"), (1, 1, "cuda:0"),
                                                                          (2, 0, "cpu")]
    cpu_plan = make_plan(fusion, 2, "cpu")
    import os

    assert sum(w.threads for w in cpu_plan.workers) == max(os.cpu_count(), 2)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # the workers' threads fit the cores: each worker gets its own, in order
        assert [w.cpus for w in cpu_plan.workers] == [cores[:cpu_plan.workers[0].threads],
                                                      cores[cpu_plan.workers[0].threads:][:cpu_plan.workers[1].threads]]
        assert list(cpu_plan.workers[1].spec.cpus) == cpu_plan.workers[1].cpus
    crowded = make_plan(fusion, 2, "cpu", threads_per_worker=len(cores))  # more threads than cores: unbound
    assert all(w.cpus is None and w.spec.cpus is None for w in crowded.workers)
    with pytest.raises(ValueError, match="fewer than the number of models"):
        make_plan(fusion, 1, "cpu")
    with pytest.raises(ValueError, match="not 'cpu' or 'cuda:N'"):
        make_plan(fusion, 2, ["tpu"])


def test_a_worker_count_no_device_can_hold_is_refused_at_once(monkeypatch):
    """num_workers past what the device's memory holds for their processes alone is refused before
    each worker is sized (a million workers planned in quadratic time: validate_only hung); a count
    that fits is planned, each worker with its place among its device's."""
    monkeypatch.setattr("fusion.plan.available_bytes", lambda d: 8 * 2**30)
    fusion = build_fusion(load_params(TINY), ["llama,1"])
    for n in (100, 10**6):
        with pytest.raises(ValueError, match=rf"device cpu: the {n} workers planned there need at least .* GiB for "
                                             r"their processes alone, but 8\.0 GiB is available"):
            make_plan(fusion, n, "cpu")
    plan = make_plan(fusion, 4, "cpu", kv_cache_memory="1MiB")
    assert [w.worker_id for w in plan.workers] == [0, 1, 2, 3] and all(w.threads >= 1 for w in plan.workers)


def test_plan_leaves_out_the_batch_file_no_linear_chose(monkeypatch, tmp_path):
    """Where an earlier load on this machine with the same settings chose the many-rows way that
    reads the laid-out file for none of the linears (its kernel note), the plan counts none of that
    file; where one took it, or none measured yet, the file is counted whole."""
    monkeypatch.setenv("MMFUSION_CACHE", str(tmp_path))
    monkeypatch.setattr("fusion.plan.available_bytes", lambda d: 8 * 2**30)
    fusion = MultiModelFusion([info("m", "smollm2-135m", dtype="bfloat16", quantization="int4")])

    def planned():
        return make_plan(fusion, 2, "cpu", kv_cache_memory="64MiB", threads_per_worker=1).workers[0]

    w = planned()
    layouts = batch_layouts("cpu", w.precision)
    if not layouts:
        pytest.skip("this CPU lays out no file for many rows (quantized linears in bfloat16 need AVX512-BF16)")
    sizes = {way: weight_bytes("smollm2-135m", per_value) for way, _, per_value in layouts}
    assert w.shared_batch_bytes == sum(sizes.values())  # nothing measured yet: the most they can hold
    key = kernel_notes.note_key("smollm2-135m", w.precision, 1, max(w.spec.batch_tokens, w.spec.batch_size))
    kernel_notes.remember(key, {"int4 3072x576": "act8 up to 4 rows, blocks 5-16 rows, widened from 17",
                                "int4 576x1536": "blocks"})
    assert planned().shared_batch_bytes == 0
    for way, whole in sizes.items():  # each file counted where a choice takes its way
        kernel_notes.remember(key, {"int4 3072x576": f"act8 up to 4 rows, {way} from 5", "int4 576x1536": "blocks"})
        assert planned().shared_batch_bytes == whole
    # a note from before the row kernels' rule changed is not read: the next load measures anew
    kernel_notes.remember(key, {"int4 3072x576": "blocks", "int4 576x1536": "blocks"})
    assert planned().shared_batch_bytes == 0
    monkeypatch.setattr("workers.kernel_notes.CHOICE_VERSION", kernel_notes.CHOICE_VERSION + 1)
    assert planned().shared_batch_bytes == sum(sizes.values())
    assert planned().shared_packed_bytes == w.shared_packed_bytes  # the blocks' own file is counted either way


def test_plan_counts_shared_quantized_linears_once(monkeypatch):
    """int4 copies that share their weights map one file of quantized linears: the plan counts it
    once on the device (about 0.36x the bfloat16 packed linears a copy holds otherwise)."""
    monkeypatch.setattr("fusion.plan.available_bytes", lambda d: 8 * 2**30)
    packed = make_plan(MultiModelFusion([info("m", "smollm2-135m", dtype="bfloat16", quantization="none")]), 3,
                       "cpu", kv_cache_memory="64MiB")
    quant = make_plan(MultiModelFusion([info("m", "smollm2-135m", dtype="bfloat16", quantization="int4")]), 3,
                      "cpu", kv_cache_memory="64MiB")
    w = quant.workers[0]
    assert w.precision.quantization == "int4" and w.packed_bytes == 0
    assert 0 < w.shared_packed_bytes < 0.4 * packed.workers[0].packed_bytes
    saved = packed.devices["cpu"]["estimated_bytes"] - quant.devices["cpu"]["estimated_bytes"]
    bf16 = packed.workers[0]
    assert saved == (3 * bf16.packed_bytes - w.shared_packed_bytes - w.shared_batch_bytes + bf16.weight_bytes
                     - w.weight_bytes)
    # what a copy holds, weights and linears: under 0.4x a bfloat16 copy's (the embedding stays 16-bit)
    assert w.weight_bytes + w.shared_packed_bytes < 0.4 * (bf16.weight_bytes + bf16.packed_bytes)
    assert "int4 linears" in quant.describe()
    # where bfloat16 has dot products, the linears packed in bfloat16 pairs are one more file, counted
    # once; on one computing in bfloat16 without AMX tiles, the linears widened to float32 one more
    layouts = batch_layouts("cpu", w.precision)
    assert w.shared_batch_bytes == sum(weight_bytes("smollm2-135m", per_value) for _, _, per_value in layouts)
    per_value = {per_value for _, _, per_value in layouts}
    assert ("packed for AMX tiles" in quant.describe()) == (per_value == {2})
    assert ("packed in bfloat16 pairs or widened to float32" in quant.describe()) == (per_value == {2, 4})
    assert batch_layouts("cpu", bf16.precision) == []  # not quantized: no such file
    private = make_plan(MultiModelFusion([info("m", "smollm2-135m", dtype="bfloat16", quantization="int4",
                                               share_weights=False)]), 2, "cpu", kv_cache_memory="64MiB")
    assert private.workers[0].packed_bytes == w.shared_packed_bytes + w.shared_batch_bytes  # each copy its own
    # auto: SmolLM2's Q4_1 file keeps its class, and is counted as int4
    auto = make_plan(MultiModelFusion([info("m", "smollm2-135m", dtype="bfloat16")]), 3, "cpu",
                     kv_cache_memory="64MiB").workers[0]
    assert auto.precision.quantization == "int4" and auto.precision.file_classes
    assert auto.shared_packed_bytes == w.shared_packed_bytes and auto.packed_bytes == 0


def test_deltat_scaling_factor_shares_batch_capacity():
    fusion = MultiModelFusion([
        info("big", "tiny:llama", max_batch_size=30, max_batch_tokens=300, deltat_scaling_factor=2.0),
        info("small", "tiny:llama", max_batch_size=30, max_batch_tokens=300, deltat_scaling_factor=1.0),
    ])
    plan = make_plan(fusion, 2, "cpu")
    big, small = plan.workers
    assert (big.max_batch_size, small.max_batch_size) == (40, 20)  # 2:1, same total as 30 + 30
    assert (big.max_batch_tokens, small.max_batch_tokens) == (400, 200)
    spec = big.spec  # what the router sends the worker
    assert (spec.max_batch_size, spec.max_batch_tokens) == (40, 400)
    assert spec.kv_cache_bytes == big.kv_cache_bytes > 0 and spec.model.kv_block_size == 16


def test_plan_gives_kv_budgets_and_refuses_what_does_not_fit(monkeypatch):
    monkeypatch.setattr("fusion.plan.available_bytes", lambda d: 8 * 2**30)
    fusion = MultiModelFusion([info("m", "smollm2-135m", max_batch_size=100000, max_batch_tokens=100000,
                                    dtype="bfloat16", quantization="none")])
    plan = make_plan(fusion, 2, "cpu")  # auto: half of 8 GiB, less weights and overheads, shared by the two
    w = plan.workers[0]
    # the two copies share their weights, and each holds its own prepacked linears (about as many bytes)
    assert w.packed_bytes == w.weight_bytes > 0
    fixed = w.weight_bytes + 2 * (OVERHEAD_BYTES + w.packed_bytes)
    # the KV cache in the compute dtype: bfloat16, or float32 where bfloat16 weights compute in float32
    kv_element = w.precision.compute.itemsize
    assert w.kv_cache_bytes == (4 * 2**30 - fixed) // 2
    assert w.kv_tokens == w.kv_cache_bytes // (30 * 2 * 3 * 64 * kv_element)
    assert plan.devices["cpu"]["estimated_bytes"] == fixed + 2 * w.kv_cache_bytes
    assert "KV cache" in plan.describe() and f"~{w.kv_tokens} tokens" in plan.describe()
    assert "MiB of prepacked linears of its own" in plan.describe()
    unpacked = MultiModelFusion([info("m", "smollm2-135m", dtype="bfloat16", prepack_weights=False)])
    assert make_plan(unpacked, 2, "cpu").workers[0].packed_bytes == 0
    gpt2 = MultiModelFusion([info("m", "tiny:gpt2", dtype="bfloat16")])
    assert make_plan(gpt2, 1, "cpu").workers[0].packed_bytes == 0  # transformers' modules: nothing packed
    small = MultiModelFusion([info("m", "smollm2-135m", max_batch_size=2, max_model_len=1000,
                                   dtype="bfloat16", quantization="none")])
    assert make_plan(small, 1, "cpu").workers[0].kv_tokens == 2 * 1000  # never more than its limits use
    assert make_plan(fusion, 1, "cpu", kv_cache_memory="1GiB").workers[0].kv_cache_bytes == 2**30
    with pytest.raises(ValueError, match="device cpu: .* GiB"):
        make_plan(fusion, 1, "cpu", kv_cache_memory="9GiB")
    with pytest.raises(ValueError, match="model.kv_cache_memory must be a size"):
        info("m", "tiny:llama", kv_cache_memory="lots")
    with pytest.raises(ValueError, match="kv_cache_memory 'lots' is not a size"):
        make_plan(fusion, 1, "cpu", kv_cache_memory="lots")
    # a budget too small for one block was planned as a pool of 0 tokens, and the worker's load failed
    block = 16 * 30 * 2 * 3 * 64 * kv_element
    with pytest.raises(ValueError, match=rf"variant 'm': kv_cache_memory of {block - 1} bytes holds no KV block"):
        make_plan(fusion, 1, "cpu", kv_cache_memory=str(block - 1))
    assert make_plan(fusion, 1, "cpu", kv_cache_memory=str(block)).workers[0].kv_tokens == 16


def test_validate_only_prints_plan_without_loading():
    out = subprocess.run([*command(CLI), "--mode", "validate_only", "--params", str(TINY),
                          "--variants", "llama,2", "gpt2,1", "--num_workers", "4", "--devices", "cpu"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "worker 3 -> model 0 on cpu" in out.stdout and "model 2: gpt2" in out.stdout
    # each worker's KV budget, its block size and the tokens it holds
    assert len(re.findall(r"KV cache \d+ MiB in blocks of 16 tokens, holding ~\d+ tokens", out.stdout)) == 4
    bad = subprocess.run([*command(CLI), "--mode", "validate_only", "--params", str(TINY),
                          "--variants", "nope,1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "'nope' is not in" in bad.stderr
    bad = subprocess.run([*command(CLI), "--mode", "validate_only", "--params", str(TINY),  # not built up first
                          "--variants", "llama,1000000000"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "count must be from 1 to 1024 (a worker process each)" in bad.stderr, bad.stderr
    # the flags that override runconfig keys are checked as the file's keys are, and the addresses
    for flags, said in ((["--threads_per_worker", "0"], "--threads_per_worker must be a positive integer"),
                        (["--inference_steps", "-1"], "--inference_steps must be a positive integer"),
                        (["--max_restarts", "-1"], "--max_restarts must be an integer >= 0"),
                        (["--restart_wait", "-5"], "--restart_wait must be a number of seconds >= 0"),
                        (["--frontend", "foo"], "address 'foo' is not tcp://HOST:PORT"),
                        (["--backend", "tcp://127.0.0.1:99999"], "has no port 0-65535"),
                        (["--router", "tcp://127.0.0.1:*"], "has no port 1-65535 to connect to")):
        bad = subprocess.run([*command(CLI), "--mode", "validate_only", "--params", str(TINY), "--variants", "llama,1",
                              *flags], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and said in bad.stderr, (flags, bad.returncode, bad.stderr[-500:])
    # serve starts a router of its own: one named with --router would be ignored, so it is refused
    bad = subprocess.run([*command(CLI), "--mode", "serve", "--params", str(TINY), "--variants", "llama,1",
                          "--router", "tcp://127.0.0.1:5599"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "serve starts a router of its own" in bad.stderr, bad.stderr[-500:]


def test_validate_only_names_a_source_no_worker_could_load(tmp_path):
    """A variant's source that is no model on this machine (nothing there; a file that is no .gguf; a
    directory with no config.json) is refused by check_source; validate_only refuses it for any
    variant serve could load at run time, not only the started ones; a good one plans. A max_model_len
    above the context a source declares is refused the same way (check_context), before any load."""
    from workers.weights.sources import check_context, check_source

    stray = tmp_path / "notes.txt"
    stray.write_text("x")
    for source, said in (("/no/such/model", "unknown model source '/no/such/model'"),
                         (str(stray), "is neither a Hugging Face directory"),
                         (str(tmp_path), "is neither a Hugging Face directory")):
        with pytest.raises(ValueError, match=re.escape(said)):
            check_source(source)
    (tmp_path / "config.json").write_text("{}")
    check_source(str(tmp_path))  # a Hugging Face directory, as far as the source goes
    check_context(str(tmp_path), 10**6)  # it declares no context: max_model_len sets it
    (tmp_path / "config.json").write_text('{"text_config": {"max_position_embeddings": 4096}}')
    check_context(str(tmp_path), 4096)
    for source, limit, key in ((str(tmp_path), 4096, "max_position_embeddings"), ("tiny:gpt2", 512, "n_positions"),
                               ("smollm2-135m", 8192, "llama.context_length")):  # the last from its GGUF header
        with pytest.raises(ValueError, match=re.escape(f"{limit} tokens ({key} in its config): set max_model_len "
                                                       f"to at most {limit}")):
            check_context(source, limit + 1)
    params = tmp_path / "p.yaml"
    for other, said in (('source: "/no/such/model"', "unknown model source '/no/such/model'"),
                        ('source: "tiny:gpt2", max_model_len: 4096', "max_model_len 4096 is above the context of "
                                                                     "model 'tiny:gpt2', 512 tokens"),
                        ('source: "tiny:gpt2", max_model_len: 512', None)):
        params.write_text(f'variants:\n  llama: {{model: {{source: "tiny:llama"}}}}\n  other: {{model: {{{other}}}}}\n')
        out = subprocess.run([*command(CLI), "--mode", "validate_only", "--params", str(params), "--variants", "llama,1"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert (out.returncode, said is None or said in out.stderr) == (0 if said is None else 2, True), \
            (other, out.stderr[-500:])


def test_a_cuda_device_this_machine_lacks_is_refused_before_anything_starts(tmp_path):
    """A worker placed on a CUDA device the machine does not have failed its load and was started
    again until it gave up, while `serve` waited for it. Now it is refused by name at once: predict
    plans in the preloaded server, validate_only here as serve does (the same call)."""
    import torch

    from workers.devices import absent_devices

    n = torch.cuda.device_count()
    said = "has no CUDA device" if n == 0 else f"has {n} CUDA device(s)"
    assert absent_devices(["cpu"]) is None and said in absent_devices(["cpu", f"cuda:{n}"])
    data = tmp_path / "data"
    data.mkdir()
    (data / "r.jsonl").write_text('{"prompt": "one"}\n')
    params = write_params(tmp_path, {"llama": tiny_variant("llama", "JsonlCompletions", data)})
    for mode in ("validate_only", "predict"):
        bad = subprocess.run([*command(CLI), "--mode", mode, "--params", str(params), "--variants", "llama,1",
                              "--devices", f"cpu,cuda:{n}", "--model_dir", str(tmp_path / "md")],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and f"devices: cuda:{n} given, but this machine {said}" in bad.stderr, (
            mode, bad.returncode, bad.stderr[-800:])


def test_place_worker_adds_one_beside_the_plan_and_leaves_the_plan_as_it_was(monkeypatch):
    from fusion.plan import KV_AUTO_SHARE, device_fixed_bytes, kv_bytes_per_token, place_worker

    avail = 8 * 2**30
    monkeypatch.setattr("fusion.plan.available_bytes", lambda d: avail)
    fusion = MultiModelFusion([info("m", "smollm2-135m", dtype="bfloat16", max_batch_size=4)])
    plan = make_plan(fusion, 1, "cpu", threads_per_worker=1)
    before = [(w.spec, w.kv_tokens) for w in plan.workers]
    w = place_worker(plan.workers, fusion.models[0].spec, 0, "cpu", threads=1, avail=avail)
    assert [(x.spec, x.kv_tokens) for x in plan.workers] == before  # the existing workers are unchanged
    assert (w.worker_id, w.model_id, w.shares_weights) == (1, 0, True)
    # an `auto` budget: what the device has left after the first worker, within what its limits use
    left = int(avail * KV_AUTO_SHARE) - device_fixed_bytes([*plan.workers, w], "cpu") - plan.workers[0].kv_cache_bytes
    per_token = kv_bytes_per_token("smollm2-135m", w.precision.compute.itemsize)
    assert w.kv_cache_bytes == min(left, per_token * 4 * 2048) > 0
    if plan.workers[0].cpus is not None and len(plan.workers[0].cpus) + 1 <= len(os.sched_getaffinity(0)):
        assert w.cpus == [sorted(os.sched_getaffinity(0))[1]]  # the next free core
    with pytest.raises(ValueError, match="no memory left"):
        place_worker(plan.workers, fusion.models[0].spec, 0, "cpu", avail=plan.devices["cpu"]["estimated_bytes"])
