"""Starting worker processes fast: forked from a server process that has already imported torch,
transformers and the worker (multiprocessing's forkserver, preloaded), instead of a fresh
interpreter each, which spends seconds of CPU on imports before it can load a model. A crashed
worker is back in a fraction of a second, and a deployment of many copies starts sooner.

Each worker is still a process of its own, with its own memory, sockets and engine. The fork server
runs no model and opens no socket, so forking it is safe. Each worker follows the process that
started it, not the server: the server lives as long as any worker it forked does, so a starter
killed with SIGKILL would otherwise leave both running for ever. Its workers exit when it is gone,
and the server after them. A command line that is done stops its server at once (stop_server).
predict and eval also make their plan in a process forked from it (call_in_server), so that their
command line never imports torch.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import subprocess

from workers.weights.held_tokenizers import HOLD_ENV

# imported once in the fork server: what every worker would otherwise import on its own
PRELOAD = ["workers.preload"]


class WorkerProcess:
    """A forked worker, with the part of subprocess.Popen's interface a supervisor uses."""

    def __init__(self, proc: multiprocessing.Process):
        self._proc = proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """As Popen's: None while it runs, else the exit code, or minus the signal that ended it."""
        return self._proc.exitcode

    def poll(self) -> int | None:
        return None if self._proc.is_alive() else self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"worker process {self.pid}", timeout)
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()

    def terminate(self) -> None:
        self._proc.terminate()


def fork_servers(pid: int) -> list:
    """The fork servers of process `pid` (psutil Processes)."""
    import psutil

    def command(child) -> str:
        try:
            return " ".join(child.cmdline())
        except psutil.Error:  # exited since (a zombie not yet reaped has no command line): no server
            return ""

    return [c for c in psutil.Process(pid).children() if "forkserver" in command(c)]


def forked_workers(pid: int) -> list:
    """The worker processes that process `pid` started through this launcher (psutil Processes): the
    children of its fork server. Their command line is the server's, so only the tree tells them apart."""
    return [w for s in fork_servers(pid) for w in s.children()]


def stop_server() -> None:
    """End this process's fork server now; call it when this process will start no more workers and
    those it started have exited. Left alone, the server ends only after its preload (seconds, if
    the starter stops early) and then tears down all it imported (seconds more), holding the
    starter's stdout and stderr all along: whoever reads them (a pipe, `subprocess.run`) waits.
    It holds no state: a kill loses nothing."""
    import psutil

    for server in fork_servers(os.getpid()):
        try:
            server.kill()
        except psutil.NoSuchProcess:
            pass


def start_server(hold_tokenizers: list[str] | tuple[str, ...] = ()) -> None:
    """Start the fork server now, without waiting for it: its imports (seconds of CPU) then overlap
    whatever the starter does before its first start_worker, which finds the server ready sooner.
    `hold_tokenizers`: model sources whose tokenizers the server builds once, from the shared
    weights' cache, for every copy it forks (workers.weights.held_tokenizers)."""
    import json
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    # the server inherits this process's environment when it starts, and only then: set for that moment
    before = os.environ.get(HOLD_ENV)
    os.environ[HOLD_ENV] = json.dumps(sorted(set(hold_tokenizers)))
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            os.environ.pop(HOLD_ENV, None)
        else:
            os.environ[HOLD_ENV] = before


def start_worker(argv: list[str], env: dict[str, str] | None = None) -> WorkerProcess:
    """A worker process running `python -m workers.worker ARGV` in this process's environment (plus
    `env`) and directory, forked from the preloaded server (started on first use).

    As with any multiprocessing start method but fork, a script that starts workers must guard its
    entry point with `if __name__ == "__main__":` (run_mm.py and the other entry points do)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    # daemon: a worker still running when this process exits is terminated, as an orphan would exit
    proc = ctx.Process(target=_run_worker, args=(list(argv), {**os.environ, **(env or {})}, os.getcwd(), os.getpid()),
                       name="mmfusion-worker", daemon=True)
    proc.start()
    return WorkerProcess(proc)


def call_in_server(fn: str, *args):
    """`fn(*args)` ("module:function") computed in a process forked from the preloaded server, its
    result (or exception) sent back pickled: the server has imported torch already, so this process
    need not (seconds of CPU for a command line that only starts workers)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_call, args=(fn, args, send), name="mmfusion-call", daemon=True)
    proc.start()
    send.close()
    try:
        ok, value = receive.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"{fn} ended without an answer (exit code {proc.exitcode})") from None
    finally:
        receive.close()
    proc.join()
    if not ok:
        raise value
    return value


def _call(fn: str, args: tuple, send) -> None:
    module, name = fn.split(":")
    try:
        answer = (True, getattr(importlib.import_module(module), name)(*args))
    except Exception as exc:  # the caller raises it: a bad setting is its error to report
        answer = (False, exc)
    send.send(answer)
    send.close()


def _run_worker(argv: list[str], env: dict[str, str], cwd: str, starter_pid: int) -> None:
    """The target the fork server runs, named here so that the starter never imports the worker (in
    the server it is preloaded): torch, transformers and the engine would cost the starter seconds to
    import and seconds more at exit."""
    from workers.worker import run_forked

    run_forked(argv, env, cwd, starter_pid)
