"""`make run`: the multi-model predict demo on the bundled data in data/demo.

SmolLM2-135M x2 completes the HDF5 prompts (its batches split over the two copies) while Gemma 3
270M x1 serves the JSONL requests, except the lines whose `model` names smollm2; all through one
router. Then prints where the outputs are and a few completions.

    python -m fusion.demo [--model_dir model_dir/demo] [--keep] [--inference_steps K]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from fusion import cli

PARAMS = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def decoder(source: str):
    """Something with `decode(ids, skip_special_tokens=True)` for an embedded model: the
    tokenizers library on a tokenizer saved beside its converted or shared weights (a moment; the
    demo's workers just wrote the shared ones), else the transformers tokenizer (importing torch
    and transformers first: seconds)."""
    from workers.weights.sources import embedded_gguf, gguf_cache_dir, shared_dirs

    converted = gguf_cache_dir(embedded_gguf(source))
    saved = [d / "tokenizer.json" for d in ([converted] if converted is not None else []) + shared_dirs(source)]
    for path in saved:
        if path.is_file():
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(path))
    from fusion.data.prepare import tokenize_only

    return tokenize_only(source)


def show_hdf5(pred_dir: Path, start_token: int, rows: int = 3) -> None:
    tok = decoder("smollm2-135m")
    with np.load(pred_dir / "predictions_1.npz") as z:
        preds = z["predictions"]
    print(f"\n== smollm2 x2, HDF5 ({pred_dir}, {len(list(pred_dir.glob('*.npz')))} files) ==")
    for row in preds[:rows]:
        ids = [int(t) for t in row if t != start_token]
        print("  " + json.dumps(tok.decode(ids, skip_special_tokens=True))[:300])


def show_jsonl(path: Path, lines: int = 14) -> None:
    print(f"\n== JSONL requests ({path}) ==")
    for raw in path.read_text().splitlines()[:lines]:
        rec = json.loads(raw)
        req = rec["request"]
        prompt = req.get("prompt", "") if isinstance(req, dict) else req
        if "error" in rec:
            print(f"  error: {rec['error']['message']}")
            continue
        res = rec["result"]
        texts = " | ".join(json.dumps(c["text"])[:120] for c in res["choices"])
        print(f"  [{res['model']}] {json.dumps(prompt)[:60]} -> {texts}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_dir", default="model_dir/demo")
    ap.add_argument("--keep", action="store_true", help="keep earlier outputs (the rerun then resumes)")
    ap.add_argument("--inference_steps", type=int, help="only the first K batches per model (a quick look)")
    args = ap.parse_args(argv)
    out = Path(args.model_dir)
    if not args.keep and (out / "predictions").exists():
        shutil.rmtree(out / "predictions")
    t = time.perf_counter()
    steps = ["--inference_steps", str(args.inference_steps)] if args.inference_steps else []
    # the demo's router is its own: ports the OS picks, so that a server (or another demo) on the
    # default ports does not stop it
    ports = ["--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://127.0.0.1:*"]
    rc = cli.main(["--mode", "predict", "--params", str(PARAMS), "--model_dir", str(out), *ports, *steps])
    if rc != 0:
        return rc
    print(f"\ndemo finished in {time.perf_counter() - t:.0f}s; outputs under {out / 'predictions'}")
    show_hdf5(out / "predictions" / "smollm2", start_token=49152)
    for path in sorted((out / "predictions").glob("output_*.jsonl")):
        show_jsonl(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
