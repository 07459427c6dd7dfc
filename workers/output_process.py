"""A worker's output work in a process of its own (vLLM v1 detokenizes outside its engine core's
process too): the engine thread keeps the worker's interpreter lock to itself and its steps, and the
text, stop strings and message formatting of the requests run beside it on another core.

The worker forks the output process first thing, before it has a ZeroMQ context or a thread (a
fork then copies one thread and no sockets). The engine thread sends it every item of the output
interface (workers/output_thread.OutputSink) over a PAIR socket, steps as additions
(workers/step_deltas.py). The output process sends the worker's I/O thread, over another PAIR, the
same messages the output thread would (a turn's data messages, or a control message), which the
I/O thread forwards to the router as they are, and a note for the engine (a stop string ended a
sample) as a frame pair that starts with an empty frame.

The sockets are in Linux's abstract namespace: no file exists for them. The output process exits
when told to (the worker's exit), when the worker is gone (the kernel's parent-death signal, and
a check of its parent), and never runs the worker's exit handlers.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import secrets
import signal
import sys
import time
import traceback

import zmq

from wire.frames import recv_waiting, send_frames
from workers.output_thread import OutputSink
from workers.output_work import OutputWork
from workers.step_deltas import StepEncoder, StepMirror
from workers.thread_messages import (
    EngineMessage,
    Failed,
    Forget,
    ModelReady,
    OutputMessage,
    Registered,
)
from workers.weights.held_tokenizers import directory_of, from_directory

NOTE = b""  # first frame of a note for the engine thread
_STOP = b"stop"  # the worker is exiting
_PR_SET_PDEATHSIG = 1


def supported() -> bool:
    """Abstract socket names and the parent-death signal are Linux's."""
    return sys.platform.startswith("linux")


class OutputProcess:
    """The worker's handle on its output process: the addresses, the child's pid, its exit."""

    def __init__(self):
        tag = f"mmfusion-output-{os.getpid()}-{secrets.token_hex(6)}"
        self.in_addr, self.out_addr = f"ipc://@{tag}-in", f"ipc://@{tag}-out"
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: it never returns into the worker's code
            code = 1
            try:
                code = _child(self.in_addr, self.out_addr, parent)
            except BaseException:  # noqa: BLE001 - say why, then leave without the worker's exit handlers
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.pid = pid
        self.returncode: int | None = None

    def alive(self) -> bool:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode is None

    def wait(self, timeout: float) -> None:
        """Wait for its exit (it was told to stop), then kill it."""
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.returncode = -signal.SIGKILL


class OutputLink(OutputSink):
    """The engine thread's end: items pickled onto the PAIR socket to the output process. Made on
    the main thread before the engine thread starts, then used by that thread only (and by the
    main thread once that one has ended, to say stop)."""

    def __init__(self, ctx: zmq.Context, proc: OutputProcess):
        self.proc = proc
        self.sock = ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop: the output process reads all, in order
        self.sock.bind(proc.in_addr)
        self.steps = StepEncoder()
        self.live: set[str] = set()

    def start(self) -> None:
        """Nothing to start: the process runs from the worker's start."""

    def running(self) -> int:
        return len(self.live)

    def put_step(self, results: list) -> None:
        """The step's additions only (step_deltas): the output process rebuilds the outputs."""
        for res in results:
            if res.finished:
                self.live.discard(res.request_id)
        self._send(("step", self.steps.encode(results)))

    def _put(self, item: OutputMessage) -> None:
        match item:
            case ModelReady(name, tokenizer, eos):
                # the directory it was built from, where the output process finds it held or builds
                # it (a pickled large vocabulary costs seconds on this thread)
                where = directory_of(tokenizer)
                body = ("model", name, ("dir", where) if where else ("pickle", pickle.dumps(tokenizer)), eos)
            case Registered(key, _, _, _):
                self.live.add(key)
                body = item
            case Failed(key, _, _, _, _):
                self.steps.forget([key])
                self.live.discard(key)
                body = item
            case Forget(keys):
                self.steps.forget(keys)
                if keys is None:
                    self.live.clear()
                self.live.difference_update(keys or ())
                body = item
            case _:
                body = item
        self._send(body)

    def _send(self, body) -> None:
        send_frames(self.sock, [pickle.dumps(body, protocol=pickle.HIGHEST_PROTOCOL)], block=True)

    def close(self, timeout: float) -> None:
        """Tell the output process to stop (after everything sent before), and wait for it."""
        try:
            send_frames(self.sock, [_STOP])
        except zmq.ZMQError:
            pass
        self.proc.wait(timeout)
        self.sock.close(linger=0)


def note_frames(note: EngineMessage) -> list[bytes]:
    return [NOTE, pickle.dumps(note)]


def read_note(frames: list[bytes]) -> EngineMessage | None:
    """The engine note these frames carry, or None for a message to the router."""
    if len(frames) == 2 and frames[0] == NOTE:
        return pickle.loads(frames[1])
    return None


def _decode(body) -> OutputMessage:
    if isinstance(body, tuple) and body[0] == "model":
        _, name, (kind, ref), eos = body
        tokenizer = from_directory(ref) if kind == "dir" else pickle.loads(ref)
        return ModelReady(name, tokenizer, eos)
    return body


def _child(in_addr: str, out_addr: str, parent: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides when this one stops
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # gone before the signal was set
        return 0
    ctx = zmq.Context()
    inbox, out = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for s in (inbox, out):
        s.setsockopt(zmq.LINGER, 0)
    out.setsockopt(zmq.SNDHWM, 0)
    inbox.connect(in_addr)
    out.connect(out_addr)

    def send(frames: list[bytes]) -> None:
        send_frames(out, frames, block=True)

    work = OutputWork(lambda note: send(note_frames(note)))
    mirror = StepMirror()
    try:
        while True:
            if not inbox.poll(200):
                if os.getppid() != parent:
                    return 0
                continue
            items: list[OutputMessage] = []
            while (frames := recv_waiting(inbox)) is not None:
                frame = frames[0]
                if frame == _STOP:
                    work.handle(items, send)
                    return 0
                body = pickle.loads(frame)
                if isinstance(body, tuple) and body[0] == "step":
                    items.append(mirror.apply(body[1]))
                    continue
                item = _decode(body)
                if isinstance(item, Forget):
                    mirror.forget(item.keys)
                elif isinstance(item, Failed):
                    mirror.forget([item.key])
                items.append(item)
            work.handle(items, send)
    finally:
        inbox.close(0)
        out.close(0)
        ctx.term()
