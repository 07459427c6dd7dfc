"""A worker's output thread: the host work of a step, off the compute thread (vLLM v1's shape).

The engine thread hands each step's token outputs here and goes on to the next step. This thread
detokenizes streams incrementally, matches stop strings (and tells the engine to stop a sample
that matched one), formats chunks and results, and sends them to the I/O thread
through the inproc PAIR socket it owns. Everything the engine thread sends to the router passes
through here in order, so a request's error or result never overtakes its chunks.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from wire import protocol as P
from wire.frames import send_frames
from workers.completions import completion_result
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


@dataclass(slots=True)
class Request:
    """What the output thread knows of a running request."""

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


class OutputThread(threading.Thread):
    """Consumes the engine thread's items (see the put_* methods), sends the resulting messages."""

    def __init__(self, ctx: zmq.Context, out_addr: str, tell_engine: Callable[[EngineMessage], None]):
        super().__init__(daemon=True, name="output")
        self.items: queue.Queue[OutputMessage] = queue.Queue()
        self.ctx, self.out_addr, self.tell_engine = ctx, out_addr, tell_engine
        self.stop = threading.Event()
        self.model: ModelReady | None = None
        self.requests: dict[str, Request] = {}
        self.outbox: list[bytes] = []  # this turn's data messages (header, body, ...), sent as one

    # --- called on the engine thread ------------------------------------------------------------
    def put_model(self, name: str, tokenizer, eos_token_ids: list[int]) -> None:
        self.items.put(ModelReady(name, tokenizer, list(eos_token_ids)))

    def put_control(self, msg: dict) -> None:
        self.items.put(Control(P.pack(msg)))

    def put_error(self, key: str, cid: str | None, code: str, message: str, param: str | None = None) -> None:
        """A request failed: its error, after whatever it sent before; the request is forgotten.
        `cid` None: the client's id is the one it was registered with (put_request); a request
        already answered gets no error. `param`: the request parameter refused."""
        self.items.put(Failed(key, cid, code, message, param))

    def put_result(self, key: str, body: dict) -> None:
        """An answer computed on the engine thread (tokenizer tasks)."""
        self.items.put(Answer(key, body))

    def put_request(self, key: str, msg: dict, params: SamplingParams, echo: bool) -> None:
        self.items.put(Registered(key, msg, params, echo))

    def put_forget(self, keys: list[str] | None) -> None:
        """Cancelled, or (None) all dropped for a new assignment: send nothing more for these."""
        self.items.put(Forget(keys))

    def put_step(self, results: list) -> None:
        self.items.put(StepOutputs(results, [[len(c.token_ids) for c in r.outputs] for r in results]))

    # --- this thread ------------------------------------------------------------------------------
    def run(self) -> None:
        out = self.ctx.socket(zmq.PAIR)
        out.setsockopt(zmq.LINGER, 0)
        out.connect(self.out_addr)
        try:
            while not self.stop.is_set():
                try:
                    self._handle(self.items.get(timeout=0.05), out)
                    while True:
                        self._handle(self.items.get_nowait(), out)
                except queue.Empty:
                    pass
                self._flush(out)
        finally:
            out.close(linger=0)

    def _handle(self, item: OutputMessage, out) -> None:
        match item:
            case StepOutputs(results, lengths):
                for res, counts in zip(results, lengths):
                    self._emit(res, counts)
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
                self._flush(out)
                self._put(out, [frame])

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
            outputs.append({"index": c.index, "token_ids": list(c.token_ids[sent:total]), "text": text[len(prev):],
                            "finish_reason": finish})
            counts.append([c.index, total])
        if outputs:
            self._data(P.CHUNK, key, {"type": P.CHUNK, "id": req.id, "outputs": outputs}, counts)

    def _data(self, mtype: str, key: str, body: dict, tokens: int | list = 0) -> None:
        self.outbox += (P.header(mtype, key, tokens), P.pack(body))

    def _flush(self, out) -> None:
        """A turn's data messages cross to the I/O thread as one message, which it sends to the
        router as one: one wake-up of each per turn (an engine step) instead of one per request."""
        if self.outbox:
            frames, self.outbox = self.outbox, []
            self._put(out, frames)

    def _put(self, out, frames: list[bytes]) -> None:
        while not self.stop.is_set():  # the main thread drains the pair; it may be exiting
            try:
                send_frames(out, frames)
                return
            except zmq.Again:
                time.sleep(0.001)


def held(text: str, hold: int) -> str:
    """The part of a stream's stable text that is safe to send before it ends: not the last `hold`
    characters, which may begin a stop string that the final text cuts. (IncrementalText never
    holds an incomplete UTF-8 sequence.) So the chunks' texts add up to the final text."""
    return text[: len(text) - hold] if hold else text
