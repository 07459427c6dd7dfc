"""`make run` demo: complete a few real prompts on each embedded model with the engine.

    python -m workers.demo [--models smollm2-135m gemma3-270m] [--max-tokens 40]
"""

from __future__ import annotations

import argparse
import time

import torch

from workers.engine.params import SamplingParams
from workers.models import load_engine

PROMPTS = [
    "The three primary colors are",
    "Here is a Python function that checks whether a number is prime:\n",
    "The capital of France is",
    "Once upon a time, a small robot",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for source in args.models:
        t0 = time.perf_counter()
        engine = load_engine(source, dtype=args.dtype, max_batch_size=16, max_batch_tokens=256)
        load_s = time.perf_counter() - t0
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=0),
                  SamplingParams(max_tokens=args.max_tokens, temperature=0.7, top_p=0.9, seed=1),
                  SamplingParams(max_tokens=args.max_tokens, temperature=0, stop=["\n"]),
                  SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_k=40, seed=2)]
        t1 = time.perf_counter()
        outs = engine.generate(PROMPTS, params)
        gen_s = time.perf_counter() - t1
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"\n=== {source} ({engine.lm.dtype}, loaded in {load_s:.1f}s; {tokens} tokens in {gen_s:.1f}s, "
              f"{tokens / gen_s:.1f} tok/s, batched)")
        for prompt, out in zip(PROMPTS, outs):
            c = out.outputs[0]
            print(f"--- [{c.finish_reason}] {prompt!r}\n{prompt}{c.text}")


if __name__ == "__main__":
    main()
