"""CUDA copies of a model share one set of weights: a small owner process per (device, source,
dtype) holds them, and every copy attaches through CUDA IPC.

The owner runs no inference, so a copy that crashes cannot take the weights with it; it loads the
model once (through the shared directory of workers.weights.shared, which also gives the copies
their config and tokenizer), moves it to its device and answers each copy that asks with an IPC
handle per tensor. A copy builds its model on the `meta` device and binds the tensors the handles
open. The owner exits with its parent (the deployment), which frees the weights when the last
user is gone.

The one seam is `export_tensor` / `import_tensor`: torch.multiprocessing's reductions, which use
CUDA IPC for CUDA tensors. CPU tensors take the same path through torch's `file_system` sharing
(shared memory that torch's manager removes when its last user goes), which is how the owner's
logic is tested on a machine without a GPU.

Handles are torch's own picklable reductions, so they travel over a local, authenticated
`multiprocessing.connection` socket (a key only this deployment knows), never the router's wire.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

import torch

from workers.devices import device_kind
from workers.platform import load_dtype
from workers.weights import shared as S
from workers.weights.hf_loader import load_private
from workers.weights.owner_ipc import KEY_ENV, remove_ipc_files

# --- the seam ---------------------------------------------------------------------------------------------

def export_tensor(t: torch.Tensor):
    """A picklable handle another process turns back into a tensor over the same memory."""
    from torch.multiprocessing.reductions import reduce_tensor

    if device_kind(t.device).host:
        t.share_memory_()
    return reduce_tensor(t)


def import_tensor(handle) -> torch.Tensor:
    rebuild, args = handle
    return rebuild(*args)


# --- the owner ----------------------------------------------------------------------------------------------

class WeightOwner:
    def __init__(self, source: str, dtype: str, device: str, address: str, authkey: bytes,
                 parent_pid: int | None = None):
        self.source, self.device, self.address, self.authkey = source, device, address, authkey
        self.dtype = dtype
        self.parent_pid = parent_pid
        self.attached = 0

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
        tensors, aliases = S.unique_tensors(model)
        if host:  # the read-only file views can't move to shared memory: copy them once
            tensors = {k: t.clone() for k, t in tensors.items()}
        self.model, self.tensors = model, tensors  # kept alive: the copies' tensors are this memory
        return {"dir": str(dest), "dtype": str(dt).removeprefix("torch."), "aliases": aliases,
                "handles": {name: export_tensor(t) for name, t in tensors.items()}}

    def _watch_parent(self) -> None:
        while self.parent_pid is None or os.getppid() == self.parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)  # the deployment is gone: so are the copies that used these weights

    def serve(self) -> None:
        # a clean exit on SIGTERM: torch and the CUDA driver then remove their IPC bookkeeping
        # files from /dev/shm, which a process killed outright would leave behind
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            self._serve()
        finally:  # its parent may be gone (SIGKILLed): nobody else would remove these
            remove_ipc_files(os.getpid())

    def _serve(self) -> None:
        answer = self.load()
        with Listener(self.address, family="AF_UNIX", authkey=self.authkey) as listener:
            threading.Thread(target=self._watch_parent, daemon=True).start()
            print(f"weight owner: {self.source} on {self.device} at {self.address}", flush=True)
            while True:
                try:
                    conn = listener.accept()
                except Exception:  # noqa: BLE001 - a bad key, a peer gone: the next one may be fine
                    continue
                with conn:
                    try:
                        if conn.recv() == "attach":
                            conn.send(answer)
                            self.attached += 1
                    except (OSError, EOFError):
                        pass


def attach_remote(address: str, authkey: bytes, timeout: float = 300.0):
    """(model, tokenizer, WeightsInfo) for a copy whose weights live in the owner at `address`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = Client(address, family="AF_UNIX", authkey=authkey)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise S.SharedWeightsError(f"no weight owner answered at {address} within {timeout:g}s") from None
            time.sleep(0.1)  # the owner is still loading
    with conn:
        conn.send("attach")
        answer = conn.recv()
    dt = getattr(torch, answer["dtype"])
    model, tok = S.build_meta(Path(answer["dir"]), dt)
    tensors = {name: import_tensor(handle) for name, handle in answer["handles"].items()}
    nbytes = S.bind_all(model, tensors, answer["aliases"], address)
    return model.eval(), tok, S.WeightsInfo(nbytes, True, f"owner:{address}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Own one model's weights on a device for its copies.")
    ap.add_argument("--source", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", required=True)
    ap.add_argument("--address", required=True, help="the unix socket path copies attach at")
    ap.add_argument("--parent-pid", type=int, default=None)
    args = ap.parse_args(argv)
    key = os.environ.get(KEY_ENV, "").encode()
    if not key:
        sys.exit(f"weight owner: set {KEY_ENV} to the deployment's key")
    try:
        WeightOwner(args.source, args.dtype, args.device, args.address, key, args.parent_pid).serve()
    except (ValueError, OSError, S.SharedWeightsError) as exc:  # a bad source, a missing file: say which
        sys.exit(f"weight owner: cannot serve {args.source} on {args.device}: {exc}")


if __name__ == "__main__":
    main()
