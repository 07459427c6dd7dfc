"""A worker process: registers with the router, loads the model it is assigned, serves its requests.

Three threads, so that socket I/O never waits on a forward pass (and heartbeats go on while a
model loads) and the host work of a step never delays the next: the main thread owns the DEALER
socket (register, heartbeat, reconnect with capped backoff, as in the ZeroMQ guide's Paranoid
Pirate worker); the engine thread owns the Engine and takes requests from a queue; the output
thread (workers/output_thread.py) turns each step's tokens into text and messages and hands them
to the main thread through an inproc PAIR socket.

Every (re)assignment drops the work of the previous one: after a reconnect the router has resent
it elsewhere. Writes never block: a router that is gone costs the messages meant for it, never a
hang, and a worker whose parent died exits. On exit the engine and output threads are joined
and the zmq context terminated.

    python -m workers.worker --backend tcp://127.0.0.1:5556 [--threads N] [--slot K] [--echo]
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import zmq

from wire import protocol as P
from wire.frames import recv_waiting, send_frames
from wire.security import ClientKeys, connect_curve
from workers.gc_pause import import_paused
from workers.low_priority import at_low_priority
from workers.output_process import OutputLink, OutputProcess, read_note
from workers.output_process import supported as output_process_supported
from workers.output_thread import OutputSink, OutputThread
from workers.thread_messages import Assign, Cancel, EngineMessage, FinishSample, Submit
from workers.validate import ParamError


@dataclass(slots=True)
class WorkerConfig:
    backend: str = P.DEFAULT_BACKEND
    heartbeat_interval: float = P.HEARTBEAT_INTERVAL  # seconds between heartbeats both ways
    liveness: int = P.LIVENESS  # missed heartbeats before the router is presumed dead
    reconnect_initial: float = 0.25
    reconnect_max: float = 8.0  # backoff cap
    num_threads: int | None = None
    parent_pid: int | None = None  # exit when this process is gone (no orphans)
    echo: bool = False  # answer without a model: for router benchmarks and tests
    # CurveZMQ keys, when the router requires them: a keys directory, or the keys in memory
    curve_keys: str | ClientKeys | None = None
    curve_name: str = "worker"  # this worker's keypair: <curve_keys>/clients/<name>.key_secret
    slot: int | None = None  # the deployment plan's worker this process is: the router assigns its planned model
    # where the output work runs: "process" (its own, forked at start: workers/output_process.py)
    # or "thread" (of this process: a Ray actor, which must not fork)
    output: str = "process" if output_process_supported() else "thread"
    join_timeout: float = 30.0  # how long exit waits for the engine thread to finish its step
    placement: dict | None = None  # where a cluster placed this worker (Ray: node, resources), for status

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0 or self.liveness < 1:
            raise ValueError("heartbeat_interval must be > 0 and liveness >= 1")
        if self.output not in ("process", "thread"):
            raise ValueError(f"output must be 'process' or 'thread', got {self.output!r}")
        if self.output == "process" and not output_process_supported():
            raise ValueError("output: 'process' needs Linux (abstract sockets, the parent-death signal); use 'thread'")


class EngineThread(threading.Thread):
    """Owns the Engine: load on assignment, then step while there is work. What a step produced
    goes to the output thread, which makes text and messages of it while the next step runs."""

    def __init__(self, num_threads: int | None):
        # daemon only as a last resort: exit joins it (Worker.run), and never leaves it running
        super().__init__(daemon=True, name="engine")
        self.inbox: queue.Queue[EngineMessage] = queue.Queue()
        self.output: OutputSink | None = None  # connect() sets it before the thread starts
        self.num_threads = num_threads
        self.stop = threading.Event()
        self.engine = None
        self.spec = None  # the WorkerSpec it serves
        self.aborted = 0  # requests cancelled while they ran (their batch slots freed)
        self.dropped = 0  # requests dropped because the worker was assigned again

    def connect(self, ctx: zmq.Context, out_addr: str) -> OutputThread:
        """The output thread this one hands its steps to, which tells this one of matched stops."""
        self.output = OutputThread(ctx, out_addr, self.inbox.put)
        return self.output

    def connect_process(self, ctx: zmq.Context, proc: OutputProcess) -> OutputLink:
        """The output process this one hands its steps to; its notes come through the I/O thread."""
        self.output = OutputLink(ctx, proc)
        return self.output

    def run(self) -> None:
        try:
            self._loop()
        finally:
            engine, self.engine = self.engine, None
            if engine is not None:
                engine.close()

    def _loop(self) -> None:
        while not self.stop.is_set():
            busy = self.engine is not None and self.engine.has_unfinished()
            try:
                item = self.inbox.get_nowait() if busy else self.inbox.get(timeout=0.05)
                self._handle(item)
                while True:
                    self._handle(self.inbox.get_nowait())
            except queue.Empty:
                pass
            if self.engine is not None and self.engine.has_unfinished():
                try:
                    results = self.engine.step()
                except Exception as exc:  # a bug must cost the requests of this step, not the worker
                    self._fail_step(f"{type(exc).__name__}: {exc}")
                    results = []
                if results:
                    self.output.put_step(results)

    def _fail_step(self, why: str) -> None:
        """Fail the requests the failed step touched; the others were left as they were and go on."""
        traceback.print_exc()
        for key in sorted(self.engine.last_step_requests()):
            self.engine.abort(key)
            self.output.put_error(key, None, P.INTERNAL, f"the engine failed: {why}")

    def _drop_all(self) -> None:
        """A new assignment: the router resent everything we held; finishing it would only waste steps."""
        if self.engine is not None:
            keys = self.engine.request_ids()
            self.dropped += len(keys)
            for key in keys:
                self.engine.abort(key)
        self.output.put_forget(None)

    def _handle(self, item: EngineMessage) -> None:
        match item:
            case Assign():
                self._drop_all()
                self._load(item)
            case Submit(key, msg):
                self._add(key, msg)
            case Cancel(key, answered):
                if self.engine is not None and self.engine.abort(key) and not answered:
                    self.aborted += 1
                self.output.put_forget([key])  # an answered request's text is forgotten already
            case FinishSample(key, index):  # the output thread matched a stop string: stop running that sample
                if self.engine is not None:
                    self.engine.finish_sample(key, index)

    def _load(self, assign: Assign) -> None:
        import_paused("workers.models")  # a worker not forked from a preloaded server imports them now
        from workers.engine import Engine, EngineConfig
        from workers.models import load_model
        from workers.spec import WorkerSpec

        try:
            spec = WorkerSpec.from_wire(assign.spec)
            bind_cores(spec.cpus)
            if self.spec != spec:
                m = spec.model

                def build() -> Engine:
                    lm = load_model(m.source, dtype=m.dtype, device=spec.device, max_model_len=m.max_model_len,
                                    share_weights=m.share_weights, owner=spec.weights_owner, prepack=m.prepack_weights,
                                    one_engine=True)
                    return Engine(lm, EngineConfig.from_spec(spec, self.num_threads))

                # behind serving: other models' workers on these cores keep their CPU while this loads
                self.engine, self.spec = at_low_priority(build), spec
                if self.engine.compile_info.compiled:
                    print(f"worker: {spec.name}: {self.engine.compile_info.summary()}", file=sys.stderr, flush=True)
                if self.engine.kernels:
                    chosen = "; ".join(f"{k}: {v}" for k, v in self.engine.kernels.items())
                    print(f"worker: {spec.name}: kernels measured at load: {chosen}", file=sys.stderr, flush=True)
        except Exception as exc:  # a bad spec or a missing package: say so, stay up, wait for another ASSIGN
            traceback.print_exc()
            self.output.put_control({"type": P.LOAD_FAILED, "model_id": assign.model_id, "worker_id": assign.worker_id,
                                     "message": f"{type(exc).__name__}: {exc}"})
            return
        try:
            self.output.put_model(spec.name, self.engine.tokenizer, self.engine.lm.eos_token_ids)
        except Exception as exc:  # a tokenizer the output process cannot be given: this load failed, not the worker
            traceback.print_exc()
            engine, self.engine, self.spec = self.engine, None, None
            engine.close()
            self.output.put_control({"type": P.LOAD_FAILED, "model_id": assign.model_id, "worker_id": assign.worker_id,
                                     "message": f"its tokenizer cannot reach the output process: "
                                                f"{type(exc).__name__}: {exc}"})
            return
        self.output.put_control({"type": P.LOADED, "model_id": assign.model_id, "worker_id": assign.worker_id,
                                 "weights": self.engine.lm.weights.as_dict(),
                                 "compile": self.engine.compile_info.as_dict(), "kernels": self.engine.kernels})

    def _task(self, task: str, prompt, params: dict) -> dict:
        """A tokenizer task's answer, computed here and now (no engine step)."""
        from workers import tasks

        e, name = self.engine, self.spec.name
        if task == P.TOKENIZE:
            return tasks.tokenize(e.tokenizer, prompt, params, name, e.lm.max_model_len)
        if task == P.DETOKENIZE:
            return tasks.detokenize(e.tokenizer, prompt, e.lm.vocab_size)
        return tasks.tokenizer_info(e.tokenizer, name, e.lm.max_model_len)

    def _add(self, key: str, msg: dict) -> None:
        from workers.request_params import sampling_params
        from workers.tasks import chat_prompt, end_of_turn_ids

        cid = msg.get("id")
        task = msg.get("task", P.GENERATE)
        try:
            if self.engine is None:
                raise RuntimeError("no model loaded")
            if task in (P.TOKENIZE, P.DETOKENIZE, P.TOKENIZER_INFO):
                answer = self._task(task, msg.get("prompt"), msg.get("params", {}))
                self.output.put_result(key, {"type": P.RESULT, "id": cid, "response": answer})
                return
            prompt = msg["prompt"]
            if task == P.CHAT:
                prompt = chat_prompt(self.engine.tokenizer, prompt, self.spec.name)
            params, echo = sampling_params(msg.get("params", {}), self.spec.model.request_defaults())
            if task == P.CHAT and echo:  # it would prepend the whole rendered template to the reply
                raise ParamError("echo", "echo is a completions parameter: a chat reply is only the new message "
                                 "(send the prompt to /v1/completions with echo for its text and log-probabilities)")
            if msg.get("stream") and params.best_of is not None and params.best_of > params.n:
                # the n best are known only once every sample has ended (OpenAI: best_of's results
                # cannot be streamed); streaming every sample would send more choices than n
                raise ParamError("best_of", f"best_of ({params.best_of}) > n ({params.n}) cannot be streamed: the "
                                 "best samples are known only at the end (leave best_of out, or stream false)")
            if task == P.CHAT and not params.ignore_eos:  # the reply ends with the template's end of turn
                params.stop_token_ids = sorted(set(params.stop_token_ids) | set(end_of_turn_ids(self.engine.tokenizer)))
            # registered first: the output thread must know the request before its first step's output
            self.output.put_request(key, msg, params, echo)
            self.engine.add_request(key, prompt, params)
        except ValueError as exc:  # a ParamError names the parameter
            self.output.put_error(key, cid, P.BAD_REQUEST, str(exc), getattr(exc, "param", None))
        except Exception as exc:  # never let one request take the worker down
            self.output.put_error(key, cid, P.INTERNAL, f"{type(exc).__name__}: {exc}")


def bind_cores(cpus: list[int] | None) -> None:
    """Bind the engine thread, and the OpenMP threads torch starts from it, to the planned cores
    (vLLM binds its CPU workers' threads likewise); cores this process may not use are skipped."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    usable = set(cpus) & os.sched_getaffinity(0)
    if usable:
        os.sched_setaffinity(0, usable)  # 0: the calling thread, on Linux


def echo_response(msg: dict) -> dict:
    prompt = msg.get("prompt")
    text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
    return {"type": P.RESULT, "id": msg.get("id"),
            "response": {"model": "echo", "choices": [{"text": text, "index": 0, "logprobs": None, "token_ids": [],
                                                       "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}}


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        # forked first: before this process has a ZeroMQ context or a thread of its own
        self.output_proc = OutputProcess() if config.output == "process" and not config.echo else None
        self.ctx = zmq.Context()
        self.out_addr = self.output_proc.out_addr if self.output_proc else f"inproc://engine-out-{id(self)}"
        self.pair = self.ctx.socket(zmq.PAIR)
        self.pair.setsockopt(zmq.LINGER, 0)
        self.pair.bind(self.out_addr)
        self.engine = None if config.echo else EngineThread(config.num_threads)
        if config.echo:
            self.output = None
        elif self.output_proc:
            self.output = self.engine.connect_process(self.ctx, self.output_proc)
        else:
            self.output = self.engine.connect(self.ctx, self.out_addr)
        self.worker_id: int | None = None
        self.model_id: int | None = None
        self.unsent = 0  # messages dropped because the router was not reading

    def _capabilities(self) -> dict:
        import torch

        return {"pid": os.getpid(), "host": socket.gethostname(), "echo": self.config.echo, "slot": self.config.slot,
                "threads": self.config.num_threads or torch.get_num_threads(),
                "cuda_devices": torch.cuda.device_count(), "placement": self.config.placement}

    def _engine_stats(self) -> dict:
        """Read from the engine thread's counters (plain ints): for the router's status."""
        e = self.engine
        if e is None:
            return {}
        kv = e.engine.stats() if e.engine is not None else {}
        return {"running": self.output.running(), "aborted": e.aborted, "dropped": e.dropped, **kv}

    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.config.curve_keys:
            connect_curve(sock, self.config.curve_keys, self.config.curve_name)
        sock.connect(self.config.backend)
        self._send(sock, [P.pack({"type": P.READY, "capabilities": self._capabilities()})])
        return sock

    def _parent_alive(self) -> bool:
        pp = self.config.parent_pid
        if pp is None or os.getppid() == pp:
            return True
        try:  # a forked worker's parent is the launcher's server: its starter is another process
            os.kill(pp, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def _send(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        """Never blocks: with the router gone (or not reading) the message is lost, which the router
        handles (it resends a lost worker's requests), where blocking would hang this worker."""
        try:
            send_frames(sock, frames)
        except zmq.Again:
            self.unsent += 1

    def run(self) -> None:
        try:
            self._serve()
        finally:
            self._close()

    def _close(self) -> None:
        threads = (self.engine, self.output) if isinstance(self.output, OutputThread) else (self.engine,)
        for t in threads:
            if t is not None and t.is_alive():
                t.stop.set()
                t.join(self.config.join_timeout)
                if t.is_alive():  # stuck in a step: the output thread's socket stays open, so the
                    # context can't be terminated
                    print(f"worker: {t.name} thread did not stop within {self.config.join_timeout}s; exiting anyway",
                          file=sys.stderr, flush=True)
                    sys.stdout.flush()
                    os._exit(1)
        if isinstance(self.output, OutputLink):
            self.output.close(self.config.join_timeout)
        self.pair.close(linger=0)
        self.ctx.term()

    def _serve(self) -> None:
        cfg = self.config
        if self.engine is not None:
            self.output.start()
            self.engine.start()
        backoff = cfg.reconnect_initial
        sock = self._connect()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.pair, zmq.POLLIN)
        last_heard = time.monotonic()
        next_beat = last_heard + cfg.heartbeat_interval
        try:
            while True:
                timeout = max(0.0, next_beat - time.monotonic())
                events = dict(poller.poll(timeout * 1000))
                now = time.monotonic()
                if sock in events:
                    answers: list[bytes] = []  # the echo's and refusals' data messages, sent as one bundle
                    while (frames := recv_waiting(sock)) is not None:
                        last_heard, backoff = now, cfg.reconnect_initial
                        turn = P.unbundle(frames[0]) if len(frames) == 1 else None
                        if len(frames) == 2:
                            self._on_request(frames[0], frames[1], answers)
                        elif turn is not None:  # the requests of one drain of the router: [header, frame, ...]
                            for i in range(0, len(turn) - 1, 2):
                                self._on_request(turn[i], turn[i + 1], answers)
                        elif not self._on_router(sock, frames[0]):
                            return
                    if answers:
                        self._send(sock, [P.bundle(answers)])
                if self.pair in events:
                    while (frames := recv_waiting(self.pair)) is not None:
                        note = read_note(frames)
                        if note is not None:  # from the output process: a stop string ended a sample
                            self.engine.inbox.put(note)
                            continue
                        # a control message (LOADED, LOAD_FAILED), or a bundle of a turn's data
                        # messages: one frame to the router either way
                        self._send(sock, frames)
                if not self._parent_alive():
                    return
                if self.output_proc is not None and not self.output_proc.alive():
                    print(f"worker: the output process exited ({self.output_proc.returncode}); exiting",
                          file=sys.stderr, flush=True)
                    return
                if now >= next_beat:
                    self._send(sock, [P.pack({"type": P.HEARTBEAT, "engine": self._engine_stats()})])
                    next_beat = now + cfg.heartbeat_interval
                if now - last_heard > cfg.heartbeat_interval * cfg.liveness:
                    # router silent: reconnect with capped exponential backoff, then register again
                    poller.unregister(sock)
                    sock.close(linger=0)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, cfg.reconnect_max)
                    sock = self._connect()
                    poller.register(sock, zmq.POLLIN)
                    last_heard = time.monotonic()
        finally:
            sock.close(linger=0)

    def _on_request(self, head: bytes, frame: bytes, answers: list[bytes]) -> None:
        """Give the request to the engine thread; an answer of this thread's own (a refusal, the
        echo) goes to `answers` as [header, body]."""
        try:
            _, key, _ = P.unpack_header(head)
        except P.ProtocolError:
            return  # no key to answer to; the router never sends this
        try:
            msg = P.unpack(frame, {P.COMPLETE})
            P.CompleteRequest.from_msg(msg)
            P.take_router_seed(msg)
        except P.ProtocolError as exc:
            answers += (P.header(P.ERROR, key), P.pack(P.error(None, exc.code, str(exc))))
            return
        if self.engine is None:
            answers += (P.header(P.RESULT, key), P.pack(echo_response(msg)))
        else:
            self.engine.inbox.put(Submit(key, msg))

    def _on_router(self, sock, frame: bytes) -> bool:
        try:
            msg = P.unpack(frame, {P.ASSIGN, P.CANCEL, P.HEARTBEAT, P.SHUTDOWN})
        except P.ProtocolError:
            return True  # the router only sends valid messages; ignore line noise
        mtype = msg["type"]
        if mtype == P.SHUTDOWN:
            return False
        if mtype == P.ASSIGN:
            model = msg.get("model")
            if not (isinstance(model, dict) and isinstance(msg.get("worker_id"), int)
                    and isinstance(msg.get("model_id"), int)):
                return True  # not an assignment we can act on (a bad spec is answered with load_failed)
            self.worker_id, self.model_id = msg["worker_id"], msg["model_id"]
            if self.engine is None:
                self._send(sock, [P.pack({"type": P.LOADED, "model_id": self.model_id, "worker_id": self.worker_id})])
            else:
                self.engine.inbox.put(Assign(self.model_id, self.worker_id, model))
        elif mtype == P.CANCEL and self.engine is not None and isinstance(msg.get("id"), str):
            self.engine.inbox.put(Cancel(msg["id"]))
        return True


def run_forked(argv: list[str], env: dict[str, str], cwd: str, starter_pid: int) -> None:
    """A worker forked from a launcher's server (fusion.launcher) that has imported torch already.
    It takes the environment and directory its starter has now (the server's are those of when it
    started), and exits when its starter is gone.

    It ignores SIGINT: a terminal's Ctrl-C reaches the deployment's whole process group, and the
    deployment stops its workers itself (the router's shutdown), after what they serve has ended."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    main([*argv, "--parent-pid", str(starter_pid)])


def main(argv: list[str] | None = None) -> None:
    defaults = WorkerConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=defaults.backend)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--heartbeat", type=float, default=defaults.heartbeat_interval)
    ap.add_argument("--echo", action="store_true", help="answer requests without a model")
    ap.add_argument("--curve-keys", help="CurveZMQ keys directory (when the router requires it)")
    ap.add_argument("--curve-name", default=defaults.curve_name, help="this worker's keypair name in it")
    ap.add_argument("--slot", type=int, default=None, help="the deployment plan's worker this process is")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    Worker(WorkerConfig(backend=args.backend, num_threads=args.threads, parent_pid=args.parent_pid,
                        heartbeat_interval=args.heartbeat, echo=args.echo, curve_keys=args.curve_keys,
                        curve_name=args.curve_name, slot=args.slot)).run()


if __name__ == "__main__":
    main()
