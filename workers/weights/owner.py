"""CUDA copies of a model share one set of weights: a small owner process per (device, source,
dtype) holds them, and every copy attaches through CUDA IPC.

The owner runs no inference, so a copy that crashes cannot take the weights with it; it loads the
model once (through the shared directory of workers.weights.shared, which also gives the copies
their config and tokenizer), moves it to its device, lays out each layer's q/k/v and gate/up
weights side by side (workers.weights.fused_layout: the copies' lean forward then multiplies them
as one linear with no fused copy of its own) and answers each copy that asks with an IPC handle per
tensor. A copy builds its model on the `meta` device and binds the tensors the handles
open. Where its copies run weight-only blocks (`quantization: int8` or `int4` on the lean forward),
the owner builds those blocks once and holds them in place of the linears' 16-bit weights, which
it lets go: a copy binds the rest and leaves those linears on `meta` (workers.weights.blocks_only). The owner exits with its parent (the deployment), which frees the weights when the last
user is gone.

A copy keeps its connection open while it holds the tensors (OwnerLink) and closes it once it has
let them go (Engine.close), or the kernel closes it when the copy's process ends. Told to stop
(SIGTERM), the owner waits, for a bounded time, until every copy's connection is closed, lets go
of its tensors (torch removes the shared-memory files they were the last user of), removes what
is left of its IPC files, and exits without torch's exit handlers, which would close those files
again and abort. It ignores SIGINT, which a terminal's Ctrl-C sends to the whole process group:
the deployment stops it after its copies.

The one seam is `export_tensor` / `import_tensor`: torch.multiprocessing's reductions, which use
CUDA IPC for CUDA tensors. CPU tensors take the same path through torch's `file_system` sharing
(shared memory that torch's manager removes when its last user goes), which is how the owner's
logic is tested on a machine without a GPU.

Handles are torch's own picklable reductions, so they travel over a local, authenticated
`multiprocessing.connection` socket (a key only this deployment knows), never the router's wire.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener
from pathlib import Path

import torch

from workers.devices import device_kind
from workers.gc_pause import import_paused
from workers.platform import for_model, load_dtype
from workers.precision import NO_QUANTIZATION
from workers.quant.fuse import QuantizedLinears, quantized_linears
from workers.quant.weight import from_tensors, to_tensors
from workers.weights import shared as S
from workers.weights.blocks_only import release_linears
from workers.weights.fused_layout import lay_out_fused
from workers.weights.gguf_blocks import gguf_blocks
from workers.weights.hf_loader import load_private
from workers.weights.loaded_model import LoadedModel
from workers.weights.owner_ipc import KEY_ENV, remove_ipc_files
from workers.weights.sources import source_gguf

# --- the seam ---------------------------------------------------------------------------------------------

def export_tensor(t: torch.Tensor):
    """A picklable handle another process turns back into a tensor over the same memory."""
    from torch.multiprocessing.reductions import reduce_tensor

    if device_kind(t.device).host:
        t.share_memory_()
    return reduce_tensor(t)


def collect_exported(device: str) -> None:
    """Free what exported device tensors the copies have released (host memory: torch's manager does)."""
    if not device_kind(device).host:
        torch.cuda.ipc_collect()


def import_tensor(handle) -> torch.Tensor:
    rebuild, args = handle
    return rebuild(*args)


# --- the owner ----------------------------------------------------------------------------------------------

# how long a stopping owner waits for its copies to let go of its tensors (the deployment stops the
# owners after the workers, so they are gone already; a signal to the whole group is the case)
DETACH_WAIT_S = 20.0


class OwnerLink:
    """A copy's open connection to its owner: open while the copy holds the owner's tensors."""

    def __init__(self, conn):
        self._conn = conn

    def close(self) -> None:
        """The copy has let go of the tensors (or is going): the owner may stop."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def blocks_for_copies(model, source: str, dtype: torch.dtype, device: torch.device,
                      quantization: str) -> QuantizedLinears | None:
    """The linears its copies run as weight-only blocks under `quantization`, built here once (as
    their lean forward would: workers.quant.fuse.quantized_linears), their 16-bit weights let go
    (workers.weights.blocks_only); None where the copies run no blocks. A setting the model cannot
    have here builds none: each copy then loads the 16-bit weights and refuses it by name."""
    if quantization == NO_QUANTIZATION:
        return None
    try:
        platform = for_model(LoadedModel(model, None, source, dtype, device, 0), True, quantization)
    except ValueError:
        return None
    prec = platform.precision
    if not (platform.lean and prec.quantized):
        return None
    path = source_gguf(source)
    built = QuantizedLinears(prec.quantized_key, quantized_linears(model, prec, gguf_blocks(path, model) if path else None))
    release_linears(model, built.modules)
    return built


def export_blocks(built: QuantizedLinears) -> dict:
    tensors, kinds = to_tensors(built.weights)
    return {"key": built.key, "kinds": kinds, "handles": {name: export_tensor(t) for name, t in tensors.items()}}


def import_blocks(answer: dict) -> QuantizedLinears:
    tensors = {name: import_tensor(handle) for name, handle in answer["handles"].items()}
    return QuantizedLinears(answer["key"], from_tensors(tensors, answer["kinds"]))


class WeightOwner:
    def __init__(self, source: str, dtype: str, device: str, address: str, authkey: bytes,
                 parent_pid: int | None = None, quantization: str = NO_QUANTIZATION):
        """`quantization`: what its copies run (a precision's quantized_key): where that is weight-only
        blocks, it holds those in place of their linears' 16-bit weights (blocks_for_copies)."""
        self.source, self.device, self.address, self.authkey = source, device, address, authkey
        self.dtype, self.quantization = dtype, quantization
        self.parent_pid = parent_pid
        self.attached = 0  # copies answered
        self.holding = 0  # copies whose connection is open: they may hold the tensors
        self._changed = threading.Condition()

    def load(self) -> dict:
        """Load once and build the answer every copy gets: the directory and one handle per tensor."""
        dev = torch.device(self.device)
        dt = load_dtype(self.dtype, dev, False, None)
        host = device_kind(dev).host
        if host:
            torch.multiprocessing.set_sharing_strategy("file_system")  # no fd passing between strangers
        dest = S.shared_dir(self.source, dt)
        model, _, _ = S.load_shared(self.source, dt, lambda: load_private(self.source, dt))
        model.to(dev)  # from the mapping into this device's memory: the one copy there
        if host:  # the read-only file views can't move to shared memory: copy them once
            tensors, aliases = S.unique_tensors(model)
            S.bind_all(model, {k: t.clone() for k, t in tensors.items()}, aliases, self.source)
        # q/k/v and gate/up side by side: the copies' lean forward multiplies these views as one
        # linear, with no fused copy of its own (workers.weights.fused_layout)
        laid = lay_out_fused(model)
        built = blocks_for_copies(model, self.source, dt, dev, self.quantization)
        if (laid or built is not None) and not host:
            torch.cuda.empty_cache()  # the weights' former places
        tensors, aliases = S.unique_tensors(model)
        released = sorted(name for name, t in tensors.items() if t.is_meta)
        released += sorted(name for name, target in aliases.items() if target in released)
        tensors = {name: t for name, t in tensors.items() if not t.is_meta}
        aliases = {name: target for name, target in aliases.items() if target in tensors}
        self.model, self.tensors, self.built = model, tensors, built  # kept alive: the copies' tensors are this memory
        return {"dir": str(dest), "dtype": str(dt).removeprefix("torch."), "aliases": aliases, "released": released,
                "handles": {name: export_tensor(t) for name, t in tensors.items()},
                "quantized": None if built is None else export_blocks(built)}

    def _watch_parent(self) -> None:
        while self.parent_pid is None or os.getppid() == self.parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)  # the deployment is gone: so are the copies that used these weights

    def serve(self) -> None:
        """Serve until SIGTERM (or the parent's end), then let go of the tensors: the caller ends
        the process with `leave`."""
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self._serve()
        finally:
            self.wait_detached(DETACH_WAIT_S)
            self.release()

    def release(self) -> None:
        """Drop this process's references to its tensors, so that torch frees them now and removes
        the shared-memory files whose last user they were, before `leave` removes the rest."""
        self.model = self.tensors = self.built = None
        gc.collect()
        collect_exported(self.device)

    def wait_detached(self, timeout: float) -> bool:
        """Wait until no copy holds a connection (True), or `timeout` seconds (False)."""
        with self._changed:
            return self._changed.wait_for(lambda: self.holding == 0, timeout)

    def _hold(self, conn) -> None:
        """A copy's connection, open until it closes it or its process ends."""
        try:
            while True:
                conn.recv()  # a copy sends nothing more: this returns only with EOF
        except (OSError, EOFError):
            pass
        finally:
            conn.close()
            with self._changed:
                self.holding -= 1
                self._changed.notify_all()

    def _serve(self) -> None:
        answer = self.load()
        with Listener(self.address, family="AF_UNIX", authkey=self.authkey) as listener:
            threading.Thread(target=self._watch_parent, daemon=True).start()
            blocks = "" if answer["quantized"] is None else f", its linears as {answer['quantized']['key']} blocks"
            print(f"weight owner: {self.source} on {self.device}{blocks} at {self.address}", flush=True)
            while True:
                try:
                    conn = listener.accept()
                except Exception:  # noqa: BLE001 - a bad key, a peer gone: the next one may be fine
                    continue
                counted = False
                try:
                    if conn.recv() != "attach":
                        conn.close()
                        continue
                    with self._changed:
                        self.holding += 1  # before the handles go: a stop from now on waits for it
                    counted = True
                    conn.send(answer)
                except (OSError, EOFError):
                    conn.close()
                    if counted:
                        with self._changed:
                            self.holding -= 1
                            self._changed.notify_all()
                    continue
                self.attached += 1
                threading.Thread(target=self._hold, args=(conn,), daemon=True).start()


@dataclass(slots=True)
class Attached:
    """A copy's model over its owner's tensors. Keep `link` open while the model is in use; close it
    once its tensors are let go."""

    model: torch.nn.Module
    tokenizer: object
    info: S.WeightsInfo
    link: OwnerLink
    quantized: QuantizedLinears | None  # the owner's blocks, where its copies run them (blocks_for_copies)


def attach_remote(address: str, authkey: bytes, timeout: float = 300.0) -> Attached:
    """A copy whose weights live in the owner at `address`: its model, with the linears the owner
    holds as blocks only left on `meta`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = Client(address, family="AF_UNIX", authkey=authkey)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise S.SharedWeightsError(f"no weight owner answered at {address} within {timeout:g}s") from None
            time.sleep(0.1)  # the owner is still loading
    try:
        conn.send("attach")
        answer = conn.recv()
    except BaseException:
        conn.close()
        raise
    link = OwnerLink(conn)
    dt = getattr(torch, answer["dtype"])
    model, tok = S.build_meta(Path(answer["dir"]), dt)
    tensors = {name: import_tensor(handle) for name, handle in answer["handles"].items()}
    nbytes = S.bind_all(model, tensors, answer["aliases"], address, frozenset(answer["released"]))
    built = None if answer["quantized"] is None else import_blocks(answer["quantized"])
    nbytes += 0 if built is None else built.nbytes
    return Attached(model.eval(), tok, S.WeightsInfo(nbytes, True, f"owner:{address}"), link, built)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Own one model's weights on a device for its copies.")
    ap.add_argument("--source", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", required=True)
    ap.add_argument("--address", required=True, help="the unix socket path copies attach at")
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--quantization", default=NO_QUANTIZATION,
                    help="what its copies run (a precision's quantized key): weight-only blocks are held in place "
                         "of their linears' 16-bit weights")
    args = ap.parse_args(argv)
    key = os.environ.get(KEY_ENV, "").encode()
    if not key:
        sys.exit(f"weight owner: set {KEY_ENV} to the deployment's key")
    code = 0
    import_paused("workers.models")  # what its load imports (torch and transformers), collector paused
    try:
        WeightOwner(args.source, args.dtype, args.device, args.address, key, args.parent_pid, args.quantization).serve()
    except SystemExit as exc:  # SIGTERM
        code = exc.code if isinstance(exc.code, int) else 1
    except (ValueError, OSError, S.SharedWeightsError) as exc:  # a bad source, a missing file: say which
        print(f"weight owner: cannot serve {args.source} on {args.device}: {exc}", file=sys.stderr)
        code = 1
    except BaseException:  # noqa: BLE001 - said, then the same ending
        traceback.print_exc()
        code = 1
    leave(code)


def leave(code: int) -> None:
    """End the owner: remove what its IPC left in /dev/shm (its parent may be gone, SIGKILLed, and
    nobody else would), then exit without the interpreter's and torch's exit handlers. Those would
    close torch's CUDA IPC reference-counter files again, find them removed and abort ("could not
    unlink the shared memory file"); the tensors were let go of already (WeightOwner.release)."""
    remove_ipc_files(os.getpid())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
