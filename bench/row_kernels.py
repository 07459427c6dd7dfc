"""bench/engine.py's `row_kernels` part: the kernel each quantized linear takes per row bucket, with
the timings behind the choice, and where the 16-bit path (`quantization: none`) overtakes it.

For each distinct layer linear of the model (SmolLM2: q/k/v, o, gate/up, down), at each bucket of
workers.engine.cpu.row_kernels: ms a call of the blocks' kernel (and with the activations in 8 bits,
`act8`, at the row counts its choice gives them), of the widened GEMM, of the AMX
tiles on the values packed in bfloat16 (where the CPU has them), of ATen's float32 GEMM on the
values widened once to float32 (on a bfloat16 CPU without the tiles), and of the
same linear as `quantization: none` packs it (oneDNN's bfloat16, FBGEMM's float16 or float32), and
the way the engine chose. Then one summary line: the row count from which `none` is faster than
what `auto` runs, per linear (the bf16/auto crossover; null: never within the buckets).
"""

from __future__ import annotations

import torch

from workers.engine import Engine, EngineConfig
from workers.engine.cpu import row_kernels
from workers.engine.cpu.calibrate import best_seconds
from workers.engine.cpu.linears import float32_fits, pack_for_tiles, tiles_fit, widen_to_float32


def _layer_linears(eng: Engine) -> list:
    layer = eng.runner.lean.layers[0]
    return [layer.qkv, layer.o, layer.gate_up, layer.down]


def report(lm, quantization: str, max_rows: int) -> list[dict]:
    """JSON rows: one per (linear, bucket), then the crossover summary."""
    auto = Engine(lm, EngineConfig(max_batch_size=64, max_batch_tokens=max_rows, quantization=quantization))
    if auto.runner.lean is None or not auto.kernels:
        return [{"system": "row_kernels", "skipped": "no quantized linears with a choice on this path",
                 "precision": auto.precision.describe()}]
    none = Engine(lm, EngineConfig(max_batch_size=64, max_batch_tokens=max_rows, quantization="none"))
    rows_out: list[dict] = []
    crossover: dict[str, int | None] = {}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for lin, dense in zip(_layer_linears(auto), _layer_linears(none), strict=True):
            if lin.quant is None:
                continue
            name = f"{lin.quant.kind} {lin.shape[0]}x{lin.shape[1]}"
            crossover[name] = None
            # the AMX tiles' way where the CPU has it (the engine keeps the packed values only where chosen)
            tiles = (pack_for_tiles(lin.kernels, {name: lin.quant})[name]
                     if auto.precision.compute == torch.bfloat16 and tiles_fit(lin.kernels, lin.shape) else None)
            if lin.wide32 is None and tiles is None and float32_fits(lin.kernels, auto.precision.compute):
                lin.wide32 = widen_to_float32({name: lin.quant})[name]  # read by its way only
            for rows in row_kernels.bucket_rows(max_rows):
                # both paths compute in float32 on a CPU without bf16 arithmetic, in bfloat16 with it
                x = torch.randn(rows, lin.shape[1], generator=gen).to(auto.precision.compute)
                ways = [(row_kernels.BLOCKS, lambda x, q=lin: q.blocks(x, 0)), (row_kernels.WIDENED, lin.widened),
                        ("none", dense)]
                if rows <= lin.act8:  # the blocks with the activations in 8 bits, as chosen up to lin.act8 rows
                    ways.insert(1, (row_kernels.ACT8, lin.blocks))
                if tiles is not None:
                    ways.insert(2, (row_kernels.PACKED, lambda x, p=tiles, q=lin: q.kernels.bf16_packed_linear(x, p, q.bias)))
                if lin.wide32 is not None:
                    ways.insert(2, (row_kernels.FLOAT32, lin.float32))
                ms = {way: 1e3 * best_seconds(lambda fn=fn, x=x: fn(x)) for way, fn in ways}
                chosen = lin.rows.way(rows) if lin.rows is not None else row_kernels.BLOCKS
                if chosen == row_kernels.BLOCKS and rows <= lin.act8:
                    chosen = row_kernels.ACT8
                if crossover[name] is None and ms["none"] < ms[chosen]:
                    crossover[name] = rows
                rows_out.append({"system": "row_kernels", "linear": name, "rows": rows, "chosen": chosen,
                                 **{f"{k}_ms": round(v, 4) for k, v in ms.items()}, "none_path": dense.path})
    rows_out.append({"summary": "row_kernels", "chosen": auto.kernels, "precision_auto": auto.precision.describe(),
                     "precision_none": none.precision.describe(), "none_faster_from_rows": crossover})
    return rows_out
