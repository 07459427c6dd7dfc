// One decode step through a Llama-family model's layers (decode_layers.h): the lean forward's
// layer loop (workers/engine/cpu/lean.py) over the same kernels, without the interpreter between them.
#include "decode_layers.h"

#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

#include <utility>

KernelLinear::KernelLinear(int64_t kind, at::Tensor weight, c10::optional<at::Tensor> scales,
                           c10::optional<at::Tensor> offsets, c10::optional<at::Tensor> bias, bool strips,
                           c10::optional<at::Tensor> packed, int64_t packed_from, int64_t act8)
    : kind(kind), weight(std::move(weight)), scales(std::move(scales)), offsets(std::move(offsets)),
      bias(std::move(bias)), strips(strips), packed(std::move(packed)), packed_from(packed_from), act8(act8) {
  TORCH_CHECK(packed_from == 0 || (this->packed.has_value() && this->packed->defined()),
              "KernelLinear: packed_from needs the packed values");
  TORCH_CHECK(kind == kInt4 || kind == kInt8 || kind == kDense, "KernelLinear: kind must be 0 (int4), 1 (int8) or 2 (dense)");
  TORCH_CHECK(kind == kDense || this->scales.has_value(), "KernelLinear: quantized blocks need their scales");
  TORCH_CHECK(kind != kInt4 || this->offsets.has_value(), "KernelLinear: int4 blocks need their offsets");
}

at::Tensor KernelLinear::operator()(const at::Tensor& x) const {
  if (packed_from > 0 && x.size(0) >= packed_from) return bf16_packed_linear(x, *packed, bias);
  switch (kind) {
    case kInt4: return qlinear_int4(x, weight, *scales, *offsets, bias, strips, act8);
    case kInt8: return qlinear_int8(x, weight, *scales, c10::nullopt, bias, strips, act8);
    default: return dense_strips(x, weight, bias);
  }
}

DecodeLayers::DecodeLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double eps,
                           bool gemma)
    : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps), gemma_(gemma) {}

void DecodeLayers::add(at::Tensor input_norm, at::Tensor post_norm, KernelLinear qkv, KernelLinear o,
                       KernelLinear gate_up, KernelLinear down) {
  layers_.push_back(DecodeLayer{std::move(input_norm), std::move(post_norm), std::move(qkv), std::move(o),
                                std::move(gate_up), std::move(down)});
}

void DecodeLayers::add_gemma(at::Tensor q_norm, at::Tensor k_norm, at::Tensor attn_out_norm,
                             at::Tensor mlp_out_norm, int64_t rope) {
  TORCH_CHECK(gemma_ && !layers_.empty(), "DecodeLayers.add_gemma: a Gemma 3 layer added first");
  DecodeLayer& layer = layers_.back();
  layer.q_norm = std::move(q_norm);
  layer.k_norm = std::move(k_norm);
  layer.attn_out_norm = std::move(attn_out_norm);
  layer.mlp_out_norm = std::move(mlp_out_norm);
  layer.rope = rope;
}

void DecodeLayers::place(std::vector<int64_t> groups, std::vector<int64_t> pool) {
  TORCH_CHECK(groups.size() == layers_.size() && pool.size() == layers_.size(),
              "DecodeLayers.place: one cache group and pool index per layer");
  groups_ = std::move(groups);
  pool_ = std::move(pool);
}

at::Tensor DecodeLayers::run(at::Tensor h, std::vector<at::Tensor> rope, at::Tensor keys, at::Tensor values,
                             std::vector<at::Tensor> steps) const {
  TORCH_CHECK(placed(), "DecodeLayers.run: place() the layers in the cache first");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "DecodeLayers.run: h must be contiguous rows");
  const int64_t n = h.size(0), d = head_dim_, hq = heads_ * d, hk = kv_heads_ * d;
  // silu(gate) * up: the C++ pass where it rounds as torch does, else torch's silu and mul
  const bool kernel_silu = silu_mul_rounds_as_torch(h.scalar_type());
  const int64_t last = size() - 1;
  at::Tensor x = rms_norm(h, layers_[0].input_norm, eps_);
  for (int64_t i = 0; i <= last; ++i) {
    const DecodeLayer& layer = layers_[i];
    const int64_t g = groups_[i];
    TORCH_CHECK(4 * g + 3 < static_cast<int64_t>(steps.size()), "DecodeLayers.run: no step tables for group ", g);
    TORCH_CHECK(2 * layer.rope + 1 < static_cast<int64_t>(rope.size()), "DecodeLayers.run: no rotary table ",
                layer.rope);
    const at::Tensor kb = keys.select(0, pool_[i]), vb = values.select(0, pool_[i]);
    at::Tensor qkv = layer.qkv(x);
    if (gemma_) {  // q and k normed per head (lean.LeanGemma3._qk_norm)
      const at::Tensor qn = rms_norm(qkv.narrow(1, 0, hq).reshape({n * heads_, d}).contiguous(), layer.q_norm, eps_);
      const at::Tensor kn =
          rms_norm(qkv.narrow(1, hq, hk).reshape({n * kv_heads_, d}).contiguous(), layer.k_norm, eps_);
      qkv = at::cat({qn.view({n, hq}), kn.view({n, hk}), qkv.narrow(1, hq + hk, qkv.size(1) - hq - hk)}, 1);
    }
    rope_write(qkv, rope[2 * layer.rope], rope[2 * layer.rope + 1], kb, vb, steps[4 * g], steps[4 * g + 1], heads_,
               kv_heads_);
    const at::Tensor q = qkv.narrow(1, 0, hq).view({n, heads_, d});
    const at::Tensor a = paged_decode(q, kb, vb, steps[4 * g + 2], steps[4 * g + 3], scale_);
    at::Tensor attn = layer.o(a.reshape({n, hq}));
    if (gemma_) attn = rms_norm(attn.contiguous(), layer.attn_out_norm, eps_);
    x = add_rms_norm(h, attn, layer.post_norm, eps_);
    const at::Tensor gu = layer.gate_up(x);
    const int64_t inter = gu.size(1) / 2;
    at::Tensor act;
    if (gemma_) {
      act = at::mul(at::gelu(gu.narrow(1, 0, inter), "tanh"), gu.narrow(1, inter, inter));
    } else if (kernel_silu) {
      act = silu_mul(gu);
    } else {
      act = at::mul(at::silu(gu.narrow(1, 0, inter)), gu.narrow(1, inter, inter));
    }
    at::Tensor delta = layer.down(act);
    if (gemma_) delta = rms_norm(delta.contiguous(), layer.mlp_out_norm, eps_);
    if (i < last) {
      x = add_rms_norm(h, delta, layers_[i + 1].input_norm, eps_);
    } else {
      h = at::add(h, delta);
    }
  }
  return h;
}
