"""Turn text prompts into HDF5 input for GptHDF5MapDataProcessor.

    python -m fusion.data.prepare --model smollm2-135m --start-token 49152 prompts.txt out.h5

One prompt per line of prompts.txt (blank lines skipped). Each is tokenized, followed by the start
token, and padded with the start token to the longest row (or --max-seq-len).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def tokenize_only(source: str):
    """The tokenizer of a model source, without loading its weights (or importing torch) where
    that can be avoided."""
    from workers.weights.sources import EMBEDDED, embedded_gguf, gguf_cache_dir

    if source.startswith("tiny:"):
        from workers.weights.tiny_tokenizer import tiny_tokenizer

        return tiny_tokenizer(source.split(":")[1])
    if source in EMBEDDED or source.endswith(".gguf"):
        from transformers import AutoTokenizer

        path = embedded_gguf(source) if source in EMBEDDED else Path(source)
        converted = gguf_cache_dir(path)  # the tokenizer saved beside the converted weights reads in a moment
        if converted is not None:
            return AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if Path(source).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    from workers.models import load_model

    return load_model(source, dtype="float32").tokenizer


def build(prompts: list[str], tokenizer, start_token: int, max_seq_len: int | None = None) -> np.ndarray:
    rows = [list(tokenizer(p).input_ids) for p in prompts]
    for i, r in enumerate(rows):
        if start_token in r:
            raise ValueError(f"prompt {i + 1} contains the start token {start_token}; pick an ID no prompt uses")
    width = max(len(r) for r in rows) + 1
    if max_seq_len is not None:
        if max_seq_len < width:
            raise ValueError(f"--max-seq-len {max_seq_len} is too short: the longest prompt needs {width} "
                             "(tokens + start token)")
        width = max_seq_len
    out = np.full((len(rows), width), start_token, dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompts", type=Path)
    ap.add_argument("output", type=Path)
    ap.add_argument("--model", required=True, help="model source whose tokenizer to use")
    ap.add_argument("--start-token", type=int, required=True)
    ap.add_argument("--max-seq-len", type=int, default=None, help="row length (default: longest prompt + 1)")
    args = ap.parse_args(argv)
    try:
        prompts = [ln for ln in args.prompts.read_text().splitlines() if ln.strip()]
        if not prompts:
            raise ValueError(f"{args.prompts} holds no prompts")
        data = build(prompts, tokenize_only(args.model), args.start_token, args.max_seq_len)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import h5py

    args.output.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(args.output, "w") as f:
        f["data"] = data
    print(f"wrote {args.output}: {data.shape[0]} prompts x {data.shape[1]} tokens, start token {args.start_token}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
