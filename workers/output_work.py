"""A worker's host work of a step (vLLM v1's output processor): the engine's tokens made into text,
stop strings matched, chunks and results formatted as wire messages. It runs where the worker puts
it: on the output thread (workers/output_thread.py) or in the output process
(workers/output_process.py), the same code either way.

Items are taken as they came, in order, except that consecutive steps are merged: when this side
falls behind the engine, each request gets one chunk for the tokens of all the steps that waited
(vLLM's stream interval, chosen by the load), so a slow path sends fewer, larger chunks and never
loses or reorders a token. A request's error or result never overtakes its chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from wire import protocol as P
from workers.completions import completion_result, logprobs_block
from workers.engine.detok import IncrementalText
from workers.engine.params import SamplingParams
from workers.engine.text_output import RequestText
from workers.thread_messages import (
    Answer,
    Cancel,
    Control,
    EngineMessage,
    Failed,
    FinishSample,
    Forget,
    ModelReady,
    OutputMessage,
    Registered,
    StepOutputs,
)

Send = Callable[[list[bytes]], None]


@dataclass(slots=True)
class Request:
    """What the output side knows of a running request."""

    id: str | None  # the client's request id
    text: RequestText
    stream: bool = False
    echo: bool = False
    logprobs: bool = False
    skip: dict[int, int] = field(default_factory=dict)  # resent after a lost worker: tokens the client has
    hold: int = 0  # characters a stream holds back: the start of a stop string the final text may cut
    sent: dict[int, str] = field(default_factory=dict)  # per sample, the text streamed so far
    streamed: dict[int, int] = field(default_factory=dict)  # per sample, the tokens streamed so far
    closed: set[int] = field(default_factory=set)  # samples whose last chunk went out
    # per sample, where the next streamed token's text starts, counted as the whole answer's
    # `text_offset` counts it: each token's own text one after another
    offsets: dict[int, int] = field(default_factory=dict)


class OutputWork:
    """The state of the requests being answered; `handle` turns a batch of items into messages."""

    def __init__(self, tell_engine: Callable[[EngineMessage], None]):
        self.tell_engine = tell_engine
        self.model: ModelReady | None = None
        self.requests: dict[str, Request] = {}
        self.outbox: list[bytes] = []  # this turn's data messages (header, body, ...), sent as one bundle

    def handle(self, items: list[OutputMessage], send: Send) -> None:
        """Everything `items` asks for, then this turn's data messages as one bundle (one frame and
        one wake-up of the I/O side per turn instead of two frames per request)."""
        i = 0
        while i < len(items):
            if isinstance(items[i], StepOutputs):
                merged: dict[str, tuple] = {}  # per request its latest output: the lists only grow
                while i < len(items) and isinstance(items[i], StepOutputs):
                    for res, lengths in zip(items[i].results, items[i].lengths):
                        merged[res.request_id] = (res, lengths)
                    i += 1
                for res, lengths in merged.values():
                    self._emit(res, lengths)
                continue
            self._handle(items[i], send)
            i += 1
        self.flush(send)

    def flush(self, send: Send) -> None:
        if self.outbox:
            frames, self.outbox = self.outbox, []
            send([P.bundle(frames)])

    def _handle(self, item: OutputMessage, send: Send) -> None:
        match item:
            case Registered(key, msg, params, echo):
                self._add(key, msg, params, echo)
            case Failed(key, cid, code, message, param):
                req = self.requests.pop(key, None)
                if req is not None or cid is not None:
                    self._data(P.ERROR, key, P.error(req.id if req is not None else cid, code, message, param))
            case Answer(key, body):
                self._data(P.RESULT, key, body)
            case Forget(keys):
                for key in list(self.requests) if keys is None else keys:
                    self.requests.pop(key, None)
            case ModelReady():
                self.model = item
            case Control(frame):
                self.flush(send)
                send([frame])

    def _add(self, key: str, msg: dict, params: SamplingParams, echo: bool) -> None:
        m = self.model
        stream = bool(msg.get("stream"))
        self.requests[key] = Request(
            id=msg.get("id"), text=RequestText(m.tokenizer, params, m.eos_token_ids, incremental=stream),
            stream=stream, echo=echo,
            logprobs=params.logprobs is not None, skip=P.resume_counts(msg.get("resume")),
            hold=max((len(x) for x in params.stop), default=1) - 1)

    def _emit(self, res, lengths: list[int]) -> None:
        req = self.requests.get(res.request_id)
        if req is None:
            return  # cancelled, dropped, or already answered (a stop string ended it)
        for index in req.text.update(res, lengths):
            self.tell_engine(FinishSample(res.request_id, index))
        if req.stream:
            self._chunk(req, res.request_id, res, lengths)
        if req.text.done(res):
            final = req.text.final(res)
            del self.requests[res.request_id]
            if not res.finished:  # stop strings ended every sample: the engine has nothing left to run
                self.tell_engine(Cancel(res.request_id, answered=True))
            m = self.model
            response = completion_result(final, m.name, m.tokenizer, req.echo, req.logprobs)
            self._data(P.RESULT, res.request_id, {"type": P.RESULT, "id": req.id, "response": response},
                       response["usage"]["completion_tokens"])

    def _chunk(self, req: Request, key: str, res, lengths: list[int]) -> None:
        """The text and tokens each sample added since its last chunk; a sample's last chunk has its
        finish_reason, and its text completes the sample's final text."""
        tok = self.model.tokenizer
        outputs, counts = [], []
        for k, c in enumerate(res.outputs):
            if c.index in req.closed:
                continue
            s = req.text.sample(c.index)
            total = lengths[k] if s.ended is None else min(lengths[k], s.ended)
            skip = req.skip.get(c.index, 0)
            if total <= skip:
                continue
            sent = req.streamed.get(c.index)
            if sent is None:  # a resent request's client has the text of the first `skip` tokens
                sent = skip
                req.sent[c.index] = held(IncrementalText(tok, c.token_ids[:skip]).text, req.hold) if skip else ""
                if req.logprobs and skip:
                    req.offsets[c.index] = sum(len(tok.decode([t])) for t in c.token_ids[:skip])
            finish = "stop" if s.cut is not None else c.finish_reason
            if finish is None and total == sent:
                continue
            if finish is None:
                text = held(s.text, req.hold)
            else:
                text = s.cut if s.cut is not None else tok.decode(c.token_ids[:total], skip_special_tokens=True)
                req.closed.add(c.index)
            prev = req.sent[c.index]
            req.sent[c.index], req.streamed[c.index] = prev + text[len(prev):], total
            out = {"index": c.index, "token_ids": list(c.token_ids[sent:total]), "text": text[len(prev):],
                   "finish_reason": finish}
            if req.logprobs and total > sent:  # the chunk's tokens, their offsets going on from the last chunk's
                tops = c.top_logprobs[sent:total] if c.top_logprobs else [None] * (total - sent)
                block = logprobs_block(tok, c.token_ids[sent:total], c.logprobs[sent:total], tops,
                                       req.offsets.get(c.index, 0))
                req.offsets[c.index] = block["text_offset"][-1] + len(block["tokens"][-1])
                out["logprobs"] = block
            outputs.append(out)
            counts.append([c.index, total])
        if outputs:
            self._data(P.CHUNK, key, {"type": P.CHUNK, "id": req.id, "outputs": outputs}, counts)

    def _data(self, mtype: str, key: str, body: dict, tokens: int | list = 0) -> None:
        self.outbox += (P.header(mtype, key, tokens), P.pack(body))


def held(text: str, hold: int) -> str:
    """The part of a stream's stable text that is safe to send before it ends: not the last `hold`
    characters, which may begin a stop string that the final text cuts. (IncrementalText never
    holds an incomplete UTF-8 sequence.) So the chunks' texts add up to the final text."""
    return text[: len(text) - hold] if hold else text
