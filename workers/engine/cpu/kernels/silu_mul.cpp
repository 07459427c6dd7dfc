// silu(gate) * up over the fused gate/up projection's rows (vLLM's silu_and_mul): one pass that
// reads each row once and writes half of it, instead of aten's silu, its result, and a mul. It
// rounds where torch does: silu's result to the dtype, then the product, so bfloat16 results
// equal F.silu(g) * u up to the last bit of the exponential (tested). float32 rows take torch's
// own e^x where torch has it (SLEEF's, which ATen's AVX2 silu calls): the same bits as F.silu's.
#include "torch_lite.h"
#include <ATen/Parallel.h>
#include <ATen/Version.h>

#include <algorithm>
#include <cmath>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "avx512_math.h"
#define MMFUSION_SILU_BF16 1
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// e^x of 8 float32 lanes to 1 ulp: SLEEF's, exported by libtorch_cpu (which this module links), the
// function ATen's float32 silu calls on AVX2. Weak: null where a torch build does not export it, and
// float32 rows then take the generic loop.
extern "C" __m256 Sleef_expf8_u10avx2(__m256) __attribute__((weak));
#define MMFUSION_SILU_SLEEF 1
#endif

namespace {

// fn(g, u, o) for each row's gate, up and output, the rows split over the threads
template <typename T, typename Fn>
void each_row(const T* gu, T* out, int64_t rows, int64_t inter, Fn fn) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(inter, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(gu + r * 2 * inter, gu + r * 2 * inter + inter, out + r * inter);
  });
}

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter) {
  each_row(gu, out, rows, inter, [inter](const T* g, const T* u, T* o) {
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      const float x = static_cast<float>(g[i]);
      const T s = static_cast<T>(x / (1.f + std::exp(-x)));
      o[i] = static_cast<T>(static_cast<float>(s) * static_cast<float>(u[i]));
    }
  });
}

#ifdef MMFUSION_SILU_BF16
// 16 lanes at a time: the compiler does not vectorize the generic loop's exp on bfloat16.
// exp_neg's range reduction holds for any x below exp's overflow, where it gives inf as expf does.
inline __m512 silu_mul16(__m512 x, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, mmfusion::exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), x))));
  return _mm512_mul_ps(mmfusion::bf16_to_f32(mmfusion::f32_to_bf16(s)), u);  // silu's result rounded, as torch
}

void silu_mul_bf16(const c10::BFloat16* gu, c10::BFloat16* out, int64_t rows, int64_t inter) {
  each_row(gu, out, rows, inter, [inter](const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* o) {
    for (int64_t i = 0; i < inter; i += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, inter - i));
      mmfusion::store_bf16(o + i, silu_mul16(mmfusion::load_bf16(g + i, n), mmfusion::load_bf16(u + i, n)), n);
    }
  });
}
#endif

#ifdef MMFUSION_SILU_SLEEF
// as ATen's x / (1 + exp(-x)), then the product with up; a row's last partial vector through a
// padded copy
inline __m256 silu_mul8(__m256 x, __m256 u) {
  const __m256 e = Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_setzero_ps(), x));
  return _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

void silu_mul_f32(const float* gu, float* out, int64_t rows, int64_t inter) {
  each_row(gu, out, rows, inter, [inter](const float* g, const float* u, float* o) {
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < inter) {
      float gt[8] = {0}, ut[8] = {0}, ot[8];
      std::copy(g + i, g + inter, gt);
      std::copy(u + i, u + inter, ut);
      _mm256_storeu_ps(ot, silu_mul8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
      std::copy(ot, ot + (inter - i), o + i);
    }
  });
}
#endif

}  // namespace

// whether float32 rows take torch's own exponential (SLEEF's) while ATen's silu takes it too (its
// vectorized kernels; not at ATEN_CPU_CAPABILITY=default): the same bits as F.silu's
bool silu_mul_f32_exact() {
#ifdef MMFUSION_SILU_SLEEF
  static const bool exact = Sleef_expf8_u10avx2 != nullptr && at::get_cpu_capability() != "DEFAULT";
  return exact;
#else
  return false;
#endif
}

// whether silu_mul's rows of this dtype round as F.silu(g) * u does: 16-bit ones (to the
// exponential's last bit), float32 ones where they take torch's own exponential. The one rule the
// fused decode layers and the lean forward's layer loop both follow, so that they stay bit-equal.
bool silu_mul_rounds_as_torch(at::ScalarType dtype) {
  return dtype == at::kBFloat16 || dtype == at::kHalf || (dtype == at::kFloat && silu_mul_f32_exact());
}

bool silu_mul_rounds_as_torch_for(const at::Tensor& like) { return silu_mul_rounds_as_torch(like.scalar_type()); }

// gu: [rows, 2 * inter], gate then up in each row; returns [rows, inter]
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "silu_mul: rows of gate and up, [rows, 2 * inter]");
  auto x = gu.contiguous();
  const int64_t inter = x.size(1) / 2;
  auto out = torch::empty({x.size(0), inter}, x.options());
#ifdef MMFUSION_SILU_BF16
  if (x.scalar_type() == at::kBFloat16) {
    silu_mul_bf16(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), x.size(0), inter);
    return out;
  }
#endif
#ifdef MMFUSION_SILU_SLEEF
  if (x.scalar_type() == at::kFloat && silu_mul_f32_exact()) {
    silu_mul_f32(x.data_ptr<float>(), out.data_ptr<float>(), x.size(0), inter);
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), inter);
  });
  return out;
}
