// A decode step through a Llama-family model's layers in one call (decode_layers.cpp), declared
// here for the bindings. At one row a layer is a dozen kernel calls of a few microseconds each;
// from Python each call costs as much again in the interpreter and dispatch, about 1 ms of a
// SmolLM2 token's 7. The kernels are the same ones the Python path calls, in the same order, so
// both paths give bit-equal results.
#pragma once

#include "torch_lite.h"

#include <c10/util/Optional.h>

#include <vector>

// One linear of the C++ kernels, as workers/engine/cpu/linears.py's Linear holds it.
struct KernelLinear {
  static constexpr int64_t kInt4 = 0, kInt8 = 1, kDense = 2;
  int64_t kind;
  at::Tensor weight;  // int4: qs uint8 [N, K / 2]; int8: qs int8 [N, K]; dense: [N, K]
  c10::optional<at::Tensor> scales, offsets, bias;  // the blocks' (float16; offsets int4 only)
  bool strips;
  // the blocks' values packed for AMX tiles (amx_linear.cpp), which calls of at least packed_from
  // rows take (row_kernels' choice; 0: none)
  c10::optional<at::Tensor> packed;
  int64_t packed_from;
  int64_t act8;  // calls of up to this many rows round the activations to 8 bits (row_kernels' choice)

  KernelLinear(int64_t kind, at::Tensor weight, c10::optional<at::Tensor> scales, c10::optional<at::Tensor> offsets,
               c10::optional<at::Tensor> bias, bool strips, c10::optional<at::Tensor> packed, int64_t packed_from,
               int64_t act8);
  at::Tensor operator()(const at::Tensor& x) const;
};

struct DecodeLayer {
  at::Tensor input_norm, post_norm;
  KernelLinear qkv, o, gate_up, down;
  // Gemma 3 (undefined elsewhere): q and k norms, the norms of the attention's and the MLP's
  // outputs, and which of the step's rotary tables the layer takes
  at::Tensor q_norm, k_norm, attn_out_norm, mlp_out_norm;
  int64_t rope = 0;
};

class DecodeLayers {
 public:
  // gemma: Gemma 3's layer (q/k norms, output norms, GELU (tanh) for SiLU); else the Llama family's
  DecodeLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double eps, bool gemma);
  void add(at::Tensor input_norm, at::Tensor post_norm, KernelLinear qkv, KernelLinear o, KernelLinear gate_up,
           KernelLinear down);
  // Gemma 3: the last added layer's own norms and rotary table
  void add_gemma(at::Tensor q_norm, at::Tensor k_norm, at::Tensor attn_out_norm, at::Tensor mlp_out_norm,
                 int64_t rope);
  // layer i's cache group and its index in the pool of keys and values, from the runner
  void place(std::vector<int64_t> groups, std::vector<int64_t> pool);
  bool placed() const { return !pool_.empty(); }
  int64_t size() const { return static_cast<int64_t>(layers_.size()); }
  // h [N, hidden] (updated in place and returned): every row a decode row. rope: the rotary
  // tables (cos, sin [N, head_dim] in h's dtype) one pair after another (Gemma 3: one pair per
  // layer type); keys, values: the pool; steps: per cache group its write blocks, write offsets,
  // pair blocks and span table (attention.GroupStep)
  at::Tensor run(at::Tensor h, std::vector<at::Tensor> rope, at::Tensor keys, at::Tensor values,
                 std::vector<at::Tensor> steps) const;

 private:
  int64_t heads_, kv_heads_, head_dim_;
  double scale_, eps_;
  bool gemma_;
  std::vector<DecodeLayer> layers_;
  std::vector<int64_t> groups_, pool_;
};
