// Weight-only quantized linears in float32 on AVX2 (with FMA and F16C) and AVX-512 (qlinear_common.h):
// up to four input rows in registers, tiles of rows against four widened output rows, and from 24
// rows the strips of an outer-product GEMM; the dense strips of `deterministic` share them.
#pragma once
#include "qlinear_common.h"

namespace {

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

// Up to four input rows against one output row. A block's values widen once (vpmovzxbd from the
// bytes, its scale and offset broadcast from float32 converted eight blocks at a time) and feed
// every row; each row keeps two sums. The sums are named variables (GCC stored arrays of them to the
// stack on every block, and four rows ran no faster a row than one) and at most eight, so that with
// the widened values they stay in AVX2's 16 registers.
#define MMFUSION_DOT_ROW(r, wa, wb, oa, ob)                                        \
  if constexpr (R > r) {                                                           \
    s##r##a = _mm256_fmadd_ps(wa, _mm256_loadu_ps(xb + r * k + (oa)), s##r##a);     \
    s##r##b = _mm256_fmadd_ps(wb, _mm256_loadu_ps(xb + r * k + (ob)), s##r##b);     \
  }
#define MMFUSION_DOT_ROWS(wa, wb, oa, ob) \
  MMFUSION_DOT_ROW(0, wa, wb, oa, ob) MMFUSION_DOT_ROW(1, wa, wb, oa, ob) MMFUSION_DOT_ROW(2, wa, wb, oa, ob) \
  MMFUSION_DOT_ROW(3, wa, wb, oa, ob)

// A row's blocks a pass of the dot kernels below: their scales (and offsets) are converted to
// float32 for up to this many blocks at once, so that each block broadcasts them from memory
constexpr int64_t kDotBlocks = 128;

// float32 values of count float16 into out
inline void halves(const uint16_t* h, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  }
  for (; i < count; ++i) out[i] = _cvtsh_ss(h[i]);
}

// y[r] = x[r] . w for R input rows (R <= 4), w one output row of int4 blocks
template <int R>
inline void int4_dot(const float* x, int64_t k, const uint8_t* q, const uint16_t* s, const uint16_t* o, float* y) {
  static_assert(R >= 1 && R <= 4, "four input rows at most");
  const __m256 z = _mm256_setzero_ps();
  __m256 s0a = z, s0b = z, s1a = z, s1b = z, s2a = z, s2b = z, s3a = z, s3b = z;
  const __m256i mask = _mm256_set1_epi32(0x0F);
  const int64_t blocks = k / kBlock;
  alignas(32) float ds[kDotBlocks], ms[kDotBlocks];
  for (int64_t b0 = 0; b0 < blocks; b0 += kDotBlocks) {
    const int64_t count = std::min(kDotBlocks, blocks - b0);
    halves(s + b0, count, ds);
    halves(o + b0, count, ms);
    for (int64_t j = 0; j < count; ++j) {
      const uint8_t* qb = q + (b0 + j) * (kBlock / 2);
      const float* xb = x + (b0 + j) * kBlock;
      const __m256 d = _mm256_broadcast_ss(ds + j), m = _mm256_broadcast_ss(ms + j);
      // bytes 0-7 hold values 0-7 in their low nibbles and 16-23 in their high ones; bytes 8-15 the rest
      const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb)));
      const __m256 w0 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(lo, mask)), m);
      const __m256 w2 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), m);
      MMFUSION_DOT_ROWS(w0, w2, 0, 16)
      const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8)));
      const __m256 w1 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask)), m);
      const __m256 w3 = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), m);
      MMFUSION_DOT_ROWS(w1, w3, 8, 24)
    }
  }
  const __m256 sums[4] = {_mm256_add_ps(s0a, s0b), _mm256_add_ps(s1a, s1b), _mm256_add_ps(s2a, s2b),
                          _mm256_add_ps(s3a, s3b)};
  for (int r = 0; r < R; ++r) y[r] = hsum8(sums[r]);
}

template <int R>
inline void int8_dot(const float* x, int64_t k, const int8_t* q, const uint16_t* s, const uint16_t*, float* y) {
  static_assert(R >= 1 && R <= 4, "four input rows at most");
  const __m256 z = _mm256_setzero_ps();
  __m256 s0a = z, s0b = z, s1a = z, s1b = z, s2a = z, s2b = z, s3a = z, s3b = z;
  const int64_t blocks = k / kBlock;
  alignas(32) float ds[kDotBlocks];
  const auto widen = [](const int8_t* p, __m256 d) {
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
  };
  for (int64_t b0 = 0; b0 < blocks; b0 += kDotBlocks) {
    const int64_t count = std::min(kDotBlocks, blocks - b0);
    halves(s + b0, count, ds);
    for (int64_t j = 0; j < count; ++j) {
      const int8_t* qb = q + (b0 + j) * kBlock;
      const float* xb = x + (b0 + j) * kBlock;
      const __m256 d = _mm256_broadcast_ss(ds + j);
      const __m256 w0 = widen(qb, d), w1 = widen(qb + 8, d);
      MMFUSION_DOT_ROWS(w0, w1, 0, 8)
      const __m256 w2 = widen(qb + 16, d), w3 = widen(qb + 24, d);
      MMFUSION_DOT_ROWS(w2, w3, 16, 24)
    }
  }
  const __m256 sums[4] = {_mm256_add_ps(s0a, s0b), _mm256_add_ps(s1a, s1b), _mm256_add_ps(s2a, s2b),
                          _mm256_add_ps(s3a, s3b)};
  for (int r = 0; r < R; ++r) y[r] = hsum8(sums[r]);
}
#undef MMFUSION_DOT_ROWS
#undef MMFUSION_DOT_ROW
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

}  // namespace
