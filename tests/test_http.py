"""The OpenAI-compatible HTTP gateway against a running deployment (router thread, worker
processes, tiny models), with the `openai` package, httpx and prometheus_client's parser as clients."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import subprocess
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from support.cluster import ROOT, TINY, Deployment, engine_reference, free_port, one_worker, wait_for
from support.cluster import TINY_CONFIG as CONFIG
from support.models import plain_logits, tiny

from routing.client import AsyncClient, Client, RouterError
from routing.entrypoints import CLI, GATEWAY, command
from routing.http import openai as O
from routing.http.app import GatewaySettings
from routing.http.server import GatewayError, GatewayThread, api_keys, check_listen, parse_listen
from routing.router import ModelEntry, Router, RouterConfig
from routing.tenants import parse_tenants, tenant_keys
from wire import protocol as P
from workers.tasks import chat_prompt, end_of_turn_ids

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def dep():
    d = Deployment(["llama,1", "gpt2,1"], num_workers=2)
    yield d
    d.close()


@pytest.fixture(scope="module")
def gw(dep):
    g = GatewayThread(GatewaySettings(router=dep.frontend, max_body_bytes=64 * 1024), "127.0.0.1", 0).start()
    yield g
    g.stop()


@pytest.fixture()
def oai(gw):
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_variants_and_copies(oai):
    ids = [m.id for m in oai.models.list().data]
    assert ids == ["llama", "gpt2", "llama:0", "gpt2:1"]
    assert oai.models.retrieve("gpt2:1").id == "gpt2:1"


def test_completion_equals_the_engine_and_every_prompt_form_is_indexed(oai):
    r = oai.completions.create(model="llama", prompt="Hello there", max_tokens=6, **GREEDY)
    lm = tiny("llama", "float32")
    want = engine_reference("llama", "Hello there", max_tokens=6, **GREEDY)
    assert r.choices[0].text == lm.tokenizer.decode(want, skip_special_tokens=True)
    assert r.usage.completion_tokens == 6 and r.object == "text_completion" and r.model == "llama"
    prompts = [[5, 6, 7], [8, 9]]
    many = oai.completions.create(model="llama:0", prompt=prompts, max_tokens=3, n=2, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]  # prompt x n + sample
    for c in many.choices:
        ids = engine_reference("llama", prompts[c.index // 2], max_tokens=3, **GREEDY)
        assert c.text == lm.tokenizer.decode(ids, skip_special_tokens=True)
    texts = oai.completions.create(model="gpt2", prompt=["a", "b", "c"], max_tokens=2, **GREEDY)
    assert [c.index for c in texts.choices] == [0, 1, 2] and texts.usage.completion_tokens == 6


def test_lm_eval_style_scoring_carries_every_prompt_position(oai):
    prompt = [11, 22, 33, 44, 55]
    r = oai.completions.create(model="llama", prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None
    logp = torch.log_softmax(plain_logits(tiny("llama", "float32").model, prompt), -1)
    want = [logp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    assert lp.token_logprobs[1:len(prompt)] == pytest.approx(want, abs=1e-4)
    assert len(lp.top_logprobs) == len(prompt) + 1


def test_stream_deltas_add_up_to_the_completion_and_usage_comes_last(oai):
    kw = dict(model="llama", prompt=[3, 1, 4, 1, 5], max_tokens=20, **GREEDY)
    whole = oai.completions.create(**kw)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.model_extra["timing"]["run_s"] > 0  # the router's timing, as in a whole answer


def test_each_answer_says_how_long_it_queued_waited_for_a_load_and_ran(gw, dep):
    with httpx.Client(base_url=gw.url, timeout=60) as h:
        r = h.post("/v1/completions", json={"model": "gpt2", "prompt": ["a", "b"], "max_tokens": 4, **GREEDY})
        timing = r.json()["usage"]["timing"]
        assert set(timing) == {"queued_s", "load_s", "run_s"} and timing["run_s"] > 0 and timing["load_s"] == 0
        assert float(r.headers["x-mmfusion-run-time"]) == pytest.approx(timing["run_s"], abs=1e-6)
        assert float(r.headers["x-mmfusion-queue-time"]) == pytest.approx(timing["queued_s"], abs=1e-6)
        chat = h.post("/v1/chat/completions", json={"model": "llama", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2})
        assert chat.status_code == 200 and float(chat.headers["x-mmfusion-run-time"]) > 0
    with Client(dep.frontend, timeout=60) as c:
        assert c.complete("gpt2", "x", max_tokens=2)["usage"]["timing"]["run_s"] > 0


def test_a_chat_template_that_refuses_the_messages_is_the_requests_error():
    """A template's own check (Mistral's and Gemma's refuse roles out of turn) raised jinja2's
    TemplateError, which the worker answered as an internal error (500); it is a bad request."""
    import copy

    tok = copy.deepcopy(tiny("llama", "float32").tokenizer)  # the cached model's stays as it is
    tok.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start "
                         "with a user message') }}{% endif %}{{ messages[0]['content'] }}")
    with pytest.raises(ValueError, match="'llama''s chat template refuses these messages: Conversation must start"):
        chat_prompt(tok, [{"role": "assistant", "content": "x"}], "llama")
    assert chat_prompt(tok, [{"role": "user", "content": "x"}], "llama")


def test_streamed_logprobs_add_up_to_the_completions(oai):
    """logprobs in a stream: each chunk carries its tokens' log-probabilities, and together they are
    the answer's without a stream (completions: tokens, values, top alternatives and text offsets;
    chat: its content entries)."""
    kw = dict(model="llama", prompt=[5, 17, 33], max_tokens=10, logprobs=2, **GREEDY)
    whole = oai.completions.create(**kw).choices[0].logprobs
    tokens, values, tops, offsets = [], [], [], []
    for chunk in oai.completions.create(stream=True, **kw):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            values += lp.token_logprobs
            tops += lp.top_logprobs
            offsets += lp.text_offset
    assert tokens == whole.tokens and offsets == whole.text_offset and len(tokens) == 10
    assert values == pytest.approx(whole.token_logprobs, abs=1e-6)
    assert [sorted(t) for t in tops] == [sorted(t) for t in whole.top_logprobs]
    msgs = [{"role": "user", "content": "hi"}]
    ckw = dict(model="llama", messages=msgs, max_tokens=8, logprobs=True, top_logprobs=2, **GREEDY)
    want = oai.chat.completions.create(**ckw).choices[0].logprobs.content
    got = [e for chunk in oai.chat.completions.create(stream=True, **ckw)
           for e in (chunk.choices[0].logprobs.content if chunk.choices and chunk.choices[0].logprobs else [])]
    assert [e.token for e in got] == [e.token for e in want] and len(got) == len(want) > 0
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-6)
    assert [[t.token for t in e.top_logprobs] for e in got] == [[t.token for t in e.top_logprobs] for e in want]


def test_chat_renders_the_template_and_streams_role_then_content(oai):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = oai.chat.completions.create(model="llama", messages=msgs, max_tokens=8, **GREEDY)
    lm = tiny("llama", "float32")
    ids = chat_prompt(lm.tokenizer, msgs, "llama")
    want = engine_reference("llama", ids, max_tokens=8, stop_token_ids=end_of_turn_ids(lm.tokenizer), **GREEDY)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == lm.tokenizer.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(oai.chat.completions.create(model="llama", messages=msgs, max_tokens=8, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    lp = oai.chat.completions.create(model="llama", messages=msgs, max_completion_tokens=3, logprobs=True,
                                     top_logprobs=2, **GREEDY)
    content = lp.choices[0].logprobs.content
    # (two byte tokens may decode to the same text, and the completions format keys alternatives by text)
    assert len(content) == 3 and all(1 <= len(t.top_logprobs) <= 2 and t.logprob <= 0 for t in content)
    assert [t.token for t in content] == [lm.tokenizer.decode([i]) for i in want[:3]]
    # structured outputs and tools at their no-op values, as SDKs send them, answer as without them
    same = oai.chat.completions.create(model="llama", messages=msgs, max_tokens=8, response_format={"type": "text"},
                                       tools=[], tool_choice="none", parallel_tool_calls=False, **GREEDY)
    assert same.choices[0].message.content == r.choices[0].message.content
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for kw, name in (({"response_format": {"type": "json_object"}}, "response_format"), ({"tools": [tool]}, "tools"),
                     ({"tool_choice": "auto"}, "tool_choice")):
        with pytest.raises(openai.BadRequestError, match="not supported by this server") as info:
            oai.chat.completions.create(model="llama", messages=msgs, max_tokens=2, **kw)
        assert info.value.body["param"] == name
    # content as text parts, as newer SDKs send it; other parts and bad messages are the messages' fault
    parts = [msgs[0], {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    assert oai.chat.completions.create(model="llama", messages=parts, max_tokens=8, **GREEDY).choices[0].message.content \
        == r.choices[0].message.content
    image = {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}
    for bad in ([{"role": "user", "content": [image]}], [{"role": "user", "content": 5}], [{"content": "x"}]):
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model="llama", messages=bad, max_tokens=2)
        assert info.value.body["param"] == "messages", info.value.body
    # echo is completions': in a chat it would put the whole rendered template before the reply
    with pytest.raises(openai.BadRequestError, match="echo is a completions parameter") as info:
        oai.chat.completions.create(model="llama", messages=msgs, max_tokens=2, extra_body={"echo": True})
    assert info.value.body["param"] == "echo"
    assert oai.chat.completions.create(model="llama", messages=msgs, max_tokens=8, extra_body={"echo": False},
                                       **GREEDY).choices[0].message.content == r.choices[0].message.content


def test_async_client(gw):
    async def go():
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        a, b = await asyncio.gather(
            client.completions.create(model="gpt2", prompt=[1, 2, 3], max_tokens=4, **GREEDY),
            client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}], max_tokens=2))
        await client.close()
        return a, b

    a, b = asyncio.run(go())
    assert a.usage.completion_tokens == 4 and b.choices[0].message.role == "assistant"


def test_errors_are_openai_error_objects(oai, gw):
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="gpt-4", prompt="x")
    assert "llama:0" in info.value.message and info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="llama", prompt="x", temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="llama", prompt="x", max_tokens=2, extra_body={"frobnicate": 1})
    assert info.value.body["param"] == "frobnicate"
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        oai.chat.completions.create(model="gpt2", messages=[{"role": "user", "content": "x"}])
    for extra, name in (({"user": 5}, "user"), ({"ignore_eos": "yes"}, "ignore_eos"),  # OpenAI's, an extension
                        ({"tenant": "x"}, "tenant"), ({"task": "x"}, "task")):  # the client's own arguments
        for create in (lambda **kw: oai.completions.create(prompt="x", **kw),
                       lambda **kw: oai.chat.completions.create(messages=[{"role": "user", "content": "x"}], **kw)):
            with pytest.raises(openai.BadRequestError) as info:
                create(model="llama", max_tokens=2, extra_body=extra)
            assert info.value.body["param"] == name, info.value.body
    with pytest.raises(openai.BadRequestError) as info:  # a chat's prompt is its messages, not a parameter
        oai.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                    extra_body={"prompt": "x"})
    assert info.value.body["param"] == "prompt" and info.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="suffix is not supported"):
        oai.completions.create(model="llama", prompt="x", suffix="y")
    # OpenAI's penalties and biases and vLLM's repetition_penalty and min_tokens are taken
    got = oai.completions.create(model="llama", prompt="x", max_tokens=3, presence_penalty=0.5, frequency_penalty=0.5,
                                 logit_bias={"7": 100}, extra_body={"repetition_penalty": 1.2, "min_tokens": 3})
    assert got.usage.completion_tokens == 3 and got.choices[0].text == tiny("llama", "float32").tokenizer.decode([7] * 3)
    with pytest.raises(openai.BadRequestError, match="prompt") as info:  # refused by the gateway
        oai.completions.create(model="llama", prompt=[])
    with pytest.raises(openai.BadRequestError, match="prompt") as by_worker:  # by the worker: the same code
        oai.completions.create(model="llama", prompt="")
    assert info.value.body["code"] == by_worker.value.body["code"] == "bad_request"
    with pytest.raises(openai.BadRequestError) as info:  # the worker refuses it before the stream starts
        list(oai.completions.create(model="llama", prompt="x", stream=True, top_p=7))
    assert info.value.status_code == 400 and info.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="llama", prompt="x", stream=True, echo=True)
    assert info.value.body["param"] == "echo"
    msgs = [{"role": "user", "content": "x"}]
    for stream in (False, True):  # chat's name for max_tokens: the worker's refusal names it as sent
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model="llama", messages=msgs, max_completion_tokens=10**6, stream=stream)
        assert info.value.body["param"] == "max_completion_tokens", info.value.body
        assert "max_completion_tokens is 1000000" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="llama", messages=msgs, max_completion_tokens=-1)
    assert info.value.body["param"] == "max_completion_tokens" and ">= 0" in info.value.message
    for stream in (False, True):  # JSON has no integer limit; the wire has 64 bits: a 400, not a 500
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model="llama", prompt="x", max_tokens=2, seed=2**70, stream=stream)
        assert info.value.body["param"] == "seed" and "out of range" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:  # a chat's prompt is its messages
        oai.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x", "n": 2**70}])
    assert info.value.body["param"] == "messages" and "out of range" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:  # the older name keeps its own
        oai.chat.completions.create(model="llama", messages=msgs, max_tokens=10**6)
    assert info.value.body["param"] == "max_tokens"
    bad = httpx.post(gw.url + "/v1/completions", content=b"{not json", timeout=10)
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    # JSON's escapes can spell half of a UTF-16 pair, which is no text: a 400 naming where, even where
    # the answer would echo it (an unknown model's name, a key), never a 500
    for path, body, param, where in (
            ("/v1/completions", b'{"model": "llama", "prompt": "x\\ud800", "max_tokens": 2}', "prompt", "prompt"),
            ("/v1/chat/completions", b'{"model": "llama", "messages": [{"role": "user", "content": "\\udc00"}]}',
             "messages", "messages[0].content"),
            ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', "model", "model"),
            ("/v1/completions", b'{"model": "llama", "prompt": "x", "\\ud800": 1}', "\\ud800", "\\ud800"),
            ("/tokenize", b'{"model": "llama", "prompt": "\\ud800"}', "prompt", "prompt")):
        bad = httpx.post(gw.url + path, content=body, headers={"content-type": "application/json"}, timeout=10)
        assert bad.status_code == 400, bad.text
        err = bad.json()["error"]
        assert err["param"] == param and err["message"].startswith(f"malformed JSON body: {where} holds a lone UTF-16"), err
    pair = oai.completions.create(model="llama", prompt="\U0001F600 x", max_tokens=2)  # a whole pair is text
    assert pair.choices[0].finish_reason == "length"
    deep = b'{"model": "llama", "prompt": "x", "stop": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    for path in ("/v1/completions", "/v1/chat/completions"):  # past the parser's depth: a 400, not a 500
        bad = httpx.post(gw.url + path, content=deep, timeout=10)
        assert bad.status_code == 400 and "nested too deeply" in bad.json()["error"]["message"], bad.text
    big = httpx.post(gw.url + "/v1/completions", json={"model": "llama", "prompt": "x" * 70_000}, timeout=10)
    assert big.status_code == 413 and big.json()["error"]["code"] == "too_large"
    # models at run time: a key the endpoint does not take (a misspelt copies would load one copy)
    for path, body, param in (("/v1/models/load", {"model": "llama", "copie": 2}, "copie"),
                              ("/v1/models/unload", {"model": "llama", "pin": True}, "pin"),
                              ("/v1/models/load", {"model": 5}, "model"),
                              ("/v1/models/load", {"model": "llama", "copies": 10**9}, "copies")):
        bad = httpx.post(gw.url + path, json=body, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    assert "takes model, copies, pin" in httpx.post(gw.url + "/v1/models/load", json={"model": "llama", "x": 1},
                                                    timeout=10).json()["error"]["message"]
    # null is the default, as for a completion's parameters: parsed, then refused by this router, which
    # has no supervisor to start workers (tests/test_models_runtime.py loads on one that has)
    later = httpx.post(gw.url + "/v1/models/load", json={"model": "llama", "copies": None, "pin": None}, timeout=10)
    assert later.status_code == 501 and later.json()["error"]["code"] == "not_supported", later.text


def test_unknown_paths_and_methods_are_openai_error_objects(oai, gw):
    with pytest.raises(openai.NotFoundError) as info:  # an endpoint this server does not have
        oai.embeddings.create(model="llama", input="x")
    assert "POST /v1/embeddings: no such endpoint" in info.value.message
    assert "/v1/chat/completions" in info.value.message and info.value.body["code"] == "not_found"
    wrong = httpx.get(gw.url + "/v1/completions", timeout=10)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST", wrong.headers
    assert wrong.json()["error"] == {"message": "GET /v1/completions: this path takes POST",
                                     "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}
    assert httpx.get(gw.url + "/health", timeout=10).status_code == 200  # and it goes on serving


def test_a_request_of_more_prompts_than_a_queue_holds_completes():
    """600 prompts in one request to a router whose model queue holds 64 (and a worker 256): they
    take turns on the router (routing/http/fanout.py) instead of being refused as busy, which no
    retry would cure; streamed or not, every prompt's answer comes back under its index."""
    d = Deployment(["llama,1"], num_workers=1, router={"max_queue": 64})
    g = GatewayThread(GatewaySettings(router=d.frontend), "127.0.0.1", 0).start()
    try:
        oai = openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = [[5 + i % 50, 7] for i in range(600)]
        out = oai.completions.create(model="llama", prompt=prompts, max_tokens=1, **GREEDY)
        assert sorted(c.index for c in out.choices) == list(range(600))
        assert out.usage.completion_tokens == 600 and out.usage.prompt_tokens == 1200
        first = {c.index: c.text for c in out.choices}
        assert all(first[i] == first[i % 50] for i in range(600))  # the same prompt, the same greedy token
        ended = set()
        for chunk in oai.completions.create(model="llama", prompt=prompts, max_tokens=1, stream=True, **GREEDY):
            ended |= {c.index for c in chunk.choices if c.finish_reason is not None}
        assert ended == set(range(600))
    finally:
        g.stop()
        d.close()


def test_router_codes_map_to_http_statuses():
    busy = O.from_router("busy", "model 'llama' (ID 0) is busy")
    assert (busy.status, busy.headers["Retry-After"], busy.type) == (429, "1", "rate_limit_error")
    assert [O.from_router(c, "m").status for c in ("unknown_model", "too_large", "worker_lost", "no_worker",
                                                   "router_lost", "bad_request")] == [404, 413, 503, 503, 503, 400]


def _engine_counts(frontend: str) -> tuple[int, int]:
    with Client(frontend, timeout=10) as c:
        w = next(w for w in c.status()["workers"] if w["alive"] and w["model_id"] == 0)
        return w["inflight"], w["engine"].get("aborted", 0)


def test_a_closed_connection_cancels_the_request_on_the_worker(gw, dep):
    _, aborted = _engine_counts(dep.frontend)
    body = {"model": "llama:0", "prompt": [1, 2, 3], "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as h, h.stream("POST", gw.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        wait_for(lambda: _engine_counts(dep.frontend)[0] == 1, timeout=10)
    wait_for(lambda: _engine_counts(dep.frontend) == (0, aborted + 1), timeout=10)
    # and a non-streamed request whose client gives up
    with pytest.raises(httpx.ReadTimeout):  # 8 x 480 tokens take about 0.3 s on a fast CPU
        httpx.post(gw.url + "/v1/completions", json={**body, "stream": False, "n": 8}, timeout=0.1)
    wait_for(lambda: _engine_counts(dep.frontend) == (0, aborted + 2), timeout=10)


def test_metrics_parse_and_count(oai, gw):
    oai.completions.create(model="gpt2", prompt="metrics", max_tokens=3, **GREEDY)
    list(oai.completions.create(model="gpt2", prompt="metrics", max_tokens=3, stream=True, **GREEDY))
    with pytest.raises(openai.BadRequestError):  # refused by the worker: counted against its model
        oai.completions.create(model="gpt2", prompt="metrics", max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):  # no model to count it against
        oai.completions.create(model="no-such-model", prompt="metrics", max_tokens=1)
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    reqs = {(s.labels["model"], s.labels["endpoint"], s.labels["status"]): s.value
            for s in fams["mmfusion_http_requests"].samples if s.name.endswith("_total")}
    assert reqs[("gpt2", "completions", "200")] >= 2 and reqs[("gpt2", "completions", "400")] >= 1
    assert reqs[("unknown", "completions", "404")] >= 1
    live = {s.labels["model"]: s.value for s in fams["mmfusion_live_workers"].samples}
    assert live == {"llama:0": 1.0, "gpt2:1": 1.0}
    gen = {s.labels["model"]: s.value for s in fams["mmfusion_generation_tokens"].samples
           if s.name.endswith("_total")}
    assert gen["gpt2"] >= 6
    ttft = [s for s in fams["mmfusion_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert any(s.labels["model"] == "gpt2" and s.value >= 1 for s in ttft)
    assert {"mmfusion_queue_depth", "mmfusion_inflight_requests", "mmfusion_e2e_request_latency_seconds",
            "mmfusion_inter_token_latency_seconds", "mmfusion_prompt_tokens"} <= set(fams)


def test_tokenizer_endpoints_and_per_model_base_urls(gw, dep):
    lm = tiny("llama", "float32")
    with httpx.Client(base_url=gw.url, timeout=10) as h:
        tok = h.post("/models/llama/tokenize", json={"prompt": "hey there", "add_special_tokens": False}).json()
        assert tok["tokens"] == lm.tokenizer("hey there", add_special_tokens=False).input_ids
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
        assert h.post("/detokenize", json={"model": "llama", "tokens": tok["tokens"]}).json() == {"prompt": "hey there"}
        outside = h.post("/detokenize", json={"model": "llama", "tokens": [5, 10**9]})
        assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens", outside.text
        assert "token ID 1000000000 is not in the vocabulary" in outside.json()["error"]["message"]
        info = h.get("/models/gpt2:1/tokenizer_info").json()
        assert info["eos_token"] == "<|endoftext|>" and info["chat_template"] is None
        no_model = h.post("/tokenize", json={"prompt": "x"})  # two variants: which one?
        assert no_model.status_code == 400 and "model" in no_model.json()["error"]["message"]
        r = h.post("/models/gpt2/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "ignore_eos": True}).json()
        assert r["model"] == "gpt2" and r["usage"]["completion_tokens"] == 2
        chat = h.post("/models/llama/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["tokens"] == chat_prompt(lm.tokenizer, [{"role": "user", "content": "hi"}], "llama")
    # a reply of more IDs than a message holds was refused by the client as undecodable (a 502 over HTTP)
    async def tokenize_long() -> None:
        async with AsyncClient(dep.frontend, timeout=60) as ac:
            with pytest.raises(RouterError, match=f"tokenize answers at most {P.MAX_TOKENIZE_IDS}") as refused:
                await ac.result("llama", "x" * (P.MAX_TOKENIZE_IDS + 1), P.TOKENIZE)
            assert refused.value.code == P.BAD_REQUEST
            assert (await ac.result("llama", "x" * P.MAX_TOKENIZE_IDS, P.TOKENIZE))["count"] == P.MAX_TOKENIZE_IDS

    asyncio.run(tokenize_long())


def test_health_names_models_without_a_worker(gw):
    assert httpx.get(gw.url + "/health", timeout=10).json() == {"status": "ok", "models": ["llama:0", "gpt2:1"]}
    box: list = []

    def serve():  # a router whose only model has no worker
        r = Router([ModelEntry(0, "lonely", TINY)], RouterConfig(frontend="tcp://127.0.0.1:*",
                                                                 backend="tcp://127.0.0.1:*"))
        box.append(r)
        r.run()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    wait_for(lambda: box, 10)
    g = GatewayThread(GatewaySettings(router=box[0].frontend_addr), "127.0.0.1", 0).start()
    try:
        r = httpx.get(g.url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["models_without_worker"] == ["lonely:0"]
    finally:
        g.stop()
        box[0].stop()
        t.join(10)


def test_api_keys(dep):
    g = GatewayThread(GatewaySettings(router=dep.frontend, api_keys=("s3cret",)), "127.0.0.1", 0).start()
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=g.url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=g.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="gpt2", prompt="x", max_tokens=1).usage.completion_tokens == 1
        assert httpx.get(g.url + "/health", timeout=10).status_code == 200  # probes need no key
        assert httpx.post(g.url + "/tokenize", json={"model": "gpt2", "prompt": "x"}).status_code == 401
    finally:
        g.stop()


def test_tenants_keys_quotas_and_metrics():
    """A deployment with tenants (real router and worker): the free tenant's key gets 429 with the
    quota's Retry-After once its tokens a minute are reserved, at once and with nothing lost; the
    gold key and a plain key are still served; the tenants' figures show in status and /metrics."""
    tenants = parse_tenants({"gold": {"weight": 3, "api_keys": ["k-gold"]},
                             "free": {"tokens_per_minute": 8, "api_keys": ["k-free"]}})
    d = Deployment(["gpt2,1"], num_workers=1, router={"tenants": tenants})
    g = GatewayThread(GatewaySettings(router=d.frontend, api_keys=("plain",), tenant_keys=tenant_keys(tenants)),
                      "127.0.0.1", 0).start()
    try:
        def post(key, max_tokens):
            return httpx.post(g.url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                              json={"model": "gpt2", "prompt": "x", "max_tokens": max_tokens, "temperature": 0})

        assert post("k-free", 5).json()["usage"]["completion_tokens"] == 5
        r = post("k-free", 5)  # 5 served + 5 more > 8 a minute
        assert r.status_code == 429 and r.json()["error"]["code"] == P.RATE_LIMITED
        assert 55 <= int(r.headers["Retry-After"]) <= 60
        assert post("k-free", 9).status_code == 400  # more than the quota itself: never admissible
        assert post("k-gold", 20).status_code == 200 and post("plain", 20).status_code == 200
        with Client(d.frontend, timeout=30) as c:
            with pytest.raises(RouterError) as exc:
                c.complete("gpt2", "x", max_tokens=4, tenant="free")
            assert exc.value.code == P.RATE_LIMITED and 55 <= exc.value.retry_after <= 60
            status = c.status()["tenants"]
        assert (status["free"]["served_tokens"], status["free"]["rate_limited"]) == (5, 2)
        assert status["gold"]["served_tokens"] == 20 and status["default"]["served_tokens"] == 20
        metrics = httpx.get(g.url + "/metrics", timeout=10).text
        assert re.search(r'mmfusion_tenant_rate_limited\{tenant="free"\} 2\.0', metrics)
        assert re.search(r'mmfusion_tenant_served_tokens\{tenant="gold"\} 20\.0', metrics)
    finally:
        g.stop()
        d.close()


def test_listening_off_loopback_needs_keys(tmp_path, monkeypatch):
    assert parse_listen("0.0.0.0:8000") == ("0.0.0.0", 8000)
    with pytest.raises(GatewayError, match="HOST:PORT"):
        parse_listen("8000")
    with pytest.raises(GatewayError, match="API key"):
        check_listen("0.0.0.0", (), insecure=False)
    check_listen("0.0.0.0", (), insecure=True)
    check_listen("127.0.0.1", (), insecure=False)
    keys = tmp_path / "keys"
    keys.write_text("# ops\nk1\n\nk2\n")
    assert api_keys(["k0"], str(keys), env={"MMFUSION_API_KEYS": "k3, k1"}) == ("k0", "k1", "k2", "k3")


def test_run_mm_serve_refuses_http_off_loopback_without_keys(tmp_path):
    out = subprocess.run([*command(CLI), "--mode", "serve", "--params", str(CONFIG), "--http",
                          "0.0.0.0:8000"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "API key" in out.stderr and "Traceback" not in out.stderr


def test_run_mm_serve_refuses_an_http_port_in_use_before_loading():
    """Another server on the gateway's port: run_mm serve says so at once, before any model loads
    (it used to load them all, then stop when the gateway could not bind)."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        out = subprocess.run([*command(CLI), "--mode", "serve", "--params", str(CONFIG), "--variants", "llama,1",
                              "--http", f"127.0.0.1:{port}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "worker" not in out.stdout + out.stderr


@pytest.mark.slow
def test_real_chat_ends_at_the_end_of_turn_token(embedded_models):
    """SmolLM2-Instruct through its own ChatML template: the reply ends at <|im_end|> (finish_reason
    stop), which the content never shows."""
    from fusion.deploy import build_fusion
    from fusion.local import LocalDeployment
    from fusion.plan import make_plan

    params = {"variants": {"smollm2": {"model": {"source": "smollm2-135m", "dtype": "float32"}}},
              "runconfig": {}, "_path": "test"}
    fusion = build_fusion(params, ["smollm2,1"])
    with LocalDeployment(fusion, make_plan(fusion, None, "cpu", 2), "tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as d:
        d.wait_loaded(300)
        g = GatewayThread(GatewaySettings(router=d.frontend), "127.0.0.1", 0).start()
        try:
            client = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0, timeout=120)
            r = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=64,
                                               messages=[{"role": "user", "content": "What is 2+2? Answer briefly."}])
            c = r.choices[0]
            assert c.finish_reason == "stop" and "4" in c.message.content and "<|im_end|>" not in c.message.content
            assert r.usage.completion_tokens < 64
        finally:
            g.stop()


def test_a_stream_that_fails_part_way_ends_with_an_error_event_then_done():

    with one_worker() as (router, worker, _):
        g = GatewayThread(GatewaySettings(router=router.frontend_addr), "127.0.0.1", 0).start()
        try:
            body = {"model": "llama", "prompt": [1, 2, 3], "max_tokens": 480, "ignore_eos": True, "stream": True}
            events = []
            with httpx.Client(timeout=30) as h, h.stream("POST", g.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line:
                        continue
                    events.append(line)
                    if len(events) == 2:
                        worker.kill()  # the only worker: the router answers worker_lost mid-stream
            assert events[-1] == "data: [DONE]"
            err = json.loads(events[-2].removeprefix("data: "))
            assert err["error"]["code"] == "worker_lost" and "lost" in err["error"]["message"]
            assert all("choices" in json.loads(e.removeprefix("data: ")) for e in events[:-2])
        finally:
            g.stop()


def test_gateway_process_exits_with_its_parent():
    """A gateway started by run_mm serve (--parent-pid) leaves no orphan when serve is SIGKILLed."""
    import sys

    import psutil

    spawn = ("import os, subprocess, sys, time; "
             f"p = subprocess.Popen({command(GATEWAY, '--router', 'tcp://127.0.0.1:9', '--http', '127.0.0.1:0')!r}"
             " + ['--parent-pid', str(os.getpid()), '--log-level', 'warning'], "
             "stdout=subprocess.PIPE, text=True); "
             "print(p.pid, flush=True); print(p.stdout.readline(), end='', flush=True); "
             "print(p.stdout.readline(), end='', flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", spawn], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        gw = psutil.Process(int(parent.stdout.readline()))
        lines = parent.stdout.readline() + parent.stdout.readline()
        assert re.search(r"gateway: listening on http://127\.0\.0\.1:[1-9][0-9]*", lines), lines
        parent.kill()
        parent.wait()
        gw.wait(15)  # raises psutil.TimeoutExpired if it outlived its parent
    finally:
        parent.kill()


HARD_OPEN_FILES = resource.getrlimit(resource.RLIMIT_NOFILE)[1]


@pytest.mark.skipif(HARD_OPEN_FILES != resource.RLIM_INFINITY and HARD_OPEN_FILES < 2048,
                    reason="this machine's hard limit of open files leaves no room above the soft one tried")
def test_idle_connections_past_the_soft_open_files_limit_shut_no_client_out(dep):
    """A gateway started under a soft limit of 512 open files (1,024 is a common default) holds 600
    idle connections and still answers the next client: it raises its limit to the hard one at
    start. Before, that client's request was closed unanswered ("Server disconnected")."""
    import socket

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(command(GATEWAY, "--router", dep.frontend, "--http", f"127.0.0.1:{port}",
                                    "--parent-pid", str(os.getpid()), "--log-level", "warning"),
                            cwd=ROOT, stdout=subprocess.DEVNULL,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (512, HARD_OPEN_FILES)))
    idle = []
    try:
        wait_for(lambda: _healthy(url), timeout=60)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(600)]
        r = httpx.post(f"{url}/v1/completions", json={"model": "llama", "prompt": [1, 2, 3], "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        for s in idle:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_body_that_stops_arriving_is_refused_and_the_gateway_serves_on(dep):
    """A client that promises more body than it sends (or stalls half-way) held its connection for
    ever: uvicorn waits for a body without limit. The gateway now answers 408 once no part of the
    body has arrived for its body_idle_timeout (60 s by default, as nginx), and serves the next
    client."""
    import socket

    g = GatewayThread(GatewaySettings(router=dep.frontend, body_idle_timeout=0.5), "127.0.0.1", 0).start()
    try:
        port = int(g.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            part = b'{"model": "llama", "prompt": [1, 2],'
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 500\r\n\r\n" + part)
            t = time.monotonic()
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                answer += chunk
            assert time.monotonic() - t < 5
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer
        error = json.loads(body)["error"]
        assert error["code"] == "timeout" and f"after {len(part)} bytes" in error["message"], error
        r = httpx.post(g.url + "/v1/completions", json={"model": "llama", "prompt": [1, 2], "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200
    finally:
        g.stop()
