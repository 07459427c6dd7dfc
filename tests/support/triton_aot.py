"""Compile the CUDA room's Triton kernels for a Hopper GPU (sm_90) on a machine without one, the way
the decode path launches them: in bfloat16 (and float32 where the code differs with the dtype),
with SmolLM2's head shape and Gemma 3 270M's. Run as a script,
without TRITON_INTERPRET (the kernels must be defined compiled). Prints one line a kernel; exits
non-zero at the first that does not compile, with Triton's error.

Triton's compiler runs to the GPU's machine code here (its package carries ptxas), so what fails
at the first launch on a GPU (a dot too small for its operand types, a loop-carried value whose type
changes, a layout the backend cannot lower) fails here instead."""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from workers.engine.cuda import (  # noqa: E402
    triton_attention,
    triton_decode,
    triton_fused,
    triton_gemma,
    triton_invariant,
    triton_qlinear,
    triton_splits,
)

TARGET = GPUTarget("cuda", 90, 32)
INDEX = {"tables_ptr", "rows_ptr", "lengths_ptr", "pos_ptr", "slots_ptr"}  # int64 on the device
PARTIALS = {"part_ptr", "max_ptr", "sum_ptr"}  # the split attention's float32 partials
FLOATS = {"scale", "eps"}


def signature(fn, dtype: str, consts: dict, pointers: dict | None = None) -> dict:
    """Triton's signature of `fn`: a pointer's element type by its name, float scalars by name,
    other scalars int32, and the constants given."""
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif pointers and name in pointers:
            sig[name] = pointers[name]
        elif name.endswith("_ptr"):
            sig[name] = "*i64" if name in INDEX else "*fp32" if name in PARTIALS else f"*{dtype}"
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


def compile_one(fn, dtype: str, consts: dict, pointers: dict | None = None) -> None:
    names = fn.arg_names
    src = ASTSource(fn, signature(fn, dtype, consts, pointers),
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    triton.compile(src, target=TARGET)
    print(f"compiled {fn.__name__} {dtype} {sorted(consts.items())}", flush=True)


def main() -> None:
    heads, kvh, d = 9, 3, 64  # SmolLM2-135M's attention
    g = heads // kvh
    compile_one(triton_decode._segment_kernel, "bf16",
                dict(HEADS=heads, G=g, G_PAD=max(2, triton.next_power_of_2(g)), D=d, D_PAD=d, DV=d, DV_PAD=d,
                     SEG=triton_decode.SEGMENT))
    compile_one(triton_decode._merge_kernel, "bf16",
                dict(HEADS=heads, DV=d, DV_PAD=d, SEG=triton_decode.SEGMENT, CHUNK=triton_decode.MERGE))
    compile_one(triton_attention._paged_attention_kernel, "bf16",
                dict(G=g, G_PAD=max(2, triton.next_power_of_2(g)), D=d, D_PAD=d, DV=d, DV_PAD=d, BLOCK_N=16))
    compile_one(triton_attention._kv_write_kernel, "bf16", dict(D=d, DV=d, D_PAD=d, DV_PAD=d))
    for has_res in (True, False):
        compile_one(triton_fused._add_rms_norm_kernel, "bf16", dict(N=576, N_PAD=1024, HAS_RES=has_res))
    compile_one(triton_fused._rope_kv_write_kernel, "bf16", dict(HEADS=heads, KVH=kvh, D=d, D_PAD=d))
    for gelu in (False, True):
        compile_one(triton_fused._act_mul_kernel, "bf16", dict(BLOCK=1024, GELU=gelu))
    # the kernels whose code differs with the activations' dtype, in both (float32: IEEE dots;
    # bfloat16: the tensor cores)
    for dtype in ("bf16", "fp32"):
        # the default tiles, and (16-bit) every candidate tile_choice times, ranges of inputs included
        for tiles in (triton_invariant.DEFAULT, *(triton_invariant.CANDIDATES if dtype == "bf16" else ())):
            compile_one(triton_invariant._linear_kernel, dtype,
                        dict(HAS_BIAS=True, BM=triton_invariant.BLOCK_M, BN=tiles.bn, BK=tiles.bk,
                             WIDE=dtype == "fp32", SPLIT=tiles.split))
        for int4 in (True, False):
            blocks = {"qs_ptr": "*u8" if int4 else "*i8", "scales_ptr": "*fp16", "offsets_ptr": "*fp16"}
            if dtype == "bf16":  # the row kernel widens everything to float32 either way
                for gemv in (triton_qlinear.DEFAULT_GEMV, *triton_qlinear.GEMV_CANDIDATES):
                    shape = dict(INT4_BLOCKS=int4, HAS_BIAS=True, HALF_K=triton_qlinear.HALF, BLOCK_N=gemv.n,
                                 SPLIT=gemv.split)
                    if gemv.flat:
                        compile_one(triton_qlinear._qgemv_flat_kernel, dtype,
                                    dict(shape, BLOCK_K=gemv.chunk * 2 * triton_qlinear.HALF), blocks)
                    else:
                        compile_one(triton_qlinear._qgemv_kernel, dtype, dict(shape, CHUNK=gemv.chunk), blocks)
            compile_one(triton_qlinear._qlinear_kernel, dtype,
                        dict(INT4_BLOCKS=int4, HAS_BIAS=True, HALF_K=triton_qlinear.HALF, BLOCK_M=64, BLOCK_N=64,
                             SPLIT16=dtype == "bf16", EMULATE=False), blocks)
    compile_one(triton_splits._sum_splits_kernel, "bf16", dict(SPLIT=4, HAS_BIAS=True, BLOCK=triton_splits.SUM_BLOCK))
    # Gemma 3 270M's layer: 4 query heads on 1 KV head of 256, 640 wide, its norms' scales in float32
    heads, kvh, d, hidden = 4, 1, 256, 640
    norms = {"w_out_ptr": "*fp32", "w_next_ptr": "*fp32", "qw_ptr": "*fp32", "kw_ptr": "*fp32"}
    for sandwich in (True, False):
        compile_one(triton_gemma._sandwich_kernel, "bf16", dict(N=hidden, N_PAD=1024, SANDWICH=sandwich), norms)
    compile_one(triton_gemma._qk_norm_kernel, "bf16", dict(HEADS=heads, KVH=kvh, D=d, D_PAD=d), norms)
    compile_one(triton_fused._rope_kv_write_kernel, "bf16", dict(HEADS=heads, KVH=kvh, D=d, D_PAD=d))
    compile_one(triton_decode._segment_kernel, "bf16",
                dict(HEADS=heads, G=heads, G_PAD=heads, D=d, D_PAD=d, DV=d, DV_PAD=d, SEG=triton_decode.SEGMENT))
    compile_one(triton_attention._paged_attention_kernel, "bf16",
                dict(G=heads, G_PAD=heads, D=d, D_PAD=d, DV=d, DV_PAD=d, BLOCK_N=16))

if __name__ == "__main__":
    sys.exit(main())
