"""The peer: vLLM's CPU build on bench/engine.py's workload and single stream. Runs inside the
peer environment (`make bench-peers` builds .venv-peers), so it imports only vLLM and the
standard library; bench/engine.py starts it and passes the workload as a JSON file.

    .venv-peers/bin/python bench/vllm_cpu.py --model-dir DIR --workload FILE [--threads 2]

Settings as vLLM's CPU docs advise, matched to the engine's: VLLM_CPU_KVCACHE_SPACE for the KV
cache (GiB), VLLM_CPU_OMP_THREADS_BIND to pin its OpenMP threads to the cores, max_num_seqs 64
and max_num_batched_tokens 512. Prints one JSON line: workload tokens/s, single-stream ms/token
(best of --repeats), and the seconds from start to a ready engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="a Hugging Face model directory")
    ap.add_argument("--dtype", default="bfloat16", help="vLLM's dtype (float32, bfloat16)")
    ap.add_argument("--workload", required=True, help='JSON: {"prompts": [[ids]], "max_tokens": [n], "single": [ids]}')
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-space-gib", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--single-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_space_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    work = json.loads(open(args.workload).read())

    t = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model_dir, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=8192, seed=0,
              enable_prefix_caching=False)
    start_s = time.perf_counter() - t

    def generate(prompts, max_tokens):
        params = [SamplingParams(max_tokens=m, min_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t
        return wall, sum(len(o.outputs[0].token_ids) for o in outs)

    generate([work["prompts"][0][:16]], [2])  # warm-up
    runs = [generate(work["prompts"], work["max_tokens"]) for _ in range(args.repeats)]
    wall, useful = min(runs)
    if useful != sum(work["max_tokens"]):
        sys.exit(f"vLLM generated {useful} tokens, expected {sum(work['max_tokens'])}")
    new = args.single_new_tokens
    single = min(generate([work["single"]], [new])[0] for _ in range(args.repeats))
    print(json.dumps({"system": "vllm_cpu", "vllm": vllm.__version__, "dtype": args.dtype, "tokens_per_s": round(useful / wall, 2),
                      "wall_s": round(wall, 2), "useful_tokens": useful,
                      "single_stream_ms_per_token": round(single / new * 1e3, 2), "start_s": round(start_s, 1),
                      "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                      "kv_cache_space_gib": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
                      "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"], "repeats": args.repeats}),
          flush=True)


if __name__ == "__main__":
    main()
