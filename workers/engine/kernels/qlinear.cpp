// Weight-only quantized linears, y = x @ W.T, reading the weights as blocks of 32 values of one
// output row (the layout of GGUF's Q4_0, Q4_1 and Q8_0, which llama.cpp reads as they are):
//   int4: 16 bytes a block, value j in the low nibble of byte j and value j + 16 in its high
//         nibble; a float16 scale and a float16 offset a block: w = scale * q + offset;
//   int8: 32 signed bytes a block and a float16 scale: w = scale * q.
// The activations stay in the compute dtype's values (bfloat16 or float32) and the math is
// float32: each block is widened to float32 exactly as GGUF's dequantization computes it (scale * q
// is exact in float32; the offset is added once), then multiplied in float32. A decode step is
// bound by the bytes of weights it reads; these read 5 (int4) or 8.5 (int8) bits a weight against
// bfloat16's 16.
//
// On x86 each output row's blocks are widened in registers and multiplied into up to four input
// rows at once (AVX-512: 16 lanes, two accumulators a row; AVX2 with FMA and F16C: 8 lanes), so a
// decode step reads each weight byte once. Elsewhere four output rows at a time are widened into a
// small buffer that stays in L1 and the compiler vectorizes the dot products from there.
#include "torch_lite.h"
#include <ATen/Parallel.h>

#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define MMFUSION_QLINEAR_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MMFUSION_QLINEAR_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRows = 4;  // output rows widened together

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// one output row's weights as float32, into w[0, k)
inline void widen_int4(const uint8_t* qs, const uint16_t* scales, const uint16_t* offsets, int64_t k, float* w) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float d = half_to_float(scales[b]);
    const float m = half_to_float(offsets[b]);
    const uint8_t* q = qs + b * (kBlock / 2);
    float* o = w + b * kBlock;
#pragma omp simd
    for (int j = 0; j < kBlock / 2; ++j) {
      o[j] = d * static_cast<float>(q[j] & 0x0F) + m;
      o[j + kBlock / 2] = d * static_cast<float>(q[j] >> 4) + m;
    }
  }
}

inline void widen_int8(const int8_t* qs, const uint16_t* scales, int64_t k, float* w) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float d = half_to_float(scales[b]);
    const int8_t* q = qs + b * kBlock;
    float* o = w + b * kBlock;
#pragma omp simd
    for (int j = 0; j < kBlock; ++j) o[j] = d * static_cast<float>(q[j]);
  }
}


#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
constexpr int kMaxRows = 4;  // input rows a pass over the weights multiplies

inline float half_bits(uint16_t bits) { return _cvtsh_ss(bits); }
#endif

#ifdef MMFUSION_QLINEAR_AVX512
// y[r] = x[r] . w for R input rows, w one output row of int4 blocks
template <int R>
inline void int4_dot(const float* x, int64_t k, const uint8_t* q, const uint16_t* s, const uint16_t* o, float* y) {
  __m512 lo_acc[R], hi_acc[R];
  for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = _mm512_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * (kBlock / 2)));
    const __m512 d = _mm512_set1_ps(half_bits(s[b])), m = _mm512_set1_ps(half_bits(o[b]));
    // scale * q is exact in float32 and the offset is added with one rounding, as GGUF computes it
    const __m512 wl = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask))), m);
    const __m512 wh = _mm512_fmadd_ps(
        d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask))), m);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * k + b * kBlock;
      lo_acc[r] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xr), lo_acc[r]);
      hi_acc[r] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xr + 16), hi_acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(lo_acc[r], hi_acc[r]));
}

template <int R>
inline void int8_dot(const float* x, int64_t k, const int8_t* q, const uint16_t* s, const uint16_t*, float* y) {
  __m512 lo_acc[R], hi_acc[R];
  for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock));
    const __m512 d = _mm512_set1_ps(half_bits(s[b]));
    const __m512 wl = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw))));
    const __m512 wh = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1))));
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * k + b * kBlock;
      lo_acc[r] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xr), lo_acc[r]);
      hi_acc[r] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xr + 16), hi_acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(lo_acc[r], hi_acc[r]));
}
#endif

#ifdef MMFUSION_QLINEAR_AVX2
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

template <int R>
inline void int4_dot(const float* x, int64_t k, const uint8_t* q, const uint16_t* s, const uint16_t* o, float* y) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * (kBlock / 2)));
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const __m256 d = _mm256_set1_ps(half_bits(s[b])), m = _mm256_set1_ps(half_bits(o[b]));
    const __m256 w0 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
    const __m256 w1 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
    const __m256 w2 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
    const __m256 w3 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * k + b * kBlock;
      a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a0[r]);
      a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a1[r]);
      a0[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a0[r]);
      a1[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum8(_mm256_add_ps(a0[r], a1[r]));
}

template <int R>
inline void int8_dot(const float* x, int64_t k, const int8_t* q, const uint16_t* s, const uint16_t*, float* y) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const int8_t* qb = q + b * kBlock;
    const __m256 d = _mm256_set1_ps(half_bits(s[b]));
    __m256 w[4];
    for (int i = 0; i < 4; ++i) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * i));
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
    }
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * k + b * kBlock;
      a0[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a0[r]);
      a1[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a1[r]);
      a0[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a0[r]);
      a1[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum8(_mm256_add_ps(a0[r], a1[r]));
}
#endif

#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
// every output row against the input rows, four input rows a pass
template <typename T, typename Q, typename Dot4, typename Dot3, typename Dot2, typename Dot1>
void simd_rows_with(Dot4 dot4, Dot3 dot3, Dot2 dot2, Dot1 dot1, const float* x, int64_t m_count, int64_t k, int64_t n, const Q* qs, int64_t row_bytes,
               const uint16_t* scales, const uint16_t* offsets, const float* bias, T* y) {
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float acc[kMaxRows];
    for (int64_t row = begin; row < end; ++row) {
      const Q* q = qs + row * row_bytes;
      const uint16_t* s = scales + row * blocks;
      const uint16_t* o = offsets != nullptr ? offsets + row * blocks : nullptr;
      const float add = bias != nullptr ? bias[row] : 0.f;
      for (int64_t m0 = 0; m0 < m_count; m0 += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, m_count - m0);
        const float* xr = x + m0 * k;
        switch (rows) {
          case 4: dot4(xr, k, q, s, o, acc); break;
          case 3: dot3(xr, k, q, s, o, acc); break;
          case 2: dot2(xr, k, q, s, o, acc); break;
          default: dot1(xr, k, q, s, o, acc); break;
        }
        for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * n + row] = static_cast<T>(acc[r] + add);
      }
    }
  });
}
#endif

template <typename T>
void store(T* out, float v) { *out = static_cast<T>(v); }

// y[m, n0 .. n0 + rows) for every m, from `rows` widened weight rows
template <typename T>
inline void dots(const float* x, int64_t m_count, int64_t k, const float* w, int64_t rows, const float* bias,
                 int64_t n0, int64_t n, T* y) {
  for (int64_t m = 0; m < m_count; ++m) {
    const float* xr = x + m * k;
    float acc[kRows] = {0.f, 0.f, 0.f, 0.f};
    if (rows == kRows) {
      float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
      const float *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
      for (int64_t i = 0; i < k; ++i) {
        const float xv = xr[i];
        a0 += xv * w0[i];
        a1 += xv * w1[i];
        a2 += xv * w2[i];
        a3 += xv * w3[i];
      }
      acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3;
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        float a = 0.f;
        const float* wr = w + r * k;
#pragma omp simd reduction(+ : a)
        for (int64_t i = 0; i < k; ++i) a += xr[i] * wr[i];
        acc[r] = a;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      store(y + m * n + n0 + r, acc[r] + (bias != nullptr ? bias[n0 + r] : 0.f));
    }
  }
}

template <typename T, typename Widen>
void qlinear_rows(const float* x, int64_t m_count, int64_t k, int64_t n, const float* bias, T* y, Widen widen) {
  const int64_t groups = (n + kRows - 1) / kRows;
  // a grain of a few groups: one weight row of SmolLM2's MLP is ~1 KB of int4
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> w(kRows * k);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kRows;
      const int64_t rows = std::min(kRows, n - n0);
      for (int64_t r = 0; r < rows; ++r) widen(n0 + r, w.data() + r * k);
      dots(x, m_count, k, w.data(), rows, bias, n0, n, y);
    }
  });
}

// x as float32 rows [M, K] (a copy where it is 16-bit)
at::Tensor float_rows(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
}

void check(const at::Tensor& x, const at::Tensor& scales, int64_t n, int64_t k, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, name, ": x must be [rows, ", k, "], got ", x.sizes());
  TORCH_CHECK(k % kBlock == 0, name, ": the input size must be a multiple of 32, got ", k);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == n * (k / kBlock),
              name, ": scales must be contiguous float16 [", n, ", ", k / kBlock, "]");
}

// the call's shared part: x as float32 rows, the bias, the output in x's dtype; `rows(T*, x, m, k, b)`
// fills the output
template <typename Rows>
at::Tensor run(const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias, Rows rows) {
  const at::Tensor xf = float_rows(x);
  const int64_t m = xf.size(0), k = xf.size(1);
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    bf = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bf.numel() == n, "qlinear: bias must have ", n, " values");
  }
  const float* b = bf.defined() ? bf.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({m, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "qlinear", [&] {
    rows(y.data_ptr<scalar_t>(), xf.data_ptr<float>(), m, k, b);
  });
  return y;
}

}  // namespace

#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
#define MMFUSION_DOTS(f) \
  [](auto... a) { f<4>(a...); }, [](auto... a) { f<3>(a...); }, [](auto... a) { f<2>(a...); }, \
      [](auto... a) { f<1>(a...); }
#endif

// x [M, K] (float32, bfloat16 or float16); qs uint8 [N, K / 2]; scales, offsets float16 [N, K / 32];
// returns [M, N] in x's dtype
at::Tensor qlinear_int4(at::Tensor x, at::Tensor qs, at::Tensor scales, at::Tensor offsets,
                        c10::optional<at::Tensor> bias) {
  const int64_t n = qs.size(0), k = qs.size(1) * 2;
  check(x, scales, n, k, "qlinear_int4");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous(), "qlinear_int4: qs must be contiguous uint8");
  TORCH_CHECK(offsets.scalar_type() == at::kHalf && offsets.is_contiguous() && offsets.numel() == scales.numel(),
              "qlinear_int4: offsets must be float16 like scales");
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* o = reinterpret_cast<const uint16_t*>(offsets.data_ptr<at::Half>());
  return run(x, n, bias, [&](auto* y, const float* xf, int64_t m, int64_t kk, const float* b) {
    using T = std::remove_pointer_t<decltype(y)>;
#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
    simd_rows_with<T, uint8_t>(MMFUSION_DOTS(int4_dot), xf, m, kk, n, q, kk / 2, s, o, b, y);
#else
    const int64_t blocks = kk / kBlock;
    qlinear_rows<T>(xf, m, kk, n, b, y, [=](int64_t row, float* w) {
      widen_int4(q + row * (kk / 2), s + row * blocks, o + row * blocks, kk, w);
    });
#endif
  });
}

// x [M, K]; qs int8 [N, K]; scales float16 [N, K / 32]; returns [M, N] in x's dtype
at::Tensor qlinear_int8(at::Tensor x, at::Tensor qs, at::Tensor scales, c10::optional<at::Tensor> bias) {
  const int64_t n = qs.size(0), k = qs.size(1);
  check(x, scales, n, k, "qlinear_int8");
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous(), "qlinear_int8: qs must be contiguous int8");
  const int8_t* q = qs.data_ptr<int8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  return run(x, n, bias, [&](auto* y, const float* xf, int64_t m, int64_t kk, const float* b) {
    using T = std::remove_pointer_t<decltype(y)>;
#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
    simd_rows_with<T, int8_t>(MMFUSION_DOTS(int8_dot), xf, m, kk, n, q, kk, s, nullptr, b, y);
#else
    const int64_t blocks = kk / kBlock;
    qlinear_rows<T>(xf, m, kk, n, b, y, [=](int64_t row, float* w) { widen_int8(q + row * kk, s + row * blocks, kk, w); });
#endif
  });
}

template <typename T>
void narrow(const float* x, T* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(x[i]);
}

// the dense weight [N, K] in `dtype` (float32 values rounded once to it): for steps of many rows,
// which a GEMM library multiplies faster than the blocks above
at::Tensor qdequantize(at::Tensor qs, at::Tensor scales, c10::optional<at::Tensor> offsets, at::ScalarType dtype) {
  const bool int4 = offsets.has_value() && offsets->defined();
  const int64_t n = qs.size(0), k = int4 ? qs.size(1) * 2 : qs.size(1);
  TORCH_CHECK(qs.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                  scales.numel() == n * (k / kBlock),
              "qdequantize: contiguous blocks and float16 scales [N, K / 32]");
  at::Tensor w = at::empty({n, k}, qs.options().dtype(dtype));
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* o = int4 ? reinterpret_cast<const uint16_t*>(offsets->data_ptr<at::Half>()) : nullptr;
  const int64_t blocks = k / kBlock;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "qdequantize", [&] {
    scalar_t* out = w.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(k);
      for (int64_t r = begin; r < end; ++r) {
        if (int4) {
          widen_int4(qs.data_ptr<uint8_t>() + r * (k / 2), s + r * blocks, o + r * blocks, k, row.data());
        } else {
          widen_int8(qs.data_ptr<int8_t>() + r * k, s + r * blocks, k, row.data());
        }
        narrow(row.data(), out + r * k, k);
      }
    });
  });
  return w;
}
