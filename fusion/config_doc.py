"""docs/configuration.md, generated from the code's own tables of keys.

    python -m fusion.config_doc            print the page
    python -m fusion.config_doc --write    write it to docs/configuration.md

tests/test_config_doc.py fails when the page and the tables disagree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fusion.params import INPUT_KEYS, RUNCONFIG_KEYS
from workers.config_keys import MODEL_KEYS, REQUIRED, Key

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

INTRO = """# Configuration

A deployment is described by a params YAML file (`--params`): named **variants**, each a model
with its settings and its input data, and a **runconfig** for the deployment as a whole.
`--variants NAME,COUNT ...` picks which variants run and how many copies of each (1 to 1,024);
every copy is a model ID of its own. Command-line flags of `run_mm.py` (or `mmfusion`) override the runconfig key
of the same name (`--model_dir`, `--num_workers`, `--devices`, `--router`, `--frontend`,
`--backend`, `--inference_steps`, `--threads_per_worker`, `--curve_keys`, `--insecure`,
`--max_restarts`, `--restart_wait`, `--http`, `--api-key`, `--api_keys_file`, `--ray`), checked as
the file's keys are.

```yaml
variants:
  smollm2:
    model:                      # the keys of "Model keys" below
      source: smollm2-135m
      dtype: auto
      max_batch_size: 32
    inference_input:            # the keys of "Input keys" below
      data_processor: GptHDF5MapDataProcessor
      data_dir: data/demo/hdf5
      batch_size: 8
runconfig:                      # the keys of "Runconfig keys" below
  model_dir: model_dir/demo
  variants: [[smollm2, 2]]
```

An unknown key, or a value outside the valid values below, stops the run before anything loads,
with an error that names the file and the key. (Whether a model source can be loaded is found out
by the worker that loads it, which reports `load_failed` with the loader's error.) This page is generated from the code's tables
(`python -m fusion.config_doc --write`); a test keeps the two in step.
"""

ENVIRONMENT = """## Environment variables

| variable | default | what it does |
| --- | --- | --- |
| `MMFUSION_CACHE` | `~/.cache/mmfusion` | where converted GGUF weights, shared weight files and compiled artifacts are kept |
| `TORCHINDUCTOR_CACHE_DIR` | `$MMFUSION_CACHE/inductor-<CPU level>` | inductor's own kernel cache and its precompiled C++ headers (set it to keep them elsewhere; nothing goes to /tmp) |
| `MMFUSION_KERNEL_CACHE` | `workers/engine/cpu/kernels/build` (else `$MMFUSION_CACHE/kernels` where that is read-only) | the C++ kernels built for this CPU by `make install` or at the first load (set it to keep them elsewhere) |
| `MMFUSION_API_KEYS` | unset | comma-separated API keys the HTTP gateway accepts, besides `--api-key` and `api_keys` |
| `HF_HUB_OFFLINE` | `1` under `make` | nothing ever reaches a model hub; models load from local files and PyPI packages |
"""


def _default(key: Key) -> str:
    if key.default is REQUIRED:
        return "required"
    return f"`{json.dumps(key.default)}`"


def _table(title: str, intro: str, keys: tuple[Key, ...]) -> str:
    rows = [f"| `{k.name}` | {_default(k)} | {k.valid} | {k.doc} |" for k in keys]
    return "\n".join([f"## {title}", "", intro, "", "| key | default | valid values | what it does |",
                      "| --- | --- | --- | --- |", *rows, ""])


def render() -> str:
    parts = [
        INTRO,
        _table("Model keys", "Under `variants.<name>.model`. The sampling keys are defaults for the requests "
               "of that variant that leave them out.", MODEL_KEYS),
        _table("Input keys", "Under `variants.<name>.inference_input`: the variant's data for predict and eval.",
               INPUT_KEYS),
        _table("Runconfig keys", "Under `runconfig`.", RUNCONFIG_KEYS),
        ENVIRONMENT,
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print (or --write) docs/configuration.md from the code's key tables.")
    ap.add_argument("--write", action="store_true", help=f"write {PAGE}")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
