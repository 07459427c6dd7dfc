"""The engine and a deployment on a CUDA GPU, printing JSON lines; every figure from this run.

  parity:        fp32 and bf16: the engine's greedy tokens for 8 prompts in one mixed batch against
                 transformers `generate` on each prompt alone, on the GPU (how many prompts match
                 token for token, and the first differing position of the others);
  workload:      bench/engine.py's workload (64 requests, greedy, no early stop) in bf16: the engine
                 eager and compiled (CUDA graphs), and transformers' static batches of 32;
  single_stream: one 64-token prompt, 128 new tokens, ms/token: engine eager, compiled, `generate`, and
                 `generate` with a static cache (transformers compiles its forward as full CUDA
                 graphs); the engine's decode graphs' capture time, and a decode step's host share
                 (filling the inputs) against its device share (the copy in, the replay, the tokens out);
  quantized:     one stream and the workload with `quantization` none, int8 and int4 (the weight-only
                 Triton linears of workers.engine.cuda.triton_qlinear, each weight's row kernel shape
                 measured at load; for int4 in bfloat16, torch's tinygemm at the decode buckets where
                 it measured faster at load; both named in `int8_kernels` / `int4_kernels`), eager;
                 quantized_stream: one stream only;
  deterministic: the same with `deterministic` off and on (the batch-invariant Triton kernels, each
                 dense weight's tiles measured at load, named in `on_kernels`);
  census:        the CUDA kernels a decode step launches (torch.profiler over the decode graphs'
                 replays), by name, a step and a layer, and the device time a step by group
                 (attention, GEMM, norm, KV and rotary, elementwise, sampling): one stream and 64;
  deployment:    bench/gpu_deploy.py: one deployment behind the HTTP gateway on one GPU, --copies
                 copies of the model sharing one weight owner and one copy of --second-model: the
                 plan; the engine in-process, one copy over HTTP and every copy (tokens/s); each
                 model alone and both at once; each copy's greedy answer; every process's GPU
                 memory against the plan and the allowance of a copy; aborts at exit.

    python bench/gpu.py [--model smollm2-135m] [--device cuda:0] [--copies 3] [--second-model llama-3.2-1b]
                        [--parts ...] [--random-weights]

--random-weights builds a model of the source's shape with random weights (they run at the speed
of the real ones), for a machine where the model's files are not at hand; parity then compares
the engine with transformers on those weights. Its shapes: SmolLM2-135M's (`--model smollm2-135m`)
Llama 3.2 1B's (`--model llama-3.2-1b`: 16 layers, 2048 wide, 32/8 heads, 8192 intermediate,
a vocabulary of 128,256, tied) and Gemma 3 270M's (`--model gemma3-270m`: 18 layers, five sliding
to one full, 640 wide, 4/1 heads of 256).
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as a script, bench/ is first on sys.path, where bench/http.py would shadow the standard
# library's http package: the repository root goes there
sys.path[0] = str(Path(__file__).resolve().parents[1])
ROOT = Path(__file__).resolve().parents[1]

import argparse  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench.engine import emit, run_hf_static, single_prompt, workload  # noqa: E402
from bench.machine import describe  # noqa: E402
from workers.engine import Engine, EngineConfig  # noqa: E402
from workers.engine.attention import hf_attention  # noqa: E402
from workers.engine.params import SamplingParams  # noqa: E402
from workers.models import load_model  # noqa: E402

# the shapes --random-weights builds (transformers config keys)
SHAPES = {"smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                               num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                               max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                               rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
          # Llama 3.2 1B (its rope scaling left out: the same work a token)
          "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                               max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                               rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
          # Gemma 3 270M: five sliding layers (a window of 512) to one full, Gemma 3's own rotary bases
          "gemma3-270m": dict(model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                              max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                              query_pre_attn_scalar=256, sliding_window=512)}
# the kernel census's groups: a kernel's group is the first whose words its name holds
KERNEL_GROUPS = (("attention", ("attention", "_segment_kernel", "_merge_kernel", "flash", "fmha")),
                 ("sampling", ("argmax", "sort", "scan", "cumsum", "topk", "softmax", "multinomial")),
                 ("norm", ("norm",)),
                 ("kv_rotary", ("rope", "kv_write", "roll")),
                 ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "sm80", "matmul", "_linear_kernel",
                           "qlinear", "splitk", "xmma", "ampere", "cublas")))


def random_weights(name: str, dest: Path) -> str:
    """A model directory of `name`'s shape with random weights (bfloat16) and the byte-level tiny
    tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.weights.tiny_tokenizer import tiny_tokenizer

    if name not in SHAPES:
        sys.exit(f"--random-weights knows the shapes of {sorted(SHAPES)}, not {name!r}")
    kw = dict(SHAPES[name])
    tok = tiny_tokenizer("llama")
    config = AutoConfig.for_model(kw.pop("model_type"), bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # the scale of trained weights: activations stay in range
            p.mul_(0.5)
    # kept in bfloat16: half the bytes to write and read (Llama 3.2 1B's shape: 2.5 GB, not 5), and
    # every run, float32 ones included, reads the same values
    model.to(torch.bfloat16).save_pretrained(dest)
    tok.save_pretrained(dest)
    return str(dest)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def hf_greedy(model, prompt: list[int], new: int, device: str, cache: str | None = None) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=device),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                             cache_implementation=cache)
    return out[0, len(prompt):].tolist()


def parity(args) -> None:
    for dtype in ("float32", "bfloat16"):
        lm = load_model(args.model, dtype=dtype, device=args.device)
        prompts, _ = workload(8, lm.vocab_size, seed=3)
        new = 32
        eng = Engine(lm, EngineConfig(max_batch_size=8, max_batch_tokens=256))
        got = [o.outputs[0].token_ids for o in
               eng.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))]
        with hf_attention(lm.model, "sdpa"):
            want = [hf_greedy(lm.model, p, new, args.device) for p in prompts]
        first_diff = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]
        emit(part="parity", dtype=dtype, prompts=len(prompts), new_tokens=new,
             prompt_lengths=[len(p) for p in prompts], equal=sum(d is None for d in first_diff),
             first_differing_position=first_diff)
        del eng, lm


def timed_engine(lm, prompts, max_tokens, compile: str, device: str, batch: int = 64, tokens: int = 512,
                 quantization: str = "none", deterministic: bool = False, kernels: dict | None = None):
    """The workload's wall time on a fresh engine; `kernels`: filled with what the engine measured
    and chose at load (Engine.kernels: for int4 on a GPU, tinygemm's rows per shape)."""
    eng = Engine(lm, EngineConfig(max_batch_size=batch, max_batch_tokens=tokens, compile=compile,
                                  quantization=quantization, deterministic=deterministic))
    if kernels is not None:
        kernels.update(eng.kernels)
    eng.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    sync(device)
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    sync(device)
    wall = time.perf_counter() - t
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(max_tokens), "engine stopped early"
    return wall


def speed(args) -> None:
    lm = load_model(args.model, dtype="bfloat16", device=args.device)
    prompts, max_tokens = workload(64, lm.vocab_size)
    useful = sum(max_tokens)
    common = dict(model=args.model, dtype="bfloat16", device=device_name(args.device),
                  requests=len(prompts), prompt_tokens=sum(map(len, prompts)), new_tokens=useful)
    if "workload" in args.parts:
        with hf_attention(lm.model, "sdpa"):
            sync(args.device)
            hf = min(run_hf_static(lm.model, prompts, max_tokens, 32, args.device)[0]
                     for _ in range(args.repeats))
        rows = {}
        for compile in ("false", "true"):
            if compile == "true":
                t = time.perf_counter()
                Engine(lm, EngineConfig(max_batch_size=64, max_batch_tokens=512, compile="true"))
                emit(part="compile", start_s=round(time.perf_counter() - t, 1), **common)
            rows[compile] = min(timed_engine(lm, prompts, max_tokens, compile, args.device)
                                for _ in range(args.repeats))
        emit(part="workload", engine_eager_tokens_per_s=round(useful / rows["false"], 1),
             engine_compiled_tokens_per_s=round(useful / rows["true"], 1),
             hf_static32_tokens_per_s=round(useful / hf, 1),
             eager_vs_hf_static32=round(hf / rows["false"], 2), compiled_vs_hf_static32=round(hf / rows["true"], 2),
             repeats=args.repeats, **common)
    quantizations = {q: {"quantization": q} for q in ("none", "int8", "int4")}
    if "quantized" in args.parts:  # the weight-only linears against the 16-bit weights
        emit(part="quantized", **settings_rows(lm, prompts, max_tokens, args, quantizations), **common)
    if "quantized_stream" in args.parts:  # the same, one stream only (a bigger shape's quick look)
        emit(part="quantized_stream", **settings_rows(lm, prompts, max_tokens, args, quantizations, workload=False),
             **common)
    if "deterministic" in args.parts:  # the batch-invariant kernels' cost
        emit(part="deterministic", **settings_rows(lm, prompts, max_tokens, args,
                                                   {"off": {"deterministic": False}, "on": {"deterministic": True}}),
             **common)
    if "single_stream" in args.parts:
        prompt, new = single_prompt(lm.vocab_size), 128
        ms = {}
        for compile in ("false", "true"):
            ms[compile] = min(timed_engine(lm, [prompt], [new], compile, args.device, batch=1, tokens=128)
                              for _ in range(args.repeats)) / new * 1e3
        with hf_attention(lm.model, "sdpa"):
            hf_ms = {}
            for cache in (None, "static"):  # static: transformers compiles the forward as CUDA graphs
                hf_greedy(lm.model, prompt, new, args.device, cache)  # warm-up (the static one compiles)
                hf_greedy(lm.model, prompt, new, args.device, cache)
                times = []
                for _ in range(args.repeats):
                    sync(args.device)
                    t = time.perf_counter()
                    hf_greedy(lm.model, prompt, new, args.device, cache)
                    sync(args.device)
                    times.append((time.perf_counter() - t) / new * 1e3)
                hf_ms[cache] = min(times)
        split = decode_split(lm, prompt, new)
        emit(part="single_stream", engine_eager_ms_per_token=round(ms["false"], 2),
             engine_compiled_ms_per_token=round(ms["true"], 2), transformers_generate_ms_per_token=round(hf_ms[None], 2),
             transformers_static_compiled_ms_per_token=round(hf_ms["static"], 2),
             engine_vs_static_compiled=round(ms["false"] / hf_ms["static"], 3), **split,
             stream_prompt_tokens=len(prompt), stream_new_tokens=new, repeats=args.repeats,
             model=args.model, dtype="bfloat16", device=device_name(args.device))


def settings_rows(lm, prompts, max_tokens, args, settings: dict[str, dict], workload: bool = True) -> dict:
    """One stream's ms/token and (`workload`) the workload's tokens/s under each of `settings`
    (engine config keys by label), eager, best of the repeats."""
    prompt, new, useful = single_prompt(lm.vocab_size), 128, sum(max_tokens)
    row: dict = {"repeats": args.repeats}
    for label, cfg in settings.items():
        chosen: dict[str, str] = {}
        one = min(timed_engine(lm, [prompt], [new], "false", args.device, batch=1, tokens=128, kernels=chosen, **cfg)
                  for _ in range(args.repeats))
        row[f"{label}_single_stream_ms_per_token"] = round(one / new * 1e3, 2)
        if workload:
            many = min(timed_engine(lm, prompts, max_tokens, "false", args.device, kernels=chosen, **cfg)
                       for _ in range(args.repeats))
            row[f"{label}_workload_tokens_per_s"] = round(useful / many, 1)
        if chosen:  # the last engine's choice (one stream's engine has the bucket of 1 row only)
            row[f"{label}_kernels"] = chosen
    return row


def decode_split(lm, prompt: list[int], new: int) -> dict:
    """One stream on a fresh engine: its decode graphs' capture time; per decode step the host's
    share (filling the inputs), the launch (copy in, replay, copy out queued) and the wait for the
    tokens, in ms; and ms/token with the host's step n+1 overlapping the device's step n and without."""
    t = time.perf_counter()
    eng = Engine(lm, EngineConfig(max_batch_size=64, max_batch_tokens=512))
    start_s = time.perf_counter() - t
    runner = eng.runner
    if getattr(runner, "decode_steps", None) is None:  # a model without the device's lean forward
        return {"decode_graphs": False}
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    out = {"decode_graphs": bool(runner.graphs), "engine_start_s": round(start_s, 2),
           "capture_s": round(runner.capture_seconds, 2), "decode_buckets": runner.buckets}
    for overlap in (False, True):
        runner.overlap = overlap
        eng.generate([prompt], params)  # warm
        runner.decode_steps, runner.fill_seconds, runner.launch_seconds, runner.wait_seconds = 0, 0.0, 0.0, 0.0
        sync(str(lm.device))
        t = time.perf_counter()
        eng.generate([prompt], params)
        sync(str(lm.device))
        ms = (time.perf_counter() - t) / new * 1e3
        steps = max(1, runner.decode_steps)
        tag = "overlap" if overlap else "sync"
        out |= {f"{tag}_ms_per_token": round(ms, 3),
                f"{tag}_host_fill_ms": round(runner.fill_seconds / steps * 1e3, 3),
                f"{tag}_launch_ms": round(runner.launch_seconds / steps * 1e3, 3),
                f"{tag}_wait_ms": round(runner.wait_seconds / steps * 1e3, 3)}
    out["steps_ahead"] = eng.steps_ahead
    return out


def kernel_group(name: str) -> str:
    low = name.lower()
    return next((group for group, words in KERNEL_GROUPS if any(w in low for w in words)), "elementwise")


def census(args) -> None:
    """The CUDA kernels a decode step launches (torch.profiler over the replays of the decode
    graphs), by name, and the device time a step by group: one stream, and 64 streams."""
    from torch.profiler import ProfilerActivity, profile

    lm = load_model(args.model, dtype="bfloat16", device=args.device)
    layers = lm.model.config.num_hidden_layers
    eng = Engine(lm, EngineConfig(max_batch_size=64, max_batch_tokens=512))
    if not getattr(eng.runner, "graphs", None):
        emit(part="census", decode_graphs=False, model=args.model)
        return
    for rows in (1, 64):
        prompts = workload(rows, lm.vocab_size, seed=5)[0]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        eng.generate(prompts, params)  # warm
        steps_before = eng.runner.decode_steps
        sync(args.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.generate(prompts, params)
            sync(args.device)
        steps = max(1, eng.runner.decode_steps - steps_before)
        kernels: dict[str, list] = {}
        for e in prof.events():
            if e.device_type.name == "CUDA" and e.device_time > 0 and "memcpy" not in e.name.lower():
                k = kernels.setdefault(e.name, [0, 0.0])
                k[0] += 1
                k[1] += e.device_time
        # the prefill steps are eager and few: a name's count below the decode steps' is theirs
        decode = {n: c for n, c in kernels.items() if c[0] >= steps}
        per_step = sum(c for c, _ in decode.values()) / steps
        groups: dict[str, float] = {}
        for n, (_, us) in decode.items():
            groups[kernel_group(n)] = groups.get(kernel_group(n), 0.0) + us / steps
        emit(part="census", rows=rows, decode_steps=steps, kernels_per_step=round(per_step, 1),
             kernels_per_layer=round(per_step / layers, 2), layers=layers,
             device_us_per_step={g: round(us, 1) for g, us in sorted(groups.items())},
             kernels={n[:80]: round(c / steps, 2) for n, (c, _) in sorted(decode.items(), key=lambda x: -x[1][1])},
             model=args.model, dtype="bfloat16", device=device_name(args.device))


def inprocess_wall(args, prompts, max_tokens) -> float:
    """The deployment part's peer: the workload's seconds on the model's engine in this process, best
    of the repeats; the model is let go of after, so that only this process's context stays."""
    import gc

    lm = load_model(args.model, dtype="bfloat16", device=args.device)
    wall = min(timed_engine(lm, prompts, max_tokens, "false", args.device) for _ in range(args.repeats))
    del lm
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return wall


def own_gpu_memory(args) -> int | None:
    """This process's GPU memory (nvidia-smi), None off a GPU."""
    if not args.device.startswith("cuda"):
        return None
    from bench.gpu_deploy import gpu_memory_by_pid

    return gpu_memory_by_pid().get(os.getpid())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--second-model", default="llama-3.2-1b",
                    help="deployment: the model sharing the GPU with --model's copies")
    ap.add_argument("--gpu-sharing", default="auto", choices=("auto", "mps", "timeslice"),
                    help="deployment: how its workers share the GPU (runconfig gpu_sharing)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=49152, help="deployment: token ids of the workload below this")
    ap.add_argument("--parts", default="parity,workload,single_stream,quantized,deterministic,census,deployment")
    ap.add_argument("--random-weights", action="store_true", help="a model of --model's shape, random weights")
    args = ap.parse_args()
    args.parts = args.parts.split(",")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA device (--device cpu runs its parts on the CPU)")
    emit(**describe("gpu", sys.argv), gpu=device_name(args.device))
    args.second_shape = args.second = args.second_model
    if args.random_weights:
        tmp = tempfile.TemporaryDirectory(prefix="mmfusion-random-")
        args.shape, args.model = args.model, random_weights(args.model, Path(tmp.name) / "first")
        if "deployment" in args.parts:
            args.second = random_weights(args.second_model, Path(tmp.name) / "second")
        emit(random_weights=True, shape=args.shape)
    if "parity" in args.parts:
        parity(args)
    if {"workload", "single_stream", "quantized", "quantized_stream", "deterministic"} & set(args.parts):
        speed(args)
    if "census" in args.parts:
        census(args)
    if "deployment" in args.parts:
        from bench.gpu_deploy import deployment

        deployment(args, lambda p, m: inprocess_wall(args, p, m), lambda: own_gpu_memory(args))


if __name__ == "__main__":
    main()
