// RMS norm for the lean forward, alone and fused with the residual add before it (as vLLM's
// fused_add_rms_norm): one pass over each row instead of the five operations aten's CPU rms_norm
// runs. It rounds where torch does: the residual sum to the tensor's dtype, then the weighted
// row once, so bfloat16 results equal F.rms_norm's.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

template <typename T>
void norm_rows(T* h, const T* delta, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n);
    for (int64_t r = begin; r < end; ++r) {
      T* hr = h + r * n;
      float ss = 0.f;
      if (delta != nullptr) {
        const T* dr = delta + r * n;
        for (int64_t i = 0; i < n; ++i) {
          const T sum = static_cast<T>(static_cast<float>(hr[i]) + static_cast<float>(dr[i]));
          hr[i] = sum;
          buf[i] = static_cast<float>(sum);
        }
      } else {
        for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(hr[i]);
      }
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += buf[i] * buf[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i)
        o[i] = static_cast<T>(buf[i] * inv * static_cast<float>(w[i]));
    }
  });
}

torch::Tensor run(torch::Tensor h, const torch::Tensor* delta, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "rms_norm: rows must be a contiguous 2-d tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == h.size(1) && weight.scalar_type() == h.scalar_type(),
              "rms_norm: the weight must match the rows' width and dtype");
  auto w = weight.contiguous();
  torch::Tensor d;
  if (delta != nullptr) {
    TORCH_CHECK(delta->sizes() == h.sizes() && delta->scalar_type() == h.scalar_type(),
                "add_rms_norm: the residual and its update must match");
    d = delta->contiguous();
  }
  auto out = torch::empty_like(h);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(h.data_ptr<scalar_t>(), delta ? d.data_ptr<scalar_t>() : nullptr, w.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), h.size(0), h.size(1), static_cast<float>(eps));
  });
  return out;
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) { return run(x, nullptr, weight, eps); }

// h += delta in place, and returns rms_norm(h) * weight
torch::Tensor add_rms_norm(torch::Tensor h, torch::Tensor delta, torch::Tensor weight, double eps) {
  return run(h, &delta, weight, eps);
}
