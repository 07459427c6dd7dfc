"""Every key of a variant's `model` section in the params YAML: its default and its valid values.

This table is where those defaults are defined; the planner, the deployment, predict, compile_only,
the worker, the scheduler and the engine read them from here, and docs/configuration.md is generated from it
(`python -m fusion.config_doc`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workers.quant.formats import FORMATS
from workers.validate import is_int, is_number

# `quantization`'s values: auto, none, and each format's name (workers.quant.formats)
QUANTIZATIONS = ("auto", "none", *FORMATS)

REQUIRED = object()  # the default of a key that must be given
# `prepack_weights`: the transformers classes the lean forward (workers.engine.cpu.lean) runs
LEAN_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM")
# of those, the ones whose lean forward computes only in float32 (workers.engine.cpu.lean)
FLOAT32_LEAN = ("Gemma3ForCausalLM",)
# `kv_cache_memory: auto`: the share of a device's available memory that its workers' KV caches
# take, less the weights and process overheads planned there (an engine without a plan: its own)
KV_AUTO_SHARE = 0.5
DEFAULT_MAX_TOKENS = 16  # new tokens of a request that gives no max_tokens (OpenAI's default)


def _tokens(x) -> bool:
    """A token ID or a non-empty list of them; an ID outside the vocabulary (even negative) is a marker."""
    return is_int(x) or (isinstance(x, (list, tuple)) and bool(x) and all(is_int(t) for t in x))


def _resources(x) -> bool:
    return x is None or (isinstance(x, dict) and all(isinstance(k, str) and is_number(v) and v > 0
                                                      for k, v in x.items()))


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(x) -> int | None:
    """Bytes from an integer or a string such as `2GiB`, `512 MiB`, `1.5GB`; None when it is not one."""
    if is_int(x):
        return x if x > 0 else None
    if not isinstance(x, str):
        return None
    s = x.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        n = float(num)
    except ValueError:
        return None
    if unit not in _UNITS or n <= 0:
        return None
    return int(n * _UNITS[unit])


@dataclass(slots=True, frozen=True)
class Key:
    """One configuration key: its name, default (REQUIRED when it must be given), valid values and meaning."""

    name: str
    default: Any
    valid: str
    doc: str
    check: Callable[[Any], bool] | None = None  # whether a given value is valid; None: checked where used

    def __post_init__(self) -> None:
        if not self.name or not self.valid or not self.doc:
            raise ValueError(f"configuration key {self.name!r}: give a name, its valid values and what it does")


MODEL_KEYS: tuple[Key, ...] = (
    Key("source", REQUIRED, "`smollm2-135m`, `gemma3-270m`, `tiny:<arch>[:seed]`, a Hugging Face directory, "
        "or a `.gguf` file", "what to load (see Model sources in the README)"),
    Key("dtype", "auto", "`auto`, `float32`, `bfloat16`, `float16`, `float64`",
        "the serving dtype. `auto`: bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX; on other CPUs (AVX2, "
        "AVX-512 without bf16) float16 weights with float32 math, activations and KV cache for the lean forward "
        "(Llama family and Gemma 3, `prepack_weights`), float32 for other models. Gemma 3's lean forward computes "
        "only in float32, so on every CPU its `auto` is float16 weights with float32 math (float32 where FBGEMM "
        "has no fp16 linear). `bfloat16`/`float16` on a CPU without "
        "bf16 arithmetic: 16-bit weights, float32 math in the lean forward; other models compute in the "
        "16-bit dtype (see docs/cpus.md)",
        lambda x: x in ("auto", "float32", "bfloat16", "float16", "float64")),
    Key("max_model_len", None, "a positive integer, or null",
        "the longest sequence (prompt + generated) served; null: the model's own context length. Above the "
        "model's own, the load is refused",
        lambda x: x is None or is_int(x, 1)),
    Key("max_batch_size", 64, "a positive integer",
        "sequences a worker runs at once (before `deltat_scaling_factor` shares a device's capacity)",
        lambda x: is_int(x, 1)),
    Key("max_batch_tokens", 512, "a positive integer",
        "tokens a worker's step computes at most (decode tokens plus prefill chunks); at least `max_batch_size`",
        lambda x: is_int(x, 1)),
    Key("long_prefill_tokens", 16, "a positive integer",
        "while sequences decode, a prompt longer than `max_batch_tokens` computes a chunk costing about this many "
        "tokens a step, or half as many as sequences decode (a token deep in the prompt counts more: its attention "
        "grows with its position), and fewer when the steps' measured times show it slowing the streams by more "
        "than 60%: a long prompt does not stall the streams beside it",
        lambda x: is_int(x, 1)),
    Key("kv_cache_memory", None, "a size (`2GiB`, `512MiB`, a number of bytes), `auto`, or null",
        "the KV cache pool of each worker of this model, allocated once at load; null: the runconfig's "
        "`kv_cache_memory`", lambda x: x is None or x == "auto" or parse_size(x) is not None),
    Key("kv_block_size", 16, "a positive integer", "positions per KV cache block (the unit of paging and "
        "of prefix caching)", lambda x: is_int(x, 1)),
    Key("deltat_scaling_factor", 1.0, "a positive number",
        "this model's relative share of batch capacity among the workers of one device", lambda x: is_number(x) and x > 0),
    Key("share_weights", True, "`true`, `false`",
        "copies of this model on one device hold one set of weights (CPU: one read-only mapping; "
        "CUDA: one owner process)", lambda x: isinstance(x, bool)),
    Key("prepack_weights", True, "`true`, `false`",
        "CPU, Llama family (SmolLM2, Llama, Mistral, Qwen 2) and Gemma 3 (where it computes in float32): run the lean forward, with each linear "
        "weight fused and prepacked once at load, for oneDNN or, for 16-bit weights with float32 math, FBGEMM "
        "(decoding about 1.5x faster); each worker then holds its own packed copy of the linear weights, "
        "which `share_weights` cannot share. It is preferred to `compile`, which then applies only with "
        "`false`: transformers' modules on the (shared) weights. On CUDA, the Llama family and Gemma 3 run the "
        "device's lean forward in the weights' dtype, q/k/v and gate/up each one linear over the weights laid out "
        "side by side (no copy: the weight owner lays them out so), each decode step one CUDA graph; every layer's "
        "keys and values in one cache group for the whole context (Gemma 3's sliding layers attend their window in "
        "it, and hold the positions before it too)", lambda x: isinstance(x, bool)),
    Key("quantization", "auto", "`auto`, `none`, `int8`, `int4`",
        "CPU, the lean forward: its linears read weight-only quantized blocks of 32 values of a row, "
        "the activations, the KV cache and the norms staying in the compute dtype. A GGUF file's Q4_0, "
        "Q4_1, Q5_0 and Q8_0 tensors are kept as they are (the file's own values, as transformers "
        "dequantizes them), its Q4_K tensors as int4 with their block scales rounded to float16 "
        "(within 2^-11 of the file's values), its Q5_K and Q6_K tensors as int8 quantized afresh from the "
        "file's values; other weights are quantized afresh to the kind named (int8 as Q8_0, int4 as "
        "Q4_1 with the attention's q/k/v and the MLP's down projection in int8, as llama.cpp's Q4_K_M "
        "gives values and down more bits; the LM head stays int8). Copies that share their weights map one file of them; "
        "a worker with weights of its own lets the 16-bit weights of its blocks go once they are built. `auto`: "
        "a GGUF file keeps its class where the lean forward runs it: the linears whose tensors are "
        "Q4_0, Q4_1, Q4_K (int4), Q5_0, Q8_0, Q5_K or Q6_K (int8) run quantized as above, the rest "
        "(16-bit, Q2_K, Q3_K) as loaded; any other source is `none`. SmolLM2's Q4_1 file: one stream about 2.5x "
        "faster than bfloat16, 0.36x its linears' bytes, a batched workload about 1.02-1.05x bfloat16's "
        "(docs/benchmarks.md). Which kernel a step's linears take is measured per row count at load "
        "(docs/cpus.md); on a CPU with AMX tiles the batches take the tiles on the values packed once in "
        "bfloat16, a second file the copies map (one stream about 2x faster than `none` there, the "
        "workload level with it); on one computing in bfloat16 without them, ATen's float32 GEMM on the "
        "values widened once to float32, a second file too (the workload about 1.3x `none` on an Intel "
        "core capped to AVX512-BF16). CUDA: `int8` and `int4` on the device's lean forward (the Llama family) "
        "through Triton kernels, slower than bfloat16 there so far (an H200: one stream int4 4.5 against "
        "1.3 ms/token, docs/operations.md); the 16-bit weights of the linears the blocks serve are let go (copies "
        "that share their weights attach to an owner holding the blocks once), and `auto` is `none` there",
        lambda x: x in QUANTIZATIONS),
    Key("deterministic", False, "`true`, `false`",
        "batch-invariant computation: a request's logits, so its greedy tokens and log-probabilities, "
        "are the same bit for bit whatever else the engine computes with it (the other requests of a "
        "step, where its prompt's chunks start, whether its prefix came from the prefix cache), in "
        "every dtype. Every linear takes one path for every number of rows (the C++ kernels' strips; tiles "
        "of 16 rows below AVX2); every token's attention runs the decode kernel's one order over its context; "
        "the sampler reduces each row on its own. CPU with the lean forward (`prepack_weights`, "
        "Llama family, or Gemma 3 in float32); CUDA with the device's lean forward (Llama family and Gemma 3: "
        "batch-invariant Triton kernels; an H200: one stream 1.20x the time); it costs throughput (docs/serving.md, "
        "\"Reproducibility\")",
        lambda x: isinstance(x, bool)),
    Key("compile", "auto", "`auto`, `true`, `false`",
        "run the compiled forward of transformers' modules: `auto` when compiled artifacts are in the cache, "
        "`true` compiling now if needed, `false` eager. Where the lean forward runs (`prepack_weights`, Llama "
        "family or Gemma 3, CPU) it is kept: eager, it is about twice as fast as the compiled modules; on CUDA "
        "the Llama family's and Gemma 3's decode steps run as captured CUDA graphs instead"),
    Key("compile_buckets", None, "a strictly increasing list of positive token counts, or null",
        "the padded step sizes graphs are built for; null: powers of two up to 64, then multiples of 64 "
        "up to `max_batch_tokens`"),
    Key("pin", False, "`true`, `false`",
        "its copies are never evicted to make room for another model's load (an explicit unload still "
        "unloads them)", lambda x: isinstance(x, bool)),
    Key("resources", None, "a mapping of Ray resource names to positive amounts, or null",
        "custom Ray resources each copy asks for (with `--ray`), so that it runs only on nodes that have them",
        _resources),
    Key("start_token", None, "a token ID or a list of them (the first pads)",
        "HDF5 input: where each row's prompt ends and generation starts; required for HDF5 input",
        lambda x: x is None or _tokens(x)),
    Key("end_token", None, "a token ID or a list of them, or null",
        "HDF5 input: generation stops after emitting one (kept in the output); IDs past the vocabulary "
        "disable it", lambda x: x is None or _tokens(x)),
    Key("loop_dim", 1, "`0`, `1`", "HDF5 input: 1 reads `data` as (samples, seq), 0 as (seq, samples)",
        lambda x: is_int(x) and x in (0, 1)),
    Key("max_tokens", None, "a non-negative integer, or null",
        f"new tokens at most: the default of requests that give none (else {DEFAULT_MAX_TOKENS}, as OpenAI); HDF5 "
        "rows: null "
        "fills the row", lambda x: x is None or is_int(x, 0)),
    Key("temperature", None, "a number >= 0, or null",
        "the default of requests that give none (else 1.0); HDF5 rows: null is greedy (0)",
        lambda x: x is None or (is_number(x) and x >= 0)),
    Key("top_p", None, "a number in (0, 1], or null", "the default of requests that give none (else 1.0: off)",
        lambda x: x is None or (is_number(x) and 0 < x <= 1)),
    Key("top_k", None, "an integer >= 0 (0 or -1: off), or null", "the default of requests that give none (else 0: off)",
        lambda x: x is None or is_int(x, -1)),
)
MODEL = {k.name: k for k in MODEL_KEYS}
# the model keys that are request defaults: the worker applies them to requests that leave them out
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "max_tokens")
