// Weight-only quantized linears, y = x @ W.T, reading the weights as blocks of 32 values of one
// output row (the layout of GGUF's Q4_0, Q4_1 and Q8_0, which llama.cpp reads as they are):
//   int4: 16 bytes a block, value j in the low nibble of byte j and value j + 16 in its high
//         nibble; a float16 scale and a float16 offset a block: w = scale * q + offset;
//   int8: 32 signed bytes a block and a float16 scale: w = scale * q.
// The activations keep the compute dtype's values (bfloat16, or float32 to within float32's
// precision) and the sums are float32: each block is widened to float32 exactly as GGUF's
// dequantization computes it (scale * q is exact in float32; the offset is added once), or, for one
// row of float32 against int4, multiplied exactly in integers and scaled once a block. A decode step is bound by the bytes of weights it
// reads; these read 5 (int4) or 8.5 (int8) bits a weight against bfloat16's 16.
//
// Paths, chosen by the build's target (the CPU level, workers.capability):
// - bfloat16 activations on AVX512-BF16: each block's float32 values are rounded to bfloat16 (the
//   dense bfloat16 model's weights, as transformers loads them) and multiplied in pairs into float32
//   by vdpbf16ps (int4 at up to four rows: the exact values, bf16_dot_int4);
// - float32 activations (and float16) on AVX-512, or on AVX2 with FMA and F16C: float32 values,
//   float32 products; one row against int4 blocks in fixed point instead (fixed_decode.h: int16
//   halves of the activations, exact int32 products, float32's precision);
// - elsewhere, plain loops the compiler vectorizes.
// Up to four input rows (a decode step of a few streams) read each weight byte once, in registers;
// 5 to 23 rows widen four output rows at a time into a buffer that stays in L1 and multiply tiles of
// input rows by them in registers; from 24 rows (a batch, a prompt's chunk) strips of output rows are
// widened once into the layout of an outer-product GEMM (bf16_outer, outer_f32), or, where the output
// rows are no whole vectors, from 96 rows ATen's GEMM multiplies the widened weights (panels).
// With `strips` (the `deterministic` key) every row count takes the strips where the output rows
// are whole vectors: a row's sums then run in one order whatever rows come with it, one row alone
// included, at the price of widening the weights for a decode step of a few rows.
#include "torch_lite.h"
#include <ATen/Parallel.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>

#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define MMFUSION_QLINEAR_AVX512 1
#if defined(__AVX512BF16__)
#define MMFUSION_QLINEAR_BF16 1
#include "avx512_math.h"
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MMFUSION_QLINEAR_AVX2 1
#endif
#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
#include "fixed_decode.h"
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

// Steps of many rows (a prompt's chunk, a large batch) are bound by arithmetic, not by the bytes of
// weights. Where the strips below cannot take them (output rows that are no whole vectors), the
// weights are widened into the compute dtype, a whole linear at a time (a panel of output rows for
// an LM head), and multiplied by ATen's GEMM: 512 rows of SmolLM2's linears took 2-5% longer than
// the prepacked bfloat16 GEMM, where the tiles took 15-40% longer (the strips are 14% faster than
// that GEMM). One GEMM a linear, not a GEMM a slice of it: oneDNN runs smaller ones slower. The
// widened values are those of the other paths.
constexpr int64_t kPanelRows = 96;         // input rows from which the GEMM serves
constexpr int64_t kPanelBytes = 16 << 20;  // the most widened bytes at once

// y = x @ W.T (+ bias) for x [M, K] in the dtype W of the widened weights; widen(row, W*) widens one
// output row. The widened weights go to a buffer that the calling thread keeps: allocating them anew
// each call costs page faults that took longer than the GEMM (glibc returns such blocks at free).
template <typename W, typename Widen>
at::Tensor panels(const at::Tensor& x, int64_t n, const at::Tensor& bias, Widen widen) {
  const int64_t k = x.size(1);
  const int64_t p = std::min(n, std::max<int64_t>(64, kPanelBytes / (k * static_cast<int64_t>(sizeof(W)))));
  thread_local at::Tensor scratch;
  if (!scratch.defined() || scratch.numel() < p * k || scratch.scalar_type() != x.scalar_type()) {
    scratch = at::Tensor();  // the old buffer goes before the new one comes
    scratch = at::empty({p * k}, x.options());
  }
  at::Tensor y;
  for (int64_t n0 = 0; n0 < n; n0 += p) {
    const int64_t rows = std::min(p, n - n0);
    at::Tensor w = scratch.narrow(0, 0, rows * k).view({rows, k});
    W* wp = w.data_ptr<W>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) widen(n0 + r, wp + r * k);
    });
    at::Tensor part = bias.defined() ? at::addmm(bias.narrow(0, n0, rows), x, w.t()) : at::mm(x, w.t());
    if (rows == n) return part;
    if (!y.defined()) y = at::empty({x.size(0), n}, x.options());
    y.narrow(1, n0, rows).copy_(part);
  }
  return y;
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

// four sums a row (one per vector of a block): with two, each sum waited on the FMA before it
// twice a block, and one row's pass ran at the FMA's latency, not its rate
template <int R>
inline void int4_dot(const float* x, int64_t k, const uint8_t* q, const uint16_t* s, const uint16_t* o, float* y) {
  __m256 a0[R], a1[R], a2[R], a3[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = a2[r] = a3[r] = _mm256_setzero_ps();
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
      a2[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a2[r]);
      a3[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a3[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hsum8(_mm256_add_ps(_mm256_add_ps(a0[r], a1[r]), _mm256_add_ps(a2[r], a3[r])));
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

// Steps of more rows (a batch of streams, a prompt): four output rows at a time are widened once
// into a buffer that stays in L1, and tiles of input rows x those four rows accumulate from it in
// registers, so each widened value feeds every input row (the fused pass above widens a block once
// per four input rows). The same float32 values, the same float32 math.
#if defined(MMFUSION_QLINEAR_AVX512)
struct F32Vec {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kTile = 4;  // input rows a tile: 16 accumulators, 4 weights, 1 input in 32 registers
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(MMFUSION_QLINEAR_AVX2)
struct F32Vec {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kTile = 2;  // 8 accumulators, 4 weights, 1 input in 16 registers
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) { return hsum8(v); }
};
#endif

#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
// y[m, n0 .. n0 + 4) for R input rows from m, four widened rows w (float32, [4][k])
template <int R, typename T>
inline void tile_f32(const float* x, int64_t k, const float* w, const float* bias, int64_t n0, int64_t n, T* y) {
  using F = F32Vec;
  typename F::V acc[R][kRows];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kRows; ++c) acc[r][c] = F::zero();
  for (int64_t i = 0; i < k; i += F::kLanes) {
    typename F::V w0 = F::load(w + i), w1 = F::load(w + k + i), w2 = F::load(w + 2 * k + i),
                  w3 = F::load(w + 3 * k + i);
    // in registers, as the inputs below: the compiler would fold each load into every FMA that uses
    // it (16 loads for 16 FMAs instead of 8), which left the tile bound by loads at half the FMA rate
    __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));
    for (int r = 0; r < R; ++r) {
      typename F::V xv = F::load(x + r * k + i);
      __asm__("" : "+v"(xv));
      acc[r][0] = F::fma(xv, w0, acc[r][0]);
      acc[r][1] = F::fma(xv, w1, acc[r][1]);
      acc[r][2] = F::fma(xv, w2, acc[r][2]);
      acc[r][3] = F::fma(xv, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kRows; ++c)
      y[r * n + n0 + c] = static_cast<T>(F::sum(acc[r][c]) + (bias != nullptr ? bias[n0 + c] : 0.f));
}

template <typename T, typename Widen>
void tiled_rows_f32(const float* x, int64_t m_count, int64_t k, int64_t n, const float* bias, T* y, Widen widen) {
  constexpr int R = F32Vec::kTile;
  at::parallel_for(0, (n + kRows - 1) / kRows, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> w(kRows * k, 0.f);
    float part[kRows];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kRows;
      const int64_t rows = std::min(kRows, n - n0);
      for (int64_t r = 0; r < rows; ++r) widen(n0 + r, w.data() + r * k);
      if (rows < kRows) {  // the last group of an output count that is no multiple of 4
        for (int64_t m = 0; m < m_count; ++m) {
          for (int64_t r = 0; r < rows; ++r) {
            float a = 0.f;
            for (int64_t i = 0; i < k; ++i) a += x[m * k + i] * w[r * k + i];
            part[r] = a;
          }
          for (int64_t r = 0; r < rows; ++r) y[m * n + n0 + r] = static_cast<T>(part[r] + (bias ? bias[n0 + r] : 0.f));
        }
        continue;
      }
      int64_t m = 0;
      for (; m + R <= m_count; m += R) tile_f32<R>(x + m * k, k, w.data(), bias, n0, n, y + m * n);
      for (; m < m_count; ++m) tile_f32<1>(x + m * k, k, w.data(), bias, n0, n, y + m * n);
    }
  });
}
#endif

// whether outer_f32 (below, AVX2 and above) takes these rows
inline bool outer_fits_f32(int64_t rows, int64_t n) {
#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
  return rows >= 24 && n % 16 == 0;
#else
  return false;
#endif
}

#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
// Float32 batches from 24 rows: as bf16_outer below, strips of 16 output rows widened once to float32
// and transposed (8x8 at a time) so that wp[i * 16 + c] is row c's value i; tiles of 6 input rows x 2
// vectors of 8 output rows sum in 12 of AVX2's 16 registers, one broadcast of x and two loads of
// weights for 12 FMAs. ymm on AVX-512 builds too (the float32 path there serves Gemma 3 and
// `dtype: float32`).
constexpr int64_t kF32Strip = 16;  // output rows a strip (outer_fits_f32 names the same 16)

constexpr int64_t kTileRows = 6;  // input rows a strip tile sums in registers

// f.template operator()<R>() for R = r (1 to kTileRows): a tile's row count as a constant
template <typename F>
inline void with_rows(int64_t r, F&& f) {
  switch (r) {
    case 6: f.template operator()<6>(); break;
    case 5: f.template operator()<5>(); break;
    case 4: f.template operator()<4>(); break;
    case 3: f.template operator()<3>(); break;
    case 2: f.template operator()<2>(); break;
    default: f.template operator()<1>(); break;
  }
}

// tile(m, mr) over the input rows [0, m_count) in tiles of at most kTileRows rows, of near-equal size
template <typename F>
inline void row_tiles(int64_t m_count, F&& tile) {
  const int64_t groups = (m_count + kTileRows - 1) / kTileRows;
  for (int64_t g = 0, m = 0; g < groups; ++g) {
    const int64_t mr = m_count / groups + (g < m_count % groups ? 1 : 0);
    tile(m, mr);
    m += mr;
  }
}

inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// values j0 .. j0 + 7 of an int4 block (16 bytes: value j in the low nibble of byte j, j + 16 in its
// high nibble) as float32: scale * q + offset in one FMA, which is GGUF's value (scale * q is exact)
inline __m256 widen8_int4(const uint8_t* q, int j0, __m256 d, __m256 m) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (j0 & 15)));
  const __m128i nib = j0 < 16 ? bytes : _mm_srli_epi16(bytes, 4);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(nib, _mm_set1_epi8(0x0F)))), d, m);
}

inline __m256 widen8_int8(const int8_t* q, int j0, __m256 d) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j0));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d);
}

// rows n0 .. n0 + 16 widened to float32 and transposed into wp [k][16], eight rows x eight values at a
// time in registers
template <typename Q>
void pack_strip_f32(const Q* qs, int64_t row_len, const uint16_t* scales, const uint16_t* offsets, int64_t k, int64_t n0,
                    float* wp) {
  const int64_t blocks = k / kBlock;
  for (int64_t c0 = 0; c0 < kF32Strip; c0 += 8)
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 d[8], m[8];
      const Q* q[8];
      for (int c = 0; c < 8; ++c) {
        const int64_t row = n0 + c0 + c;
        d[c] = _mm256_set1_ps(_cvtsh_ss(scales[row * blocks + b]));
        m[c] = _mm256_set1_ps(offsets != nullptr ? _cvtsh_ss(offsets[row * blocks + b]) : 0.f);
        q[c] = qs + row * row_len + b * (std::is_same_v<Q, uint8_t> ? kBlock / 2 : kBlock);
      }
      for (int j0 = 0; j0 < kBlock; j0 += 8) {
        __m256 r[8];
        for (int c = 0; c < 8; ++c) {
          if constexpr (std::is_same_v<Q, uint8_t>) {
            r[c] = widen8_int4(q[c], j0, d[c], m[c]);
          } else {
            r[c] = widen8_int8(q[c], j0, d[c]);
          }
        }
        transpose8(r);  // r[j]: value j0 + j of the 8 rows
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(wp + (b * kBlock + j0 + j) * kF32Strip + c0, r[j]);
      }
    }
}

// The sums are named variables, not arrays: GCC kept arrays of them in memory and stored every sum on
// every step of the loop, which ran at half the FMA rate
#define MMFUSION_F32_ROW(r)                                  \
  if constexpr (MR > r) {                                    \
    const __m256 xb = _mm256_broadcast_ss(x + r * k + i);    \
    s##r##0 = _mm256_fmadd_ps(xb, w0, s##r##0);              \
    s##r##1 = _mm256_fmadd_ps(xb, w1, s##r##1);              \
  }

template <int MR, typename T>
inline void outer_tile_f32(const float* x, int64_t k, const float* wp, const float* bias, int64_t n0, int64_t n, T* y) {
  static_assert(MR >= 1 && MR <= kTileRows, "six input rows at most");
  const __m256 z = _mm256_setzero_ps();
  __m256 s00 = z, s01 = z, s10 = z, s11 = z, s20 = z, s21 = z, s30 = z, s31 = z, s40 = z, s41 = z, s50 = z, s51 = z;
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_loadu_ps(wp + i * kF32Strip), w1 = _mm256_loadu_ps(wp + i * kF32Strip + 8);
    MMFUSION_F32_ROW(0) MMFUSION_F32_ROW(1) MMFUSION_F32_ROW(2) MMFUSION_F32_ROW(3) MMFUSION_F32_ROW(4)
    MMFUSION_F32_ROW(5)
  }
  const __m256 sums[2 * kTileRows] = {s00, s01, s10, s11, s20, s21, s30, s31, s40, s41, s50, s51};
  alignas(32) float out[MR * kF32Strip];
  for (int r = 0; r < MR; ++r) {
    _mm256_store_ps(out + r * kF32Strip, sums[2 * r]);
    _mm256_store_ps(out + r * kF32Strip + 8, sums[2 * r + 1]);
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kF32Strip; ++c)
      y[r * n + n0 + c] = static_cast<T>(out[r * kF32Strip + c] + (bias != nullptr ? bias[n0 + c] : 0.f));
}
#undef MMFUSION_F32_ROW

// the strips over weights that `pack(n0, wp)` lays out, strip by strip (quantized blocks, or dense rows)
template <typename T, typename Pack>
void outer_f32_with(const float* x, int64_t m_count, int64_t k, int64_t n, const float* bias, T* y, Pack pack) {
  at::parallel_for(0, n / kF32Strip, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wp(kF32Strip * k);
    for (int64_t strip = begin; strip < end; ++strip) {
      const int64_t n0 = strip * kF32Strip;
      pack(n0, wp.data());
      row_tiles(m_count, [&](int64_t m, int64_t mr) {
        with_rows(mr, [&]<int MR>() { outer_tile_f32<MR>(x + m * k, k, wp.data(), bias, n0, n, y + m * n); });
      });
    }
  });
}

template <typename T, typename Q>
void outer_f32(const float* x, int64_t m_count, int64_t k, int64_t n, const float* bias, T* y, const Q* qs,
               int64_t row_len, const uint16_t* scales, const uint16_t* offsets) {
  outer_f32_with<T>(x, m_count, k, n, bias, y,
                    [&](int64_t n0, float* wp) { pack_strip_f32(qs, row_len, scales, offsets, k, n0, wp); });
}

// eight values j0 .. j0 + 7 of a dense row as float32 (bfloat16's bits shifted into a float's high half)
inline __m256 load8_f32(const c10::BFloat16* w) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8_f32(const c10::Half* w) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))); }
inline __m256 load8_f32(const float* w) { return _mm256_loadu_ps(w); }

// dense rows n0 .. n0 + 16 of w [N, K] (K a multiple of 8) in float32, transposed into wp [k][16]
template <typename W>
void pack_dense_f32(const W* w, int64_t k, int64_t n0, float* wp) {
  for (int64_t c0 = 0; c0 < kF32Strip; c0 += 8)
    for (int64_t j0 = 0; j0 < k; j0 += 8) {
      __m256 r[8];
      for (int c = 0; c < 8; ++c) r[c] = load8_f32(w + (n0 + c0 + c) * k + j0);
      transpose8(r);  // r[j]: value j0 + j of the 8 rows
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(wp + (j0 + j) * kF32Strip + c0, r[j]);
    }
}
#endif

#ifdef MMFUSION_QLINEAR_BF16
// A decode step streams rows of blocks from memory; once a row's blocks cost a few operations each
// (bf16_dot_int4), the CPU's own prefetchers lag behind that stream, and asking for the rows a
// little ahead early made SmolLM2's int4 layers 1.5x faster at one row (the paths bound by widening
// the blocks, int8 and float32, gained nothing). A prefetch past the weights' end never faults.
inline void prefetch_ahead(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// bfloat16 activations where the CPU has bf16 dot products: each block's float32 values are rounded
// to bfloat16 (the dense bfloat16 model's weights: what transformers loads) and multiplied in pairs
// into float32 (vdpbf16ps), 32 products an instruction. Every row count takes the same values.
inline __m512bh widen_block_bf16_int4(const uint8_t* q, float d, float m) {
  // the block's 16 possible values (scale * q + offset for q = 0..15, rounded to bfloat16), then
  // each nibble picks its own: one fma, one rounding and one permute for 32 values
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256bh table = _mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_set1_ps(d), iota, _mm512_set1_ps(m)));
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m256i nib = _mm256_set1_epi16(0x0F);
  const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, nib)),
                                         _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib), 1);
  return (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_castsi256_si512((__m256i)table));
}

inline __m512bh widen_block_bf16_int8(const int8_t* q, float d) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m512 dv = _mm512_set1_ps(d);
  const __m512 lo = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw))));
  const __m512 hi = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// the sums of four vectors' lanes, as four floats
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 t = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));  // each 128-bit lane: a b c d
  t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(t);
}

inline __m512bh load_bf16x32(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// one output row's blocks widened to bfloat16 (32 a block) into w
template <typename Q>
inline void widen_row_bf16(const Q* q, const uint16_t* s, const uint16_t* o, int64_t k, c10::BFloat16* w) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m512bh v;
    if constexpr (std::is_same_v<Q, uint8_t>) {
      v = widen_block_bf16_int4(q + b * (kBlock / 2), half_bits(s[b]), half_bits(o[b]));
    } else {
      v = widen_block_bf16_int8(q + b * kBlock, half_bits(s[b]));
    }
    _mm512_storeu_si512(w + b * kBlock, (__m512i)v);
  }
}

// up to four input rows against one output row of int8 blocks, widened in registers
template <int R>
inline void bf16_dot_int8(const c10::BFloat16* x, int64_t k, const int8_t* q, const uint16_t* s, float* y) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m512bh w = widen_block_bf16_int8(q + b * kBlock, half_bits(s[b]));
    for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], load_bf16x32(x + r * k + b * kBlock), w);
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}

// int4 blocks against up to four input rows without widening them to their values: the nibbles
// become the bfloat16 integers 0-15 (exact) through one constant table, vdpbf16ps sums their
// products with x in float32, and each block's sum is scaled by its float32 scale; the offsets
// multiply each block's sum of x, taken once per call (xsum). About half the instructions a block
// of widening the values (a table per block, two broadcasts, a rounding), and the products are the
// exact values' (scale * q + offset in float32, not rounded to bfloat16).
inline __m256i nibble_table() {
  // the bfloat16 bits of 0..15: vpermw on 16 lanes reads the low 4 bits of an index, so a byte
  // widened to 16 bits indexes its low nibble as it is
  alignas(32) static const uint16_t v[16] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                             0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(v));
}

// the sums of four vectors' lanes, as four floats
inline __m128 reduce4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// R input rows against C output rows of int4 blocks (row r's of q, s, o at r * row_bytes, r * blocks):
// y[r * C + c]. C rows at a time share the loads of x and the work of a row's end (the offsets'
// term, the sums across lanes), which cost as much as a third of a row of SmolLM2's 18 blocks.
template <int R, int C>
inline void bf16_dot_int4(const c10::BFloat16* x, int64_t k, const uint8_t* q, const uint16_t* s, const uint16_t* o,
                          const float* xsum, const __m256i table, float* y) {
  const int64_t blocks = k / kBlock;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  alignas(64) float scale[C][16];
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const int64_t count = std::min<int64_t>(16, blocks - b0);
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    for (int c = 0; c < C; ++c) {
      _mm512_store_ps(scale[c], _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, s + c * blocks + b0)));
      // the offsets' term: offset x the block's sum of x, summed in any lane (all are summed at the end)
      for (int64_t h = 0; h < count; h += 8) {
        const __mmask8 m8 = static_cast<__mmask8>(mask >> h);
        const __m256 ov = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(m8, o + c * blocks + b0 + h));
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm256_fmadd_ps(ov, _mm256_maskz_loadu_ps(m8, xsum + r * blocks + b0 + h), acc[r][c]);
      }
    }
    if constexpr (C == 4) {  // the next group's scales and offsets (4 rows' worth: 8 bytes a block)
      prefetch_ahead(s + 4 * blocks + 4 * b0);
      prefetch_ahead(o + 4 * blocks + 4 * b0);
    }
    for (int64_t j = 0; j < count; ++j) {
      const int64_t b = b0 + j;
      // the next group's blocks, a cache line a block: four rows of k / 2 bytes over k / 32 blocks
      if constexpr (C == 4) prefetch_ahead(q + 2 * k + b * 64);
      __m256bh xv[R][2];
      for (int r = 0; r < R; ++r) {
        const c10::BFloat16* xb = x + r * k + b * kBlock;
        xv[r][0] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
        xv[r][1] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16));
      }
      for (int c = 0; c < C; ++c) {
        const __m256i bytes =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * (k / 2) + b * (kBlock / 2))));
        const __m256bh lo = (__m256bh)_mm256_permutexvar_epi16(bytes, table);
        const __m256bh hi = (__m256bh)_mm256_permutexvar_epi16(_mm256_srli_epi16(bytes, 4), table);
        const __m256 d = _mm256_broadcast_ss(&scale[c][j]);
        for (int r = 0; r < R; ++r) {
          const __m256 part = _mm256_dpbf16_ps(_mm256_dpbf16_ps(_mm256_setzero_ps(), xv[r][0], lo), xv[r][1], hi);
          acc[r][c] = _mm256_fmadd_ps(d, part, acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (C == 4) {
      _mm_storeu_ps(y + r * C, reduce4_256(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    } else {
      for (int c = 0; c < C; ++c) {
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r][c]), _mm256_extractf128_ps(acc[r][c], 1));
        const __m128 t = _mm_add_ps(h, _mm_movehl_ps(h, h));
        y[r * C + c] = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
      }
    }
  }
}

// each block's sum of each input row, [m][k / 32], in float32
inline std::vector<float> block_sums(const c10::BFloat16* x, int64_t m, int64_t k) {
  std::vector<float> out(m * (k / kBlock));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < k / kBlock; ++b) {
      const __m512i raw = _mm512_loadu_si512(x + r * k + b * kBlock);
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
      out[r * (k / kBlock) + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  return out;
}

// R input rows x four widened output rows (bfloat16, [4][k])
template <int R>
inline void tile_bf16(const c10::BFloat16* x, int64_t k, const c10::BFloat16* w, const float* bias, int64_t n0,
                      int64_t n, c10::BFloat16* y) {
  __m512 acc[R][kRows];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kRows; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += kBlock) {
    __m512bh w0 = load_bf16x32(w + i), w1 = load_bf16x32(w + k + i), w2 = load_bf16x32(w + 2 * k + i),
             w3 = load_bf16x32(w + 3 * k + i);
    __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));  // in registers (see tile_f32)
    for (int r = 0; r < R; ++r) {
      __m512bh xv = load_bf16x32(x + r * k + i);
      __asm__("" : "+v"(xv));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, w3);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(16) float sums[kRows];
    _mm_store_ps(sums, reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    for (int c = 0; c < kRows; ++c) y[r * n + n0 + c] = static_cast<c10::BFloat16>(sums[c] + (bias ? bias[n0 + c] : 0.f));
  }
}

// bf16_dot_int4 for C output rows from `row`, with the step's m_count input rows (1 to 4)
template <int C>
inline void int4_rows(int64_t m_count, const c10::BFloat16* x, int64_t k, const uint8_t* q, const uint16_t* s,
                      const uint16_t* o, const float* xsum, const __m256i table, float* acc) {
  switch (m_count) {
    case 4: bf16_dot_int4<4, C>(x, k, q, s, o, xsum, table, acc); break;
    case 3: bf16_dot_int4<3, C>(x, k, q, s, o, xsum, table, acc); break;
    case 2: bf16_dot_int4<2, C>(x, k, q, s, o, xsum, table, acc); break;
    default: bf16_dot_int4<1, C>(x, k, q, s, o, xsum, table, acc); break;
  }
}

// up to four input rows against int4 blocks, every output row: four a pass, the rest of an output
// count that is no multiple of 4 one by one
inline void bf16_decode_int4(const c10::BFloat16* x, int64_t m_count, int64_t k, int64_t n, const uint8_t* qs,
                             const uint16_t* scales, const uint16_t* offsets, const float* bias, c10::BFloat16* y) {
  const int64_t blocks = k / kBlock;
  const std::vector<float> xsum = block_sums(x, m_count, k);
  const __m256i table = nibble_table();
  at::parallel_for(0, (n + 3) / 4, 4, [&](int64_t begin, int64_t end) {
    float acc[kMaxRows * 4];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t row0 = g * 4, c = std::min<int64_t>(4, n - row0) == 4 ? 4 : 1;
      for (int64_t row = row0; row < std::min(row0 + 4, n); row += c) {
        const uint8_t* q = qs + row * (k / 2);
        if (c == 4) {
          int4_rows<4>(m_count, x, k, q, scales + row * blocks, offsets + row * blocks, xsum.data(), table, acc);
        } else {
          int4_rows<1>(m_count, x, k, q, scales + row * blocks, offsets + row * blocks, xsum.data(), table, acc);
        }
        for (int64_t r = 0; r < m_count; ++r)
          for (int64_t i = 0; i < c; ++i)
            y[r * n + row + i] = static_cast<c10::BFloat16>(acc[r * c + i] + (bias != nullptr ? bias[row + i] : 0.f));
      }
    }
  });
}

// Batches (5 to 95 rows): each strip of 16 * NV output rows is widened once into `wp` in the
// layout vdpbf16ps takes (pair p of 16 output rows in one vector: a 16x16 transpose of 32-bit
// pairs a block), then MR input rows x NV vectors of output rows are summed in registers, one
// broadcast pair of x and NV loads of weights for MR * NV products (oneDNN's bfloat16 GEMM works
// the same way on its packed weights). No horizontal sums: lane c is output row c.
template <typename Q>
void pack_strip(const Q* qs, int64_t row_len, const uint16_t* scales, const uint16_t* offsets, int64_t k, int64_t n0,
                int64_t cols, int64_t next, int64_t next_cols, uint32_t* wp) {
  const int64_t blocks = k / kBlock;
  constexpr int64_t block_bytes = std::is_same_v<Q, uint8_t> ? kBlock / 2 : kBlock, per_line = 64 / block_bytes;
  for (int64_t c0 = 0; c0 < cols; c0 += 16)
    for (int64_t b = 0; b < blocks; ++b) {
      // the next strip's weights into L2 a line a row at a time, while this one is multiplied: a
      // strip reads 16 rows side by side, more streams than the CPU's prefetchers follow
      if (b % per_line == 0)
        for (int64_t i = c0; i < std::min(c0 + 16, next_cols); ++i)
          _mm_prefetch(reinterpret_cast<const char*>(qs + (next + i) * row_len) + b * block_bytes, _MM_HINT_T1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t row = n0 + c0 + i;
        if constexpr (std::is_same_v<Q, uint8_t>) {
          r[i] = (__m512i)widen_block_bf16_int4(qs + row * row_len + b * (kBlock / 2), half_bits(scales[row * blocks + b]),
                                                half_bits(offsets[row * blocks + b]));
        } else {
          r[i] = (__m512i)widen_block_bf16_int8(qs + row * row_len + b * kBlock, half_bits(scales[row * blocks + b]));
        }
      }
      mmfusion::transpose16(r);  // r[p]: pair p of the block for the 16 output rows
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(wp + (b * 16 + p) * cols + c0, r[p]);
    }
}

// Named sums, not an array (see outer_tile_f32): GCC stored an array's every sum on every step
#define MMFUSION_BF16_SUM(r, v) \
  if constexpr (MR > r && NV > v) s##r##v = _mm512_dpbf16_ps(s##r##v, w[v], xb);
#define MMFUSION_BF16_ROW(r)                                                                \
  if constexpr (MR > r) {                                                                   \
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r * (k / 2) + p])); \
    MMFUSION_BF16_SUM(r, 0) MMFUSION_BF16_SUM(r, 1) MMFUSION_BF16_SUM(r, 2) MMFUSION_BF16_SUM(r, 3)   \
  }

template <int MR, int NV>
inline void outer_tile(const c10::BFloat16* x, int64_t k, const uint32_t* wp, int64_t cols, const float* bias,
                       int64_t n0, int64_t n, c10::BFloat16* y) {
  static_assert(MR >= 1 && MR <= kTileRows && NV >= 1 && NV <= 4, "six input rows and four vectors at most");
  const __m512 z = _mm512_setzero_ps();
  __m512 s00 = z, s01 = z, s02 = z, s03 = z, s10 = z, s11 = z, s12 = z, s13 = z, s20 = z, s21 = z, s22 = z, s23 = z,
         s30 = z, s31 = z, s32 = z, s33 = z, s40 = z, s41 = z, s42 = z, s43 = z, s50 = z, s51 = z, s52 = z, s53 = z;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  for (int64_t p = 0; p < k / 2; ++p) {
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(wp + p * cols + 16 * v);
    MMFUSION_BF16_ROW(0) MMFUSION_BF16_ROW(1) MMFUSION_BF16_ROW(2) MMFUSION_BF16_ROW(3) MMFUSION_BF16_ROW(4)
    MMFUSION_BF16_ROW(5)
  }
  const __m512 sums[6][4] = {{s00, s01, s02, s03}, {s10, s11, s12, s13}, {s20, s21, s22, s23},
                             {s30, s31, s32, s33}, {s40, s41, s42, s43}, {s50, s51, s52, s53}};
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      const __m512 out = bias ? _mm512_add_ps(sums[r][v], _mm512_loadu_ps(bias + n0 + 16 * v)) : sums[r][v];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + n0 + 16 * v), (__m256i)_mm512_cvtneps_pbh(out));
    }
}
#undef MMFUSION_BF16_ROW
#undef MMFUSION_BF16_SUM

// The strip width (vectors of 16 output rows) that finishes first on `threads` threads: the
// strips are shared out whole, so 576 outputs in strips of 64 leave one thread a fifth more work;
// narrower strips load more weights per product (their relative cost estimated from the loads a
// product needs, 4 vectors 1, 3 1.04, 2 1.12, not measured one by one).
inline int strip_vectors(int64_t n, int64_t threads) {
  const double cost[5] = {0, 0, 1.12, 1.04, 1.0};
  int best = 4;
  double best_t = 1e300;
  for (int nv = 4; nv >= 2; --nv) {
    const int64_t strips = (n + 16 * nv - 1) / (16 * nv), rounds = (strips + threads - 1) / threads;
    const double t = static_cast<double>(rounds * nv) * cost[nv];
    if (t < best_t - 1e-9) best = nv, best_t = t;
  }
  return best;
}

// From 24 rows packing a strip costs less than the tiles' horizontal sums and loads save (at 12 to
// 20 rows the tiles were 4-7% faster; at 32, 64 and 512 rows the strips 6%, 13% and 10%, and at
// 96 to 512 rows level with or ahead of oneDNN's prepacked bfloat16 GEMM, where the panels were
// 5-25% behind). Strips need output rows in whole vectors.
constexpr int64_t kOuterRows = 24;
inline bool outer_fits(int64_t rows, int64_t n) { return rows >= kOuterRows && n % 16 == 0; }

// the strips over weights that `pack(n0, cols, next, next_cols, wp)` lays out (quantized blocks, or dense rows)
template <typename Pack>
void bf16_outer_with(const c10::BFloat16* x, int64_t m_count, int64_t k, int64_t n, const float* bias,
                     c10::BFloat16* y, Pack pack) {
  const int nv = strip_vectors(n, at::get_num_threads());
  const int64_t width = 16 * nv, strips = (n + width - 1) / width;
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> wp(width * k / 2);
    for (int64_t strip = begin; strip < end; ++strip) {
      const int64_t n0 = strip * width, cols = std::min(width, n - n0);
      const int64_t next_cols = strip + 1 < end ? std::min(width, n - n0 - width) : 0;
      pack(n0, cols, n0 + width, next_cols, wp.data());
      row_tiles(m_count, [&](int64_t m, int64_t mr) {
        with_rows(mr, [&]<int MR>() {
          const auto tile = [&]<int NV>() { outer_tile<MR, NV>(x + m * k, k, wp.data(), cols, bias, n0, n, y + m * n); };
          switch (cols / 16) {  // a strip of 1 to 4 vectors of output rows
            case 4: tile.template operator()<4>(); break;
            case 3: tile.template operator()<3>(); break;
            case 2: tile.template operator()<2>(); break;
            default: tile.template operator()<1>(); break;
          }
        });
      });
    }
  });
}

template <typename Q>
void bf16_outer(const c10::BFloat16* x, int64_t m_count, int64_t k, int64_t n, const Q* qs, int64_t row_len,
                const uint16_t* scales, const uint16_t* offsets, const float* bias, c10::BFloat16* y) {
  bf16_outer_with(x, m_count, k, n, bias, y, [&](int64_t n0, int64_t cols, int64_t next, int64_t next_cols, uint32_t* wp) {
    pack_strip(qs, row_len, scales, offsets, k, n0, cols, next, next_cols, wp);
  });
}

// dense bfloat16 rows n0 .. n0 + cols of w [N, K] (K a multiple of 32) in vdpbf16ps's layout: a
// block of 32 values of 16 rows is a 16x16 transpose of 32-bit pairs, as pack_strip's
inline void pack_dense_bf16(const c10::BFloat16* w, int64_t k, int64_t n0, int64_t cols, uint32_t* wp) {
  for (int64_t c0 = 0; c0 < cols; c0 += 16)
    for (int64_t b = 0; b < k / kBlock; ++b) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(w + (n0 + c0 + i) * k + b * kBlock);
      mmfusion::transpose16(r);  // r[p]: pair p of the block for the 16 output rows
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(wp + (b * 16 + p) * cols + c0, r[p]);
    }
}

template <typename Q>
void bf16_rows(const c10::BFloat16* x, int64_t m_count, int64_t k, int64_t n, const Q* qs, int64_t row_len,
               const uint16_t* scales, const uint16_t* offsets, const float* bias, c10::BFloat16* y) {
  const int64_t blocks = k / kBlock;
  if (m_count <= kMaxRows) {
    if constexpr (std::is_same_v<Q, uint8_t>) {
      bf16_decode_int4(x, m_count, k, n, qs, scales, offsets, bias, y);
    } else {
      at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
        float acc[kMaxRows];
        for (int64_t row = begin; row < end; ++row) {
          const Q* q = qs + row * row_len;
          const uint16_t* s = scales + row * blocks;
          switch (m_count) {
            case 4: bf16_dot_int8<4>(x, k, q, s, acc); break;
            case 3: bf16_dot_int8<3>(x, k, q, s, acc); break;
            case 2: bf16_dot_int8<2>(x, k, q, s, acc); break;
            default: bf16_dot_int8<1>(x, k, q, s, acc); break;
          }
          for (int64_t r = 0; r < m_count; ++r)
            y[r * n + row] = static_cast<c10::BFloat16>(acc[r] + (bias != nullptr ? bias[row] : 0.f));
        }
      });
    }
    return;
  }
  at::parallel_for(0, (n + kRows - 1) / kRows, 2, [&](int64_t begin, int64_t end) {
    std::vector<c10::BFloat16> w(kRows * k);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kRows;
      const int64_t rows = std::min(kRows, n - n0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = n0 + r;
        widen_row_bf16(qs + row * row_len, scales + row * blocks, offsets ? offsets + row * blocks : nullptr, k,
                       w.data() + r * k);
      }
      if (rows < kRows) {  // the last group of an output count that is no multiple of 4
        for (int64_t m = 0; m < m_count; ++m)
          for (int64_t r = 0; r < rows; ++r) {
            float a = 0.f;
            for (int64_t i = 0; i < k; ++i) a += static_cast<float>(x[m * k + i]) * static_cast<float>(w[r * k + i]);
            y[m * n + n0 + r] = static_cast<c10::BFloat16>(a + (bias ? bias[n0 + r] : 0.f));
          }
        continue;
      }
      int64_t m = 0;
      for (; m + 4 <= m_count; m += 4) tile_bf16<4>(x + m * k, k, w.data(), bias, n0, n, y + m * n);
      for (; m < m_count; ++m) tile_bf16<1>(x + m * k, k, w.data(), bias, n0, n, y + m * n);
    }
  });
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

#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
// one row (a stream's decode step) against every output row of int4 blocks, in fixed point
// (fixed_decode.h). Only there: at two rows and more each row costs more in fixed point than the
// shared float32 widening, and int8 blocks at one row are bound by their bytes either way.
template <typename T>
void int4_row(const float* x, int64_t k, int64_t n, const uint8_t* qs, const uint16_t* scales,
              const uint16_t* offsets, const float* bias, T* y) {
  const mmfusion::FixedRow f(x, k);
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> du(blocks);
    for (int64_t row = begin; row < end; ++row) {
      const float v = mmfusion::int4_fixed(f, qs + row * (k / 2), scales + row * blocks, offsets + row * blocks, du.data());
      y[row] = static_cast<T>(v + (bias != nullptr ? bias[row] : 0.f));
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

// panels in float32 math, the output in x's dtype
template <typename Widen>
at::Tensor float_panels(const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias, Widen widen) {
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == n, "qlinear: bias must have ", n, " values");
  const at::Tensor y = panels<float>(float_rows(x), n, b, widen);
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

}  // namespace

#ifdef MMFUSION_QLINEAR_BF16
template <typename Q>
at::Tensor bf16_call(const at::Tensor& x, int64_t n, const c10::optional<at::Tensor>& bias, const Q* q, int64_t row_len,
                     const uint16_t* s, const uint16_t* o, bool strips) {
  const at::Tensor xc = x.contiguous();
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == n, "qlinear: bias must have ", n, " values");
  const bool outer = outer_fits(xc.size(0), n) || (strips && n % 16 == 0);
  if (xc.size(0) >= kPanelRows && !outer) {
    const int64_t k = xc.size(1), blocks = k / kBlock;
    return panels<c10::BFloat16>(xc, n, has_bias ? bias->to(at::kBFloat16) : at::Tensor(), [=](int64_t row, c10::BFloat16* w) {
      widen_row_bf16(q + row * row_len, s + row * blocks, o != nullptr ? o + row * blocks : nullptr, k, w);
    });
  }
  const at::Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({xc.size(0), n}, xc.options());
  if (outer) {
    bf16_outer(xc.data_ptr<c10::BFloat16>(), xc.size(0), xc.size(1), n, q, row_len, s, o,
               bf.defined() ? bf.data_ptr<float>() : nullptr, y.data_ptr<c10::BFloat16>());
    return y;
  }
  bf16_rows(xc.data_ptr<c10::BFloat16>(), xc.size(0), xc.size(1), n, q, row_len, s, o,
            bf.defined() ? bf.data_ptr<float>() : nullptr, y.data_ptr<c10::BFloat16>());
  return y;
}
#endif

#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
#define MMFUSION_DOTS(f) \
  [](auto... a) { f<4>(a...); }, [](auto... a) { f<3>(a...); }, [](auto... a) { f<2>(a...); }, \
      [](auto... a) { f<1>(a...); }
#endif

// x [M, K] (float32, bfloat16 or float16); qs uint8 [N, K / 2]; scales, offsets float16 [N, K / 32];
// returns [M, N] in x's dtype
at::Tensor qlinear_int4(at::Tensor x, at::Tensor qs, at::Tensor scales, at::Tensor offsets,
                        c10::optional<at::Tensor> bias, bool strips) {
  const int64_t n = qs.size(0), k = qs.size(1) * 2;
  check(x, scales, n, k, "qlinear_int4");
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous(), "qlinear_int4: qs must be contiguous uint8");
  TORCH_CHECK(offsets.scalar_type() == at::kHalf && offsets.is_contiguous() && offsets.numel() == scales.numel(),
              "qlinear_int4: offsets must be float16 like scales");
  if (x.size(0) == 0) return at::empty({0, n}, x.options());  // a chunk that keeps no row's logits
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* o = reinterpret_cast<const uint16_t*>(offsets.data_ptr<at::Half>());
#ifdef MMFUSION_QLINEAR_BF16
  if (x.scalar_type() == at::kBFloat16) return bf16_call(x, n, bias, q, k / 2, s, o, strips);
#endif
  strips = strips && n % 16 == 0;
  if (x.size(0) >= kPanelRows && !outer_fits_f32(x.size(0), n) && !strips) {
    const int64_t blocks = k / kBlock;
    return float_panels(x, n, bias, [=](int64_t row, float* w) {
      widen_int4(q + row * (k / 2), s + row * blocks, o + row * blocks, k, w);
    });
  }
  return run(x, n, bias, [&](auto* y, const float* xf, int64_t m, int64_t kk, const float* b) {
    using T = std::remove_pointer_t<decltype(y)>;
#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
    if (strips) {
      outer_f32<T>(xf, m, kk, n, b, y, q, kk / 2, s, o);
    } else if (m > kMaxRows) {
      const int64_t blocks = kk / kBlock;
      const auto widen = [=](int64_t row, float* w) {
        widen_int4(q + row * (kk / 2), s + row * blocks, o + row * blocks, kk, w);
      };
      if (outer_fits_f32(m, n)) {
        outer_f32<T>(xf, m, kk, n, b, y, q, kk / 2, s, o);
      } else {
        tiled_rows_f32<T>(xf, m, kk, n, b, y, widen);
      }
    } else if (m == 1) {
      int4_row<T>(xf, kk, n, q, s, o, b, y);
    } else {
      simd_rows_with<T, uint8_t>(MMFUSION_DOTS(int4_dot), xf, m, kk, n, q, kk / 2, s, o, b, y);
    }
#else
    const int64_t blocks = kk / kBlock;
    qlinear_rows<T>(xf, m, kk, n, b, y, [=](int64_t row, float* w) {
      widen_int4(q + row * (kk / 2), s + row * blocks, o + row * blocks, kk, w);
    });
#endif
  });
}

// x [M, K] (float32, bfloat16 or float16) against a dense weight w [N, K] (bfloat16, float16 or
// float32; N a multiple of 16, K of 32) through the strips, for any number of rows in one order
// (`deterministic`): bfloat16 x and w in vdpbf16ps pairs where the CPU has AVX512-BF16, float32
// math otherwise. Returns [M, N] in x's dtype; false from dense_strips_built() where neither is.
at::Tensor dense_strips(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dense_strips: x [rows, K] against w [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % 16 == 0 && k % kBlock == 0, "dense_strips: N must be a multiple of 16 and K of 32, got ", n, ", ", k);
  TORCH_CHECK(w.is_contiguous(), "dense_strips: w must be contiguous");
  if (x.size(0) == 0) return at::empty({0, n}, x.options());
#ifdef MMFUSION_QLINEAR_BF16
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16) {
    const at::Tensor xc = x.contiguous();
    const bool has_bias = bias.has_value() && bias->defined();
    const at::Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
    at::Tensor y = at::empty({xc.size(0), n}, xc.options());
    const c10::BFloat16* wd = w.data_ptr<c10::BFloat16>();
    bf16_outer_with(xc.data_ptr<c10::BFloat16>(), xc.size(0), k, n, bf.defined() ? bf.data_ptr<float>() : nullptr,
                    y.data_ptr<c10::BFloat16>(),
                    [&](int64_t n0, int64_t cols, int64_t, int64_t, uint32_t* wp) { pack_dense_bf16(wd, k, n0, cols, wp); });
    return y;
  }
#endif
#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
  return run(x, n, bias, [&](auto* y, const float* xf, int64_t m, int64_t kk, const float* b) {
    using T = std::remove_pointer_t<decltype(y)>;
    const auto strips = [&](const auto* wd) {
      outer_f32_with<T>(xf, m, kk, n, b, y, [&](int64_t n0, float* wp) { pack_dense_f32(wd, kk, n0, wp); });
    };
    switch (w.scalar_type()) {
      case at::kBFloat16: strips(w.data_ptr<c10::BFloat16>()); break;
      case at::kHalf: strips(w.data_ptr<c10::Half>()); break;
      case at::kFloat: strips(w.data_ptr<float>()); break;
      default: TORCH_CHECK(false, "dense_strips: weights must be bfloat16, float16 or float32, got ", w.scalar_type());
    }
  });
#else
  TORCH_CHECK(false, "dense_strips: not built at this CPU level");
#endif
}

bool dense_strips_built() {
#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
  return true;
#else
  return false;
#endif
}

// x [M, K]; qs int8 [N, K]; scales float16 [N, K / 32]; returns [M, N] in x's dtype
at::Tensor qlinear_int8(at::Tensor x, at::Tensor qs, at::Tensor scales, c10::optional<at::Tensor> bias, bool strips) {
  const int64_t n = qs.size(0), k = qs.size(1);
  check(x, scales, n, k, "qlinear_int8");
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous(), "qlinear_int8: qs must be contiguous int8");
  if (x.size(0) == 0) return at::empty({0, n}, x.options());
  const int8_t* q = qs.data_ptr<int8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
#ifdef MMFUSION_QLINEAR_BF16
  if (x.scalar_type() == at::kBFloat16) return bf16_call(x, n, bias, q, k, s, nullptr, strips);
#endif
  strips = strips && n % 16 == 0;
  if (x.size(0) >= kPanelRows && !outer_fits_f32(x.size(0), n) && !strips) {
    const int64_t blocks = k / kBlock;
    return float_panels(x, n, bias, [=](int64_t row, float* w) { widen_int8(q + row * k, s + row * blocks, k, w); });
  }
  return run(x, n, bias, [&](auto* y, const float* xf, int64_t m, int64_t kk, const float* b) {
    using T = std::remove_pointer_t<decltype(y)>;
#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
    if (strips) {
      outer_f32<T>(xf, m, kk, n, b, y, q, kk, s, nullptr);
    } else if (m > kMaxRows) {
      const int64_t blocks = kk / kBlock;
      const auto widen = [=](int64_t row, float* w) { widen_int8(q + row * kk, s + row * blocks, kk, w); };
      if (outer_fits_f32(m, n)) {
        outer_f32<T>(xf, m, kk, n, b, y, q, kk, s, nullptr);
      } else {
        tiled_rows_f32<T>(xf, m, kk, n, b, y, widen);
      }
    } else {
      simd_rows_with<T, int8_t>(MMFUSION_DOTS(int8_dot), xf, m, kk, n, q, kk, s, nullptr, b, y);
    }
#else
    const int64_t blocks = kk / kBlock;
    qlinear_rows<T>(xf, m, kk, n, b, y, [=](int64_t row, float* w) { widen_int8(q + row * kk, s + row * blocks, kk, w); });
#endif
  });
}
