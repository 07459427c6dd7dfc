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
    got = attach_remote(addr, key, timeout=120)
    model, tok, info = got.model, got.tokenizer, got.info
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


def _attach_engine(addr: str, key: bytes, prompt: list[int], threads: int, quantization: str, device: str,
                   conn) -> None:
    """A copy as a CUDA deployment's worker loads it (load_model with the owner's address), its engine
    on CUDA's platform rules (on a CPU device: the stand-in of workers.engine.cuda's tests)."""
    import os

    from workers.engine import Engine, EngineConfig
    from workers.engine.params import SamplingParams
    from workers.models import load_model
    from workers.platform import CudaPlatform, for_model
    from workers.weights.owner_ipc import KEY_ENV

    torch.set_num_threads(threads)
    os.environ[KEY_ENV] = key.decode()
    lm = load_model("tiny:llama", dtype="float32", device=device, share_weights=True, owner=addr, one_engine=True)
    cfg = EngineConfig(max_batch_size=4, max_batch_tokens=64, kv_block_size=4, kv_cache_memory=4 << 20,
                       quantization=quantization)
    try:
        eng = Engine(lm, cfg, platform=for_model(lm, True, quantization, cls=CudaPlatform))
    except ValueError as exc:  # a setting the owner's weights cannot serve: said by name
        conn.send({"error": str(exc)})
        return
    out = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    lean = eng.runner.device_lean
    conn.send({"tokens": out.outputs[0].token_ids, "bytes": lm.weights.bytes,
               "meta": sorted(n for n, p in lm.model.named_parameters() if p.is_meta),
               "own_bytes": sum(lin.own_bytes for lin in lean.linears()),
               "blocks_shared": all(lin.quant.qs.is_shared() for lin in lean.linears() if lin.quant is not None),
               "quantized": sum(lin.quant is not None for lin in lean.linears())})
    conn.recv()
    eng.close()


class Copy:
    """One attached copy: `attached()` is what it reported, `release()` lets it exit. It computes
    with as many threads as the process that starts it, whose reference it is compared with bit for bit."""

    def __init__(self, addr: str, key: str, prompt: list[int], quantization: str | None = None, device: str = "cpu"):
        """`quantization`: the copy runs an engine with it (tiny:llama in float32, on the owner's
        `device`) and reports its greedy tokens; None: a transformers forward on the attached model,
        and its logits."""
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self._conn, theirs = ctx.Pipe()
        threads = torch.get_num_threads()
        target, args = ((_attach, (addr, key.encode(), prompt, threads, theirs)) if quantization is None else
                        (_attach_engine, (addr, key.encode(), prompt, threads, quantization, device, theirs)))
        self.proc = ctx.Process(target=target, args=args, daemon=True)
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
