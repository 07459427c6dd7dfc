// RMS norm for the lean forward, alone and fused with the residual add before it (as vLLM's
// fused_add_rms_norm): one pass over each row instead of the five operations aten's CPU rms_norm
// runs. It rounds where torch does: the residual sum to the tensor's dtype, then the weighted
// row once, so bfloat16 results equal F.rms_norm's.
#include "torch_lite.h"
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "avx512_math.h"
#define MMFUSION_NORM_BF16 1
#endif

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

#ifdef MMFUSION_NORM_BF16
// bfloat16, 16 lanes at a time (the generic loops' conversions to bfloat16 stay scalar), with the
// same roundings: the sum to bfloat16, the weighted row as (x * inv) * w
void norm_rows_bf16(c10::BFloat16* h, const c10::BFloat16* delta, const c10::BFloat16* w, c10::BFloat16* out,
                    int64_t rows, int64_t n, float eps) {
  using mmfusion::load_bf16;
  using mmfusion::store_bf16;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n + 16);
    for (int64_t r = begin; r < end; ++r) {
      c10::BFloat16* hr = h + r * n;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, n - i));
        __m512 x = load_bf16(hr + i, m);
        if (delta != nullptr) {
          x = mmfusion::bf16_to_f32(mmfusion::f32_to_bf16(_mm512_add_ps(x, load_bf16(delta + r * n + i, m))));
          store_bf16(hr + i, x, m);
        }
        _mm512_storeu_ps(buf.data() + i, x);
        ss = _mm512_fmadd_ps(x, x, ss);
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps);
      const __m512 vinv = _mm512_set1_ps(inv);
      c10::BFloat16* o = out + r * n;
      for (int64_t i = 0; i < n; i += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, n - i));
        store_bf16(o + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(buf.data() + i), vinv), load_bf16(w + i, m)), m);
      }
    }
  });
}
#endif

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
#ifdef MMFUSION_NORM_BF16
  if (h.scalar_type() == at::kBFloat16) {
    norm_rows_bf16(h.data_ptr<c10::BFloat16>(), delta ? d.data_ptr<c10::BFloat16>() : nullptr,
                   w.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), h.size(0), h.size(1),
                   static_cast<float>(eps));
    return out;
  }
#endif
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
