"""What torch's own weight-quantized linears give on this CPU, against the linears that serve today,
on SmolLM2-135M's shapes (one decode step's linears: q/k/v fused, o, gate/up fused, down, the LM
head), for 1 and 8 rows. One JSON line per (kernel, rows): the microseconds of all of a layer's
linears and of the LM head, the weight bytes each reads, and the error against float32 math on the
same (dequantized) weights. Every figure is from this run, best of --repeats.

Kernels (each where this torch build and CPU have it; a line says why not otherwise):
  bf16_onednn:  today's bfloat16 path (oneDNN-prepacked; workers.engine.cpu.linears, CPUs with bf16)
  fp16_fbgemm:  today's float16-weights, float32-math path (FBGEMM; CPUs without bf16 arithmetic)
  int8_pack:    torch.ops.aten._weight_int8pack_mm (int8 weights per output channel, bf16/fp32 rows)
  int4_pack:    torch.ops.aten._weight_int4pack_mm_for_cpu (int4 in groups of 32; bf16 or fp32 rows)
  int8_dynamic: FBGEMM's dynamic int8 linear (quantized.linear_dynamic: rows quantized per call)

    python bench/quant_linears.py [--threads 2] [--repeats 20]

--model: instead, every linear of SmolLM2 (30 layers and the LM head, about 135M weights: they
stream from memory as in a decode step, not from cache) for --rows rows, one JSON line per
(kernel, rows) with the ms of one pass: today's bf16 and fp16 linears against the engine's
weight-only int4 and int8 kernels (workers/engine/cpu/kernels/qlinear.cpp, `quantization`), with
bfloat16 and float32 activations.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench.engine import emit  # noqa: E402
from bench.machine import describe  # noqa: E402
from workers.engine.cpu.calibrate import best_seconds  # noqa: E402

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads and 3 KV heads of 64, vocabulary 49,152
LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = {"lm_head": (49152, 576)}
GROUP = 32  # int4 group size


def _int8(w: torch.Tensor):
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scale, q.float() * scale[:, None]


def _int4(w: torch.Tensor):
    """Asymmetric int4 in groups of GROUP along the input, as torch's CPU int4 kernel takes it."""
    n, k = w.shape
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = lo + scale * 8  # the kernel's zero point: w = (q - 8) * scale + zero
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    deq = ((q.float() - 8) * scale[..., None] + zero[..., None]).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(n, k), 1)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, scales_zeros, deq


def kernels(weights: dict[str, torch.Tensor]):
    """name -> (build(w) -> (fn(x) -> y, reference float32 weight, bytes read), activation dtype)."""
    from workers.engine.cpu.linears import Linear
    from workers.precision import FP16, ONEDNN, onednn_packs

    out = {}
    if onednn_packs(torch.bfloat16):
        def bf16(w):
            lin = Linear(w.to(torch.bfloat16), None, ONEDNN)
            return lin, w.to(torch.bfloat16).float(), w.numel() * 2
        out["bf16_onednn"] = (bf16, torch.bfloat16)
    if torch.backends.quantized.supported_engines and "fbgemm" in torch.backends.quantized.supported_engines:
        def fp16(w):
            lin = Linear(w.half(), None, FP16, compute=torch.float32)
            return lin, w.half().float(), w.numel() * 2
        out["fp16_fbgemm"] = (fp16, torch.float32)

        def dyn(w):
            q, scale, deq = _int8(w)
            qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(w.shape[0], dtype=torch.long), 0,
                                            torch.qint8)
            packed = torch.ops.quantized.linear_prepack(qw, None)
            return (lambda x: torch.ops.quantized.linear_dynamic(x, packed)), deq, w.numel()
        out["int8_dynamic"] = (dyn, torch.float32)
    for act in (torch.bfloat16, torch.float32):
        def i8(w, act=act):
            q, scale, deq = _int8(w)
            s = scale.to(act)
            return (lambda x: torch.ops.aten._weight_int8pack_mm(x, q, s)), deq, w.numel()
        out[f"int8_pack_{str(act).removeprefix('torch.')}"] = (i8, act)
    for act in (torch.bfloat16, torch.float32):
        def i4(w, act=act):
            packed, sz, deq = _int4(w)
            sz = sz.to(act)
            return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)), deq, w.numel() // 2
        out[f"int4_pack_{str(act).removeprefix('torch.')}"] = (i4, act)
    return out


def model_pass(args) -> None:
    """Every SmolLM2 linear once per pass, for each kernel and row count (see the module)."""
    from workers.engine.cpu import extension
    from workers.engine.cpu.linears import Linear, quantized
    from workers.precision import FP16, ONEDNN, onednn_packs
    from workers.quant.weight import INT4, INT8

    gen = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(30) for shape in LAYER.values()] + list(HEAD.values())
    modules = []
    for n, k in shapes:
        m = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            m.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        modules.append(m)
    module = extension.kernel_module()
    systems = {}
    if onednn_packs(torch.bfloat16):
        systems["bf16_onednn"] = (lambda m: Linear(m.weight.bfloat16(), None, ONEDNN), torch.bfloat16)
    systems["fp16_fbgemm"] = (lambda m: Linear(m.weight.half(), None, FP16, compute=torch.float32), torch.float32)
    for kind in (INT4, INT8):
        for act in (torch.bfloat16, torch.float32):
            systems[f"{kind}_{str(act).removeprefix('torch.')}"] = (
                lambda m, kind=kind, act=act: quantized([m], kind, {}, act, module, ONEDNN), act)
    for name, (build, act) in systems.items():
        linears = [build(m) for m in modules]
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=gen).to(act) for k in {k for _, k in shapes}}
            with torch.inference_mode():
                ms = best_seconds(lambda xs=xs, linears=linears: [f(xs[k]) for f, (_, k) in zip(linears, shapes)],
                                  args.repeats) * 1e3
            emit(kernel=name, rows=rows, model_linears_ms=round(ms, 2), activations=str(act).removeprefix("torch."),
                 weight_bytes=sum(f.own_bytes for f in linears), threads=args.threads,
                 quantized_kernels=module is not None)
        del linears


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--model", action="store_true", help="every SmolLM2 linear, streaming from memory")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16, 64])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    emit(**describe("quant_linears", sys.argv))
    if args.model:
        model_pass(args)
        return
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(*shape, generator=gen) * 0.05 for name, shape in {**LAYER, **HEAD}.items()}
    for kname, (build, act) in kernels(weights).items():
        try:
            built = {name: build(w) for name, w in weights.items()}
        except (RuntimeError, NotImplementedError) as exc:
            emit(kernel=kname, available=False, why=f"{type(exc).__name__}: {str(exc)[:200]}")
            continue
        for rows in (1, 8):
            x = {name: torch.randn(rows, w.shape[1], generator=gen) for name, w in weights.items()}
            xa = {name: v.to(act) for name, v in x.items()}
            with torch.inference_mode():
                layer = best_seconds(lambda built=built, xa=xa: [built[n][0](xa[n]) for n in LAYER], args.repeats)
                head = best_seconds(lambda built=built, xa=xa: built["lm_head"][0](xa["lm_head"]), args.repeats)
                err = max(float((built[n][0](xa[n]).float() - xa[n].float() @ built[n][1].T).abs().max()
                                / (xa[n].float() @ built[n][1].T).abs().max()) for n in weights)
            emit(kernel=kname, rows=rows, activations=str(act).removeprefix("torch."),
                 layer_linears_us=round(layer * 1e6, 1), lm_head_us=round(head * 1e6, 1),
                 layer_weight_bytes=sum(built[n][2] for n in LAYER), lm_head_weight_bytes=built["lm_head"][2],
                 max_rel_error=round(err, 5), threads=args.threads)


if __name__ == "__main__":
    main()
