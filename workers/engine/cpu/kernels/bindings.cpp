// The module workers/engine/cpu/extension.py builds from the kernels beside this file.
#include <torch/csrc/utils/pybind.h>

#include "decode_layers.h"
#include "torch_lite.h"

#include <string>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor key, torch::Tensor value, torch::Tensor blocks,
                           torch::Tensor spans, double scale);
std::vector<std::string> paths();
bool paged_prefill(torch::Tensor out, torch::Tensor q, torch::Tensor key, torch::Tensor value, torch::Tensor blocks,
                   torch::Tensor segs, int64_t window, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
void rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor key, torch::Tensor value,
                torch::Tensor blocks, torch::Tensor offsets, int64_t heads, int64_t kvh);
torch::Tensor add_rms_norm(torch::Tensor h, torch::Tensor delta, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gu);
bool silu_mul_f32_exact();
bool silu_mul_rounds_as_torch_for(const at::Tensor& like);
at::Tensor qlinear_int4(at::Tensor x, at::Tensor qs, at::Tensor scales, at::Tensor offsets,
                        c10::optional<at::Tensor> bias, bool strips, int64_t act8);
at::Tensor qlinear_int8(at::Tensor x, at::Tensor qs, at::Tensor scales, c10::optional<at::Tensor> offsets,
                        c10::optional<at::Tensor> bias, bool strips, int64_t act8);
std::vector<std::string> act8_dtypes();
at::Tensor dense_strips(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
at::Tensor qlinear_widened(at::Tensor x, at::Tensor qs, at::Tensor scales, c10::optional<at::Tensor> offsets,
                           c10::optional<at::Tensor> bias);
bool dense_strips_built();
bool bf16_pack_supported();
bool amx_packs();
at::Tensor bf16_pack(at::Tensor w);
at::Tensor bf16_packed_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias);

// Every kernel call lets go of the GIL while it runs (its arguments are converted before and its
// result after, under the GIL; the kernels touch no Python object): a worker's other threads, its
// I/O thread's heartbeats among them, go on during a long call, as they do during torch's own ops.
using Unlocked = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)", Unlocked());
  m.def("paged_prefill", &paged_prefill, "paged prefill attention of a step's chunks (CPU, bf16); false where it has no kernel",
        Unlocked());
  m.def("paths", &paths, "the specialised paths compiled into this build");
  m.def("rope_write", &rope_write, "rotary embedding of q and k in place, k and v written into the paged cache",
        Unlocked());
  m.def("rms_norm", &rms_norm, "RMS norm of contiguous rows", Unlocked());
  m.def("add_rms_norm", &add_rms_norm, "h += delta in place, then the RMS norm of h", Unlocked());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of fused gate/up rows", Unlocked());
  m.def("silu_mul_f32_exact", &silu_mul_f32_exact,
        "whether silu_mul's float32 rows take torch's own exponential: the same bits as F.silu(g) * u");
  m.def("silu_mul_rounds_as_torch", &silu_mul_rounds_as_torch_for,
        "whether silu_mul's rows of this tensor's dtype round as F.silu(g) * u does");
  // strips: every row count through the strips (where the output rows are whole vectors), whose sum
  // for a row is the same whatever rows come with it (`deterministic`); act8: calls of up to that
  // many rows (at most 4) with the activations rounded to 8 bits (qlinear_act8.h), for the dtypes
  // of act8_dtypes()
  m.def("qlinear_int4", &qlinear_int4, "x @ W.T over int4 blocks of 32 (scale, offset), float32 math", pybind11::arg("x"),
        pybind11::arg("qs"), pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("bias"),
        pybind11::arg("strips") = false, pybind11::arg("act8") = 0, Unlocked());
  m.def("qlinear_int8", &qlinear_int8, "x @ W.T over int8 blocks of 32 (scale), float32 math", pybind11::arg("x"),
        pybind11::arg("qs"), pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("bias"),
        pybind11::arg("strips") = false, pybind11::arg("act8") = 0, Unlocked());
  m.def("act8_dtypes", &act8_dtypes, "the activation dtypes the 8-bit activations' path (act8) is built for here");
  m.def("qlinear_widened", &qlinear_widened, "x @ W.T over int4 or int8 blocks through ATen's GEMM on widened weights",
        pybind11::arg("x"), pybind11::arg("qs"), pybind11::arg("scales"), pybind11::arg("offsets"),
        pybind11::arg("bias"), Unlocked());
  m.def("dense_strips", &dense_strips, "x @ W.T for a dense W through the strips: one order for any number of rows",
        Unlocked());
  pybind11::class_<KernelLinear>(m, "KernelLinear", "one linear of these kernels: kind 0 int4, 1 int8, 2 dense strips")
      .def(pybind11::init<int64_t, at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                          c10::optional<at::Tensor>, bool, c10::optional<at::Tensor>, int64_t, int64_t>(),
           pybind11::arg("kind"), pybind11::arg("weight"), pybind11::arg("scales"), pybind11::arg("offsets"),
           pybind11::arg("bias"), pybind11::arg("strips"), pybind11::arg("packed") = pybind11::none(),
           pybind11::arg("packed_from") = 0, pybind11::arg("act8") = 0)
      .def("__call__", &KernelLinear::operator(), Unlocked());
  pybind11::class_<DecodeLayers>(m, "DecodeLayers", "a decode step through a Llama-family model's layers in one call")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, bool>(), pybind11::arg("heads"),
           pybind11::arg("kv_heads"), pybind11::arg("head_dim"), pybind11::arg("scale"), pybind11::arg("eps"),
           pybind11::arg("gemma") = false)
      .def("add", &DecodeLayers::add)
      .def("add_gemma", &DecodeLayers::add_gemma)
      .def("place", &DecodeLayers::place)
      .def("placed", &DecodeLayers::placed)
      .def("__len__", &DecodeLayers::size)
      .def("run", &DecodeLayers::run, Unlocked());
  m.def("bf16_pack_supported", &bf16_pack_supported,
        "whether bf16_pack and bf16_packed_linear run here: on AMX tiles, or on AVX512-BF16's vdpbf16ps");
  m.def("amx_packs", &amx_packs, "whether bf16_packed_linear multiplies on AMX tiles (else vdpbf16ps)");
  m.def("bf16_pack", &bf16_pack, "a [N, K] bfloat16 weight in the AMX tiles' layout, panels of 64 output rows (32 where they do not divide)", Unlocked());
  m.def("bf16_packed_linear", &bf16_packed_linear, "x @ W.T (+ bias) in bfloat16 over bf16_pack's weights (AMX tiles, else vdpbf16ps)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias"), Unlocked());
  m.def("dense_strips_built", &dense_strips_built, "whether dense_strips is built at this CPU level");
}
