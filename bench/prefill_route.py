"""The prompt chunks' route (workers.engine.cpu.prefill_route) on this machine: each measured
cell's kernel and SDPA timings, then one long prompt's first token with the route as measured
against the C++ kernel for every chunk, alternated on the same engine settings. Prints JSON lines.

    python bench/prefill_route.py [--model smollm2-135m] [--prompt-tokens 4000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not bench/, first on the path

import torch  # noqa: E402

from bench.machine import describe  # noqa: E402
from workers.engine import Engine, EngineConfig  # noqa: E402
from workers.engine.cpu import prefill_route  # noqa: E402
from workers.engine.params import SamplingParams  # noqa: E402
from workers.engine.runners.base import kv_dims  # noqa: E402
from workers.models import load_model  # noqa: E402


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    emit(**describe("prefill_route", sys.argv))
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype="auto")
    cfg = EngineConfig(max_batch_size=4, max_batch_tokens=args.max_batch_tokens, quantization=args.quantization)
    eng = Engine(lm, cfg)
    backend = eng.runner.backend
    if backend.prefill is None:
        emit(system="prefill_route", error="no C++ prefill kernel serves this model here: nothing to route")
        return
    kvh, dk, _ = kv_dims(lm)
    heads = lm.model.config.get_text_config().num_attention_heads
    kernel_only = dataclasses.replace(backend, library_prefill=None)
    for (rows, keys), (kernel, sdpa) in sorted(prefill_route.measure(
            kernel_only, heads, kvh, dk, eng.runner.block_size, eng.runner.cache.keys.dtype, lm.device,
            args.max_batch_tokens).items()):
        emit(system="prefill_cell", tokens=rows, keys=keys, kernel_ms=round(kernel * 1e3, 3), sdpa_ms=round(sdpa * 1e3, 3),
             kernel_over_sdpa=round(kernel / sdpa, 3))
    emit(system="prefill_route", chosen=eng.kernels.get("prefill attention"), model=args.model,
         dtype=str(eng.runner.cache.keys.dtype).removeprefix("torch."), threads=args.threads)
    rng = random.Random(1)
    greedy = SamplingParams(max_tokens=1, temperature=0)
    seconds: dict[str, list[float]] = {"route": [], "kernel": []}
    for r in range(args.repeats):
        for name in ("route", "kernel") if r % 2 == 0 else ("kernel", "route"):
            eng.runner.backend = backend if name == "route" else kernel_only
            prompt = [rng.randrange(1000, lm.vocab_size) for _ in range(args.prompt_tokens)]  # no cached prefix
            t = time.perf_counter()
            eng.generate([prompt], greedy)
            seconds[name].append(time.perf_counter() - t)
    emit(system="long_prompt_first_token", prompt_tokens=args.prompt_tokens, max_batch_tokens=args.max_batch_tokens,
         route_s=[round(s, 2) for s in seconds["route"]], kernel_s=[round(s, 2) for s in seconds["kernel"]],
         kernel_over_route=round(min(seconds["kernel"]) / min(seconds["route"]), 3), repeats=args.repeats,
         quantization=args.quantization, model=args.model)


if __name__ == "__main__":
    main()
