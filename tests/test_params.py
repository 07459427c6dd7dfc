"""Bad parameters raise ValueError (a ParamError) naming the parameter, in the message and as a
field; nothing is queued."""

from __future__ import annotations

import pytest
from support.models import tiny

from workers.engine import Engine, EngineConfig
from workers.engine.params import SamplingParams
from workers.engine.scheduler import SchedulerConfig
from workers.request_params import sampling_params
from workers.validate import ParamError


@pytest.mark.parametrize("kwargs,name", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(n=0), "n"),
    (dict(n=3, best_of=2), "best_of"),
    (dict(seed=-5), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop=[f"s{i}" for i in range(65)]), "stop"),  # each is searched for in every piece of text
    (dict(logprobs=-1), "logprobs"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(ignore_eos=1), "ignore_eos"),
    # JSON's parsers take Infinity and 1e400, YAML .inf: none is a temperature or a penalty
    (dict(temperature=float("inf")), "temperature"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={"5": float("-inf")}), "logit_bias"),
])
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(ParamError, match=name) as info:
        SamplingParams(**kwargs)
    assert info.value.param == name


@pytest.mark.parametrize("params,name", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"suffix": "x"}, "suffix"),
    ({"logprobs": 21}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"return_token_ids": "x"}, "return_token_ids"),
    ({"user": 5}, "user"),
    ({"n": 1025}, "n"),  # a stream's chunk header counts each sample's tokens
    ({"n": 2, "best_of": 2000}, "best_of"),
])
def test_request_parameters_are_refused_by_name(params, name):
    with pytest.raises(ParamError) as info:
        sampling_params(params)
    assert info.value.param == name and name in str(info.value)


def test_null_is_not_given_so_the_deployments_default_holds():
    defaults = {"temperature": 0.0, "max_tokens": 7}
    sp, _ = sampling_params({"temperature": None, "max_tokens": None, "seed": None, "stop": None}, defaults)
    assert (sp.temperature, sp.max_tokens, sp.seed, sp.stop) == (0.0, 7, None, [])
    sp, _ = sampling_params({"temperature": 0.5}, defaults)
    assert (sp.temperature, sp.max_tokens) == (0.5, 7)
    with pytest.raises(ParamError) as info:  # an unknown key stays unknown, null or not
        sampling_params({"frobnicate": None}, defaults)
    assert info.value.param == "frobnicate"


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny("llama"), EngineConfig(max_batch_size=4, max_batch_tokens=32))


@pytest.mark.parametrize("prompt,match", [
    ([], "empty"),
    ("", "empty"),
    ([1, 2, 10_000], "10000.*position 2.*vocabulary"),
    ([1, -3], "-3.*vocabulary"),
    (list(range(1, 200)) * 3, "597 tokens.*context"),
    (12, "prompt must be"),
])
def test_bad_prompts(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", prompt, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()


def test_duplicate_request_id(engine):
    engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    engine.abort("dup")


@pytest.mark.parametrize("kwargs,name", [
    (dict(max_batch_size=0), "max_batch_size"),
    (dict(max_batch_tokens=4, max_batch_size=8), "max_batch_tokens"),
])
def test_bad_scheduler_config(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize("kwargs,name", [
    (dict(kv_cache_memory=0), "kv_cache_memory"), (dict(kv_cache_memory="2GiB"), "kv_cache_memory"),
    (dict(kv_block_size=0), "kv_block_size"),
])
def test_bad_kv_cache_config(kwargs, name):
    from workers.engine import EngineConfig

    with pytest.raises(ValueError, match=name):
        EngineConfig(**kwargs)
