"""End to end: a real router, real worker processes, real sockets, tiny models."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import zmq
from support.cluster import Deployment, engine_reference
from support.models import tiny

from routing.client import AsyncClient, Client, RouterError
from wire import protocol as P
from workers.engine import Engine, EngineConfig
from workers.request_params import sampling_params


@pytest.fixture(scope="module")
def two_archs():
    d = Deployment(["llama,1", "gpt2,1", "llama,1"], num_workers=3)
    yield d
    d.close()


def test_round_robin_assignment(two_archs):
    with Client(two_archs.frontend) as c:
        st = c.status()
        models = c.models()
    assert [(w["id"], w["model_id"]) for w in st["workers"]] == [(0, 0), (1, 1), (2, 2)]
    assert [(m["id"], m["name"], m["workers"]) for m in models] == [(0, "llama", [0]), (1, "gpt2", [1]),
                                                                     (2, "llama", [2])]


def test_three_workers_two_models():
    d = Deployment(["llama,1", "gpt2,1"], num_workers=3)
    try:
        with Client(d.frontend) as c:
            st = c.status()
            assert [(w["id"], w["model_id"]) for w in st["workers"]] == [(0, 0), (1, 1), (2, 0)]
            for _ in range(6):
                c.complete(model=0, prompt=[1, 2, 3], max_tokens=2, temperature=0.0)
            served = {w["id"]: w["served"] for w in c.status()["workers"]}
        assert served[1] == 0  # model 1's worker never saw model 0's requests
        assert served[0] > 0 and served[2] > 0 and served[0] + served[2] == 6  # the two workers share model 0
    finally:
        d.close()


def test_requests_reach_only_their_model(two_archs):
    with Client(two_archs.frontend) as c:
        before = {w["id"]: w["served"] for w in c.status()["workers"]}
        for _ in range(4):
            c.complete(model="gpt2", prompt=[5, 6], max_tokens=2)
        for _ in range(3):
            c.complete(model=2, prompt=[5, 6], max_tokens=2)
        after = {w["id"]: w["served"] for w in c.status()["workers"]}
    delta = {k: after[k] - before[k] for k in after}
    assert delta == {0: 0, 1: 4, 2: 3}


def test_two_architectures_match_the_engine(two_archs):
    prompt = [7, 8, 9, 10, 11]
    with Client(two_archs.frontend) as c:
        for name, arch in (("llama", "llama"), ("gpt2", "gpt2")):
            resp = c.complete(model=name, prompt=prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
            assert resp["object"] == "text_completion" and resp["usage"]["completion_tokens"] == 8
            expect = engine_reference(arch, prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
            tok = tiny(arch, "float32").tokenizer
            assert resp["choices"][0]["text"] == tok.decode(expect, skip_special_tokens=True)


def test_32_concurrent_streaming_clients(two_archs):
    prompts = [[(i * 7 + j) % 250 + 1 for j in range(3 + i % 9)] for i in range(32)]

    def one(i):
        with Client(two_archs.frontend, timeout=120) as c:
            toks = []
            for chunk in c.stream(model="llama", prompt=prompts[i], max_tokens=6, temperature=0.8, seed=i,
                                  ignore_eos=True):
                toks += chunk["token_ids"]
            return toks

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, range(32)))
    for i in range(32):
        assert got[i] == engine_reference("llama", prompts[i], max_tokens=6, temperature=0.8, seed=i,
                                          ignore_eos=True)


def test_async_client(two_archs):
    import asyncio

    async def go():
        async with AsyncClient(two_archs.frontend, timeout=60) as c:
            models = await c.models()
            results = await asyncio.gather(*[c.complete("gpt2", [3, 4, 5], max_tokens=3, temperature=0.0)
                                             for _ in range(5)])
            chunks = [ch async for ch in c.stream("llama", [3, 4], max_tokens=3, temperature=0.0)]
            return models, results, chunks

    models, results, chunks = asyncio.run(go())
    assert len(models) == 3 and len({r["choices"][0]["text"] for r in results}) == 1
    assert sum(len(ch["token_ids"]) for ch in chunks) == 3 and chunks[-1]["finish_reason"] == "length"


def test_a_closed_client_says_so(two_archs):
    import asyncio

    c = Client(two_archs.frontend, timeout=10)
    assert c.complete("llama", [3, 4], max_tokens=1)["choices"]
    c.close()
    c.close()  # twice is fine
    with pytest.raises(RuntimeError, match="is closed: make a new one"):
        c.complete("llama", [3, 4], max_tokens=1)

    async def go():
        a = AsyncClient(two_archs.frontend, timeout=10)
        a.close()
        with pytest.raises(RuntimeError, match="is closed"):
            await a.complete("llama", [3, 4], max_tokens=1)

    asyncio.run(go())


def test_the_command_line_client_reports_errors_by_name(two_archs, capsys):
    """python -m routing.client: a bad address is a usage error, not zmq's traceback; 0 copies is
    one too, not the default 1; an error after the echoed prompt starts on a line of its own."""
    from routing.client import main

    with pytest.raises(SystemExit) as info:
        main(["--router", "foo", "--status"])
    assert info.value.code == 2 and "--router 'foo' is not tcp://HOST:PORT" in capsys.readouterr().err
    with socket.socket() as s:  # a port nobody serves: the question of status times out, saying what to check
        s.bind(("127.0.0.1", 0))
        nobody = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    assert main(["--router", nobody, "--status", "--timeout", "0.5"]) == 1
    assert "within 0.5s: is a deployment serving there?" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["--router", two_archs.frontend, "--load", "llama", "--copies", "0"])
    assert info.value.code == 2 and "--copies must be an integer >= 1, got 0" in capsys.readouterr().err
    for flags, said in ((["--timeout", "-1"], "--timeout must be a number of seconds > 0, got -1.0"),
                        (["--timeout", "nan"], "--timeout must be a number of seconds > 0, got nan"),
                        (["--curve-keys", "/no/such/keys"], "--curve-keys '/no/such/keys': ")):
        with pytest.raises(SystemExit) as info:  # a usage error naming the flag, not a wait or a traceback
            main(["--router", two_archs.frontend, "--status", *flags])
        assert info.value.code == 2 and said in capsys.readouterr().err, flags
    assert main(["--router", two_archs.frontend, "hello", "--model", "99", "--max-tokens", "2"]) == 1
    out = capsys.readouterr()
    assert out.out == "hello\n" and out.err.startswith("error: unknown_model"), out
    assert main(["--router", two_archs.frontend, "hi", "--model", "llama", "--max-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("hi")


@pytest.mark.parametrize("kwargs,code,match,param", [
    (dict(model="nope", prompt=[1]), P.UNKNOWN_MODEL, "unknown model 'nope'", None),
    (dict(model=9, prompt=[1]), P.UNKNOWN_MODEL, "unknown model ID 9", None),
    (dict(model="llama", prompt=[1], temperature=-1), P.BAD_REQUEST, "temperature", "temperature"),
    (dict(model="llama", prompt=[1], top_p=2), P.BAD_REQUEST, "top_p", "top_p"),
    (dict(model="llama", prompt=[1, 99999]), P.BAD_REQUEST, "vocabulary", "prompt"),
    (dict(model="llama", prompt=list(range(1, 250)) * 3), P.BAD_REQUEST, "context", "max_tokens"),
    (dict(model="llama", prompt=[1], frobnicate=3), P.BAD_REQUEST, "frobnicate", "frobnicate"),
    (dict(model="llama", prompt=[]), P.BAD_REQUEST, "empty", "prompt"),
    # integers JSON allows but the wire cannot carry: refused by the client, by name
    (dict(model="llama", prompt=[1], seed=2**64), P.BAD_REQUEST, r"params\.seed is out of range", "seed"),
    (dict(model="llama", prompt=[1, -2**63 - 1]), P.BAD_REQUEST, r"prompt\[1\] is out of range", "prompt"),
    (dict(model="llama", prompt=[1], stop_token_ids=[2**70]), P.BAD_REQUEST, r"stop_token_ids\[0\]",
     "stop_token_ids"),
    # text the wire cannot carry (half of a UTF-16 pair, as JSON's escapes can spell it): by name too
    (dict(model="llama", prompt="a\ud800"), P.BAD_REQUEST, r"prompt holds a lone UTF-16 surrogate \(\\ud800\)",
     "prompt"),
    (dict(model="llama", prompt=[1], stop=["ok", "\udfff"]), P.BAD_REQUEST, r"params\.stop\[1\] holds a lone",
     "stop"),
])
def test_bad_requests_get_errors(two_archs, kwargs, code, match, param):
    with Client(two_archs.frontend, timeout=30) as c:
        model, prompt = kwargs.pop("model"), kwargs.pop("prompt")
        with pytest.raises(RouterError, match=match) as info:
            c.complete(model=model, prompt=prompt, **kwargs)
        assert info.value.code == code and info.value.param == param
        assert c.complete(model="llama", prompt=[1, 2], max_tokens=1)["choices"]  # still serving


def test_the_largest_seed_the_wire_carries_samples_and_the_async_client_refuses_a_larger_one(two_archs):
    import asyncio

    async def go():
        async with AsyncClient(two_archs.frontend, timeout=60) as c:
            with pytest.raises(RouterError, match=r"params\.seed is out of range") as info:
                await c.complete("llama", [3, 4], max_tokens=2, temperature=1.0, seed=2**64)
            assert info.value.param == "seed"
            top = [await c.complete("llama", [3, 4], max_tokens=4, temperature=1.0, seed=2**64 - 1,
                                    return_token_ids=True) for _ in range(2)]
            return [r["choices"][0]["token_ids"] for r in top]

    a, b = asyncio.run(go())
    assert a == b and len(a) == 4  # seeded: the same tokens twice


@pytest.mark.parametrize("frame,match", [
    (b"\xc1\xff garbage", "undecodable"),
    (msgpack.packb([1, 2, 3]), "map"),
    (msgpack.packb({"v": 99, "type": "complete", "id": "x"}), "version"),
    (msgpack.packb({"v": 1, "type": "launch", "id": "x"}), "unknown message type"),
    (msgpack.packb({"v": 1, "type": "complete", "id": "x", "model": "llama", "prompt": [1.5]}), "token IDs"),
    (b"\x00" * (P.MAX_MESSAGE_BYTES + 10), "exceeds the limit"),
])
def test_garbage_and_oversized_frames(two_archs, frame, match):
    with Client(two_archs.frontend, timeout=30) as c:
        c.send_raw(frame)
        reply = c.recv(time.monotonic() + 30)
        assert reply["type"] == P.ERROR and match in reply["message"]
        assert c.complete(model="gpt2", prompt=[1, 2], max_tokens=1)["choices"]


def test_a_message_of_several_frames_is_answered_by_name(two_archs):
    """A REQ socket (an empty frame, then the message) and a DEALER sending a message in three frames
    used to be dropped without a word, their senders waiting for ever. Each gets an error that says
    what to send; the REQ socket's comes after an empty frame, the only reply it can read."""
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    dealer = ctx.socket(zmq.DEALER)
    try:
        for s in (req, dealer):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, 30_000)
            s.connect(two_archs.frontend)
        models = P.pack({"type": P.MODELS, "id": "m"})
        req.send(models)
        reply = msgpack.unpackb(req.recv())
        assert reply["type"] == P.ERROR and reply["code"] == P.BAD_REQUEST and "DEALER" in reply["message"]
        dealer.send_multipart([models, models, models])
        reply = msgpack.unpackb(dealer.recv())
        assert reply["type"] == P.ERROR and "3 frames" in reply["message"]
        dealer.send(models)  # the same socket is served as before
        assert msgpack.unpackb(dealer.recv())["type"] == P.REPLY
    finally:
        req.close()
        dealer.close()


def test_a_request_past_the_size_limits_gets_its_answer(two_archs):
    """A prompt of more token IDs than the router decodes (under the byte limit: an HTTP body of
    2.6 MB held 1.3 million) went unanswered: the router could not read the request's id from
    it, so its refusal named no request, and the client waited for its timeout. The client now
    refuses it before sending, and the router reads the id from the entries before the prompt
    for a client that sends it anyway."""
    n = P.MAX_PROMPT_ITEMS + 1
    with Client(two_archs.frontend, timeout=30) as c:
        t0 = time.monotonic()
        with pytest.raises(RouterError) as info:
            c.complete(model="llama", prompt=[1] * n, max_tokens=1)
        assert info.value.code == P.TOO_LARGE and f"prompt of {n} token IDs" in str(info.value)
        assert time.monotonic() - t0 < 5
        c.send_raw(P.pack({"type": P.COMPLETE, "id": "raw-1", "model": "llama", "prompt": [1] * n, "params": {},
                           "stream": False}))
        reply = c.recv(time.monotonic() + 30)
        assert reply["type"] == P.ERROR and reply["id"] == "raw-1" and "max_array_len" in reply["message"]
        c.send_raw(P.pack({"type": P.COMPLETE, "id": "raw-2", "model": "llama", "prompt": "x" * P.MAX_MESSAGE_BYTES,
                           "params": {}, "stream": False}))
        reply = c.recv(time.monotonic() + 30)
        assert reply["type"] == P.ERROR and reply["id"] == "raw-2" and reply["code"] == P.TOO_LARGE
        # a logit_bias past the router's map limit: named, not "undecodable message: ... max_map_len"
        bias = {str(i): 1.0 for i in range(P.MAX_MAP_ITEMS + 1)}
        with pytest.raises(RouterError) as info:
            c.complete(model="llama", prompt=[1, 2], max_tokens=1, logit_bias=bias)
        assert info.value.code == P.TOO_LARGE and info.value.param == "logit_bias", info.value
        assert f"logit_bias has {P.MAX_MAP_ITEMS + 1} entries" in str(info.value)
        assert c.complete(model="gpt2", prompt=[1, 2], max_tokens=1)["choices"]


def test_stream_texts_add_up_to_the_final_text_with_stop_strings(two_archs):
    """Chunks never carry half a character or the start of a stop string the final text cuts."""
    eng = Engine(tiny("llama", "float32"), EngineConfig(max_batch_size=4, max_batch_tokens=64))
    prompt = "stop here please"
    full = eng.generate([prompt], sampling_params({"max_tokens": 40, "temperature": 0.0})[0])[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    with Client(two_archs.frontend, timeout=60) as c:
        for params in ({"max_tokens": 40, "temperature": 0.0, "stop": [stop]},
                       {"max_tokens": 40, "temperature": 0.9, "seed": 5, "n": 2}):
            texts: dict[int, str] = {}
            for msg in c._run("llama", prompt, True, params):
                if msg["type"] == P.CHUNK:
                    for out in msg["outputs"]:
                        texts[out["index"]] = texts.get(out["index"], "") + out["text"]
                else:
                    final = {ch["index"]: ch["text"] for ch in msg["response"]["choices"]}
            assert texts == final
            if "stop" in params:
                assert stop not in final[0] and full.startswith(final[0]) and len(final[0]) < len(full)


def test_best_of_beyond_n_is_refused_for_a_stream_and_served_whole(two_archs):
    """best_of > n: the n best are known only once every sample ends, so a stream is refused by
    name (it streamed every sample, more choices than n); the same request unstreamed returns n."""
    params = {"max_tokens": 4, "temperature": 0.9, "seed": 3, "n": 1, "best_of": 3}
    with Client(two_archs.frontend, timeout=60) as c:
        with pytest.raises(RouterError, match=r"best_of \(3\) > n \(1\) cannot be streamed") as info:
            list(c.stream("llama", [3, 4], **params))
        assert info.value.code == P.BAD_REQUEST and info.value.param == "best_of"
        assert [ch["index"] for ch in c.complete("llama", [3, 4], **params)["choices"]] == [0]
        streamed = list(c.stream("llama", [3, 4], **{**params, "best_of": 1}))  # best_of == n streams
        assert streamed
