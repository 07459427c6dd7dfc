"""A copy that attaches to a weight owner (workers.weights.owner), forked from the preloaded
server as a deployment's workers are (fusion.launcher): a fresh interpreter would spend seconds of
CPU importing torch and transformers before it could attach."""

from __future__ import annotations

import multiprocessing

import torch

from fusion.launcher import PRELOAD


def _attach(addr: str, key: bytes, prompt: list[int], threads: int, conn) -> None:
    from workers.weights.fused_layout import groups, side_by_side
    from workers.weights.owner import attach_remote

    torch.set_num_threads(threads)  # as the starter: a sum split across more threads rounds differently
    model, tok, info, _link = attach_remote(addr, key, timeout=120)
    dev = next(model.parameters()).device
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    with torch.inference_mode():
        logits = model(torch.tensor([prompt], device=dev)).logits[0].float().cpu()
    conn.send({"logits": logits.tolist(), "shared": info.shared, "bytes": info.bytes, "device": str(dev),
               "all_shared": all(p.is_shared() for p in model.parameters()), "cuda_allocated_by_copy": before,
               "eos": tok.eos_token_id,
               # groups whose lean forward would need a fused copy of its own (not side by side)
               "groups": len(groups(model)),
               "groups_apart": sum(side_by_side([m.weight for m in g]) is None for g in groups(model))})
    conn.recv()  # hold the weights until told to go


class Copy:
    """One attached copy: `attached()` is what it reported, `release()` lets it exit. It computes
    with as many threads as the process that starts it, whose reference it is compared with bit for bit."""

    def __init__(self, addr: str, key: str, prompt: list[int]):
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self._conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_attach, args=(addr, key.encode(), prompt, torch.get_num_threads(), theirs), daemon=True)
        self.proc.start()
        theirs.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def attached(self, timeout: float = 180) -> dict:
        assert self._conn.poll(timeout), "the copy did not attach in time"
        try:
            return self._conn.recv()
        except EOFError:
            raise AssertionError(f"the copy could not attach (exit code {self.proc.exitcode})") from None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()

    def release(self, timeout: float = 60) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send("go")
            except OSError:  # it ended meanwhile
                pass
        self.proc.join(timeout)
        self._conn.close()
