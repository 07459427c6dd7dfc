// One decode step through a Llama-family model's layers (decode_layers.h): the lean forward's
// layer loop (workers/engine/lean.py) over the same kernels, without the interpreter between them.
#include "decode_layers.h"

#include <ATen/ops/add.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>

#include <utility>

KernelLinear::KernelLinear(int64_t kind, at::Tensor weight, c10::optional<at::Tensor> scales,
                           c10::optional<at::Tensor> offsets, c10::optional<at::Tensor> bias, bool strips)
    : kind(kind), weight(std::move(weight)), scales(std::move(scales)), offsets(std::move(offsets)),
      bias(std::move(bias)), strips(strips) {
  TORCH_CHECK(kind == kInt4 || kind == kInt8 || kind == kDense, "KernelLinear: kind must be 0 (int4), 1 (int8) or 2 (dense)");
  TORCH_CHECK(kind == kDense || this->scales.has_value(), "KernelLinear: quantized blocks need their scales");
  TORCH_CHECK(kind != kInt4 || this->offsets.has_value(), "KernelLinear: int4 blocks need their offsets");
}

at::Tensor KernelLinear::operator()(const at::Tensor& x) const {
  switch (kind) {
    case kInt4: return qlinear_int4(x, weight, *scales, *offsets, bias, strips);
    case kInt8: return qlinear_int8(x, weight, *scales, bias, strips);
    default: return dense_strips(x, weight, bias);
  }
}

DecodeLayers::DecodeLayers(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double eps)
    : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scale_(scale), eps_(eps) {}

void DecodeLayers::add(at::Tensor input_norm, at::Tensor post_norm, KernelLinear qkv, KernelLinear o,
                       KernelLinear gate_up, KernelLinear down) {
  layers_.push_back(DecodeLayer{std::move(input_norm), std::move(post_norm), std::move(qkv), std::move(o),
                                std::move(gate_up), std::move(down)});
}

void DecodeLayers::place(std::vector<int64_t> groups, std::vector<int64_t> pool) {
  TORCH_CHECK(groups.size() == layers_.size() && pool.size() == layers_.size(),
              "DecodeLayers.place: one cache group and pool index per layer");
  groups_ = std::move(groups);
  pool_ = std::move(pool);
}

at::Tensor DecodeLayers::run(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor keys, at::Tensor values,
                             std::vector<at::Tensor> steps) const {
  TORCH_CHECK(placed(), "DecodeLayers.run: place() the layers in the cache first");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "DecodeLayers.run: h must be contiguous rows");
  const int64_t n = h.size(0), d = head_dim_;
  // silu(gate) * up: the C++ pass in 16 bits, torch's silu and mul in float32 (lean.py's choice)
  const bool kernel_silu = h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kHalf;
  const int64_t last = size() - 1;
  at::Tensor x = rms_norm(h, layers_[0].input_norm, eps_);
  for (int64_t i = 0; i <= last; ++i) {
    const DecodeLayer& layer = layers_[i];
    const int64_t g = groups_[i];
    TORCH_CHECK(4 * g + 3 < static_cast<int64_t>(steps.size()), "DecodeLayers.run: no step tables for group ", g);
    const at::Tensor kb = keys.select(0, pool_[i]), vb = values.select(0, pool_[i]);
    at::Tensor qkv = layer.qkv(x);
    rope_write(qkv, cos, sin, kb, vb, steps[4 * g], steps[4 * g + 1], heads_, kv_heads_);
    const at::Tensor q = qkv.narrow(1, 0, heads_ * d).view({n, heads_, d});
    const at::Tensor a = paged_decode(q, kb, vb, steps[4 * g + 2], steps[4 * g + 3], scale_);
    x = add_rms_norm(h, layer.o(a.reshape({n, heads_ * d})), layer.post_norm, eps_);
    const at::Tensor gu = layer.gate_up(x);
    at::Tensor act;
    if (kernel_silu) {
      act = silu_mul(gu);
    } else {
      const int64_t inter = gu.size(1) / 2;
      act = at::mul(at::silu(gu.narrow(1, 0, inter)), gu.narrow(1, inter, inter));
    }
    const at::Tensor delta = layer.down(act);
    if (i < last) {
      x = add_rms_norm(h, delta, layers_[i + 1].input_norm, eps_);
    } else {
      h = at::add(h, delta);
    }
  }
  return h;
}
