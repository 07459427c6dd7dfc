"""Whether a greedy answer's tokens and log-probabilities depend on what else the engine does:
the same prompt (a 1,500-token prefix and 12 more tokens, 24 greedy tokens) alone on a fresh
engine, then sent with 31 other requests of random lengths, after another request cached its
prefix, and on an engine with max_batch_tokens 128 instead of 512. One JSON line per dtype: for
each case, whether the tokens are equal and the log-probabilities bit for bit, and the largest
log-probability difference.

    python bench/determinism.py [--model smollm2-135m] [--dtypes bfloat16,float32] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench.engine import emit  # noqa: E402
from bench.machine import describe  # noqa: E402
from workers.engine import Engine, EngineConfig  # noqa: E402
from workers.engine.params import SamplingParams  # noqa: E402
from workers.models import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    emit(**describe("determinism", sys.argv))
    rng = random.Random(0)
    for dtype in args.dtypes.split(","):
        lm = load_model(args.model, dtype=dtype)
        vocab = lm.vocab_size
        prefix = [rng.randrange(100, vocab) for _ in range(1500)]
        prompt = prefix + [rng.randrange(100, vocab) for _ in range(12)]
        others = [[rng.randrange(100, vocab) for _ in range(rng.randrange(16, 300))] for _ in range(31)]
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)

        def engine(tokens: int = 512, lm=lm) -> Engine:
            return Engine(lm, EngineConfig(max_batch_size=32, max_batch_tokens=tokens))

        def answer(eng: Engine, prompts: list, params=params) -> tuple[list[int], list[float]]:
            out = eng.generate(prompts, [params] * len(prompts))[0].outputs[0]
            return out.token_ids, out.logprobs

        alone = answer(engine(), [prompt])
        cached = engine()
        answer(cached, [prefix + [5, 6, 7]])
        cases = {"batched_with_31": answer(engine(), [prompt, *others]), "after_prefix_cached": answer(cached, [prompt]),
                 "max_batch_tokens_128": answer(engine(128), [prompt])}
        emit(model=args.model, dtype=dtype, precision=Engine(lm, EngineConfig()).precision.describe(),
             **{name: {"tokens_equal": tokens == alone[0], "logprobs_bitwise": lps == alone[1],
                       "max_abs_logprob_diff": max(abs(a - b) for a, b in zip(lps, alone[1]))}
                for name, (tokens, lps) in cases.items()})


if __name__ == "__main__":
    main()
