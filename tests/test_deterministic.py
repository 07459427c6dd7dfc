"""`deterministic: true`: a greedy answer's tokens and log-probabilities are the same bit for bit
whatever the engine computes beside it (workers.engine.cpu.invariant, the runners' token rows,
the sampler row by row): alone, sent with 31 other requests, after another request cached its
prefix, and with another `max_batch_tokens` (other chunks). In-process engines of tiny models in
each dtype and weight kind, then one deployment of real worker processes through the client."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from support.cluster import loaded_deployment
from support.models import tiny

from fusion.local import LocalDeployment
from routing.client import Client
from workers.engine import Engine, EngineConfig
from workers.engine.cpu.invariant import TILE_ROWS, in_tiles, invariant_rows
from workers.engine.cpu.linears import Linear
from workers.engine.params import SamplingParams
from workers.engine.sampler import SampleSpec, sample

PREFIX, TAIL, NEW = 300, 12, 24


def _prompts(vocab: int) -> tuple[list[int], list[int], list[list[int]]]:
    rng = random.Random(7)
    prefix = [rng.randrange(3, vocab) for _ in range(PREFIX)]
    prompt = prefix + [rng.randrange(3, vocab) for _ in range(TAIL)]
    others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 150))] for _ in range(31)]
    return prefix, prompt, others


def _cases(lm, deterministic: bool, **config) -> dict[str, tuple[list[int], list[float]]]:
    """The prompt's greedy answer (tokens, logprobs) in each case, on fresh engines."""
    prefix, prompt, others = _prompts(lm.vocab_size)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)

    def engine(tokens: int = 64) -> Engine:
        return Engine(lm, EngineConfig(max_batch_size=32, max_batch_tokens=tokens, deterministic=deterministic,
                                       **config))

    def answer(eng: Engine, prompts: list[list[int]]) -> tuple[list[int], list[float]]:
        out = eng.generate(prompts, [params] * len(prompts))[0].outputs[0]
        return out.token_ids, out.logprobs

    cached = engine()
    answer(cached, [prefix + [5, 6, 7]])
    return {"alone": answer(engine(), [prompt]), "with 31 others": answer(engine(), [prompt, *others]),
            "after its prefix was cached": answer(cached, [prompt]),
            "max_batch_tokens 32": answer(engine(32), [prompt])}


@pytest.mark.parametrize("arch,dtype,quantization", [
    ("llama", "bfloat16", "none"), ("llama", "float32", "none"), ("gemma3", "float32", "none"),
    ("mistral", "float32", "none"), ("llama", "bfloat16", "int4"), ("llama", "float32", "int8")])
def test_an_answer_is_the_same_bit_for_bit_whatever_is_computed_beside_it(arch, dtype, quantization):
    lm = tiny(arch, dtype=dtype)
    cases = _cases(lm, True, quantization=quantization)
    alone = cases.pop("alone")
    assert len(alone[0]) == NEW and all(lp is not None for lp in alone[1])
    for name, got in cases.items():
        assert got == alone, f"{arch} {dtype} {quantization}: {name}"


def test_every_linear_takes_one_path_for_any_rows_and_every_token_attends_as_a_decode_row():
    from workers.capability import cpu_capability

    lm = tiny("llama", dtype="bfloat16")
    eng = Engine(lm, EngineConfig(max_batch_size=8, max_batch_tokens=64, deterministic=True))
    assert set(eng.runner.lean.invariant_rows) == {eng.precision.linears} and eng.runner.batch_invariant
    # the C++ strips take any number of rows where they are built (AVX2 and above), over the dense
    # weights instead of the packed copy; elsewhere tiles of rows
    if cpu_capability().at_least("avx2"):
        assert set(eng.runner.lean.invariant_rows.values()) == {0}
        assert all(lin.dense is not None and lin.packed is None and lin.fp16 is None and lin.rows_per_call == 0
                   for lin in eng.runner.lean.linears())
    else:
        assert set(eng.runner.lean.invariant_rows.values()) <= {1, TILE_ROWS}
    quantized = Engine(lm, EngineConfig(max_batch_size=8, max_batch_tokens=64, deterministic=True, quantization="int4"))
    assert set(quantized.runner.lean.invariant_rows) == {"int4", "int8"}  # the LM head stays int8
    if cpu_capability().at_least("avx2"):
        assert set(quantized.runner.lean.invariant_rows.values()) == {0}
        assert all(lin.strips and lin.rows_per_call == 0 for lin in quantized.runner.lean.linears())
    default = Engine(lm, EngineConfig(max_batch_size=8, max_batch_tokens=64))
    assert default.runner.lean.invariant_rows == {} and all(lin.rows_per_call == 0 and lin.dense is None and not lin.strips
                                                for lin in default.runner.lean.linears())
    assert not default.runner.batch_invariant


def test_tiles_keep_rows_apart_and_the_check_finds_kernels_that_do_not():
    gen = torch.Generator().manual_seed(0)
    lin = Linear(torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen), "onednn")
    x = torch.randn(37, 64, generator=gen)
    calls = []

    def counted(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.shape[0])
        return lin.multiply(t)

    y = in_tiles(counted, x, 16)
    assert calls == [16, 16, 16] and y.shape == (37, 48)
    assert torch.allclose(y, lin.multiply(x), atol=1e-5)
    assert in_tiles(counted, x[:0], 16).shape == (0, 48)
    assert invariant_rows(lin.multiply, 64, torch.float32) == 16
    assert invariant_rows(lambda t: t - t.mean(0), 64, torch.float32) == 1  # rows mixed: one row a call
    assert invariant_rows(lambda t: t * torch.arange(1, t.shape[0] + 1)[:, None], 64, torch.float32) == 1  # by place


@pytest.mark.parametrize("weights,activations", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                                  (torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
def test_the_dense_strips_compute_the_product_in_one_order_for_any_rows(weights, activations):
    """The C++ strips over a dense weight: the product within the compute dtype's rounding, and
    each row bit for bit the same for 1 to 37 rows (where they are built: AVX2 and above)."""
    from workers.capability import cpu_capability
    from workers.engine.cpu import extension

    kernels = extension.kernel_module()
    assert kernels.dense_strips_built() == cpu_capability().at_least("avx2")
    if not kernels.dense_strips_built():
        with pytest.raises(RuntimeError, match="not built"):
            kernels.dense_strips(torch.zeros(1, 32), torch.zeros(16, 32), None)
        return
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(80, 96, generator=gen) * 0.1).to(weights)
    b = torch.randn(80, generator=gen)
    x = torch.randn(37, 96, generator=gen).to(activations)
    y = kernels.dense_strips(x, w, b)
    assert y.dtype == activations and y.shape == (37, 80)
    want = x.float() @ w.float().t() + b
    tol = 0.02 if activations == torch.bfloat16 else 1e-4
    assert torch.allclose(y.float(), want, atol=tol, rtol=tol)
    for m in (1, 2, 5, 16, 24, 36):
        assert torch.equal(kernels.dense_strips(x[:m], w, b), y[:m])
        assert torch.equal(kernels.dense_strips(x[:m].flip(0), w, b), y[:m].flip(0))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.dense_strips(x, w[:72], b[:72])


def test_the_sampler_row_by_row_gives_each_row_what_it_gets_alone():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 49152, generator=gen) * 4
    specs = [SampleSpec(row=i, temperature=0.0 if i % 2 else 0.8, top_k=0, top_p=1.0, seed=i, sample_index=0,
                        token_index=i, num_top=3) for i in range(6)]
    tokens, chosen, tops = sample(logits, specs, row_by_row=True)
    for i, s in enumerate(specs):
        t, c, top = sample(logits[i:i + 1], [replace(s, row=0)])
        assert (tokens[i], chosen[i], tops[i]) == (t[0], c[0], top[0])


@pytest.mark.parametrize("source,config,why", [
    ("tiny:llama", {"prepack_weights": False}, "prepack_weights is false"),
    ("tiny:gpt2", {}, "GPT2LMHeadModel has no lean forward"),
])
def test_a_copy_that_cannot_hold_it_says_so_at_load(source, config, why):
    from workers.models import load_model

    lm = load_model(source, dtype="float32")
    with pytest.raises(ValueError, match=why):
        Engine(lm, EngineConfig(deterministic=True, **config))


def _deployment(max_batch_tokens: int, deterministic: bool = True) -> LocalDeployment:
    # bfloat16 activations on int4 weights: without the key, the prompt's log-probabilities with 31
    # others differ from its own (in-process, the case above with deterministic off)
    params = {"variants": {"m": {"model": {"source": "tiny:llama", "dtype": "bfloat16", "quantization": "int4",
                                           "deterministic": deterministic,
                                           "max_batch_size": 32, "max_batch_tokens": max_batch_tokens}}},
              "runconfig": {}, "_path": "test"}
    return loaded_deployment(params, ["m,1"], threads_per_worker=2)


def test_through_serve_the_four_cases_agree():
    """Real worker processes: the prompt alone, then at once with 31 others from as many client
    threads, then again once its prefix is cached; then a deployment with other chunks."""
    prefix, prompt, others = _prompts(250)
    req = {"max_tokens": NEW, "temperature": 0.0, "ignore_eos": True, "logprobs": 0, "return_token_ids": True}

    def ask(front: str, p: list[int]) -> tuple[list[int], list[float]]:
        with Client(front, timeout=120) as c:
            choice = c.complete("m", p, **req)["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    d = _deployment(64)
    try:
        alone = ask(d.frontend, prompt)
        with ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(ask, d.frontend, p) for p in [prompt, *others]]
            batched = futures[0].result()
            assert all(len(f.result()[0]) == NEW for f in futures)
        ask(d.frontend, prefix + [9, 9, 9])
        cached = ask(d.frontend, prompt)
    finally:
        d.__exit__(None, None, None)
    d = _deployment(32)
    try:
        chunked = ask(d.frontend, prompt)
    finally:
        d.__exit__(None, None, None)
    assert len(alone[0]) == NEW
    assert batched == alone and cached == alone and chunked == alone
