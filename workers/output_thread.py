"""A worker's output side as a thread of its process (workers/output_work.py does the work), and
the interface the engine thread hands its items through, which the output process
(workers/output_process.py) shares.

The engine thread hands each step's token outputs over and goes on to the next step. The output
side detokenizes streams incrementally, matches stop strings (and tells the engine to stop a sample
that matched one), formats chunks and results, and sends them to the I/O thread. Everything the
engine thread sends to the router passes through it in order, so a request's error or result
never overtakes its chunks.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import zmq

from wire import protocol as P
from wire.frames import send_frames
from workers.engine.params import SamplingParams
from workers.output_work import OutputWork
from workers.thread_messages import (
    Answer,
    Control,
    EngineMessage,
    Failed,
    Forget,
    ModelReady,
    OutputMessage,
    Registered,
    StepOutputs,
)


class OutputSink(ABC):
    """The engine thread's side: every method is called on the engine thread, and `_put` takes the
    item to wherever the output work runs."""

    @abstractmethod
    def _put(self, item: OutputMessage) -> None:
        """Hand `item` to the output work, in order."""

    @abstractmethod
    def running(self) -> int:
        """Requests being answered (for the worker's status)."""

    def put_model(self, name: str, tokenizer, eos_token_ids: list[int]) -> None:
        self._put(ModelReady(name, tokenizer, list(eos_token_ids)))

    def put_control(self, msg: dict) -> None:
        self._put(Control(P.pack(msg)))

    def put_error(self, key: str, cid: str | None, code: str, message: str, param: str | None = None) -> None:
        """A request failed: its error, after whatever it sent before; the request is forgotten.
        `cid` None: the client's id is the one it was registered with (put_request); a request
        already answered gets no error. `param`: the request parameter refused."""
        self._put(Failed(key, cid, code, message, param))

    def put_result(self, key: str, body: dict) -> None:
        """An answer computed on the engine thread (tokenizer tasks)."""
        self._put(Answer(key, body))

    def put_request(self, key: str, msg: dict, params: SamplingParams, echo: bool) -> None:
        self._put(Registered(key, msg, params, echo))

    def put_forget(self, keys: list[str] | None) -> None:
        """Cancelled, answered, or (None) all dropped for a new assignment: send nothing more."""
        self._put(Forget(keys))

    def put_step(self, results: list) -> None:
        self._put(StepOutputs(results, [[len(c.token_ids) for c in r.outputs] for r in results]))


class OutputThread(OutputSink, threading.Thread):
    """The output work on a thread of the worker, sending to the I/O thread through the inproc PAIR
    socket it owns."""

    def __init__(self, ctx: zmq.Context, out_addr: str, tell_engine: Callable[[EngineMessage], None]):
        threading.Thread.__init__(self, daemon=True, name="output")
        self.items: queue.Queue[OutputMessage] = queue.Queue()
        self.ctx, self.out_addr = ctx, out_addr
        self.stop = threading.Event()
        self.work = OutputWork(tell_engine)

    def _put(self, item: OutputMessage) -> None:
        self.items.put(item)

    def running(self) -> int:
        return len(self.work.requests)

    def run(self) -> None:
        out = self.ctx.socket(zmq.PAIR)
        out.setsockopt(zmq.LINGER, 0)
        out.connect(self.out_addr)

        def send(frames: list[bytes]) -> None:
            while not self.stop.is_set():  # the main thread drains the pair; it may be exiting
                try:
                    send_frames(out, frames)
                    return
                except zmq.Again:
                    time.sleep(0.001)

        try:
            while not self.stop.is_set():
                try:
                    items = [self.items.get(timeout=0.05)]
                except queue.Empty:
                    continue
                while not self.items.empty():  # only this thread takes from the queue
                    items.append(self.items.get_nowait())
                self.work.handle(items, send)
        finally:
            out.close(linger=0)
