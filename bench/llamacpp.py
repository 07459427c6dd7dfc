"""llama.cpp (llama-cpp-python) on one stream, run in the peer environment by bench/peers.py: the
same GGUF file, the same prompt token IDs and the same number of greedy tokens as the engine's
single stream, on the same threads. Prints one JSON line: ms per generated token (the prompt's
evaluation included, as the engine's figure does: each run starts from an empty cache), best of
the repeats."""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompt", required=True, help="token IDs, comma-separated")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    import llama_cpp

    prompt = [int(t) for t in args.prompt.split(",")]
    llm = llama_cpp.Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=len(prompt) + args.new + 16, n_batch=len(prompt), verbose=False)

    def once() -> tuple[float, list[int]]:
        # generate() keeps the longest prefix of its last tokens' cache: after one run the prompt is
        # found there and only its last token is evaluated again, unless the state is reset
        llm.reset()
        out: list[int] = []
        t = time.perf_counter()
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(tok)
            if len(out) == args.new:
                break
        return time.perf_counter() - t, out

    once()  # warm-up
    best, tokens = min(once() for _ in range(args.repeats))
    info = llama_cpp.llama_print_system_info().decode().strip()
    print(json.dumps({"system": "llamacpp", "single_stream_ms_per_token": round(best / args.new * 1e3, 2),
                      "new_tokens": len(tokens), "threads": args.threads, "version": llama_cpp.__version__,
                      "system_info": info}), flush=True)


if __name__ == "__main__":
    main()
