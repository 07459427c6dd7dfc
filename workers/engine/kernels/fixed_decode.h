// Decode steps of float32 activations (one to four rows) against int4 and int8 blocks, multiplied
// in integers (included where AVX2, FMA and F16C are available).
//
// Widening every weight to float32 costs a conversion and a multiply-add a weight before the
// product itself, and a decode step does nothing else. Here each block of 32 activations is written
// once a call in fixed point instead, x = unit * (hi + lo / 65536) with hi and lo int16, unit the
// block's largest magnitude / 32767: 31 bits a value, finer than float32's 24 for the block's
// largest values (the outputs keep to the float32 tolerance of the kernel tests). Weights then
// widen only to int16, vpmaddwd multiplies them by both halves sixteen at a time into exact int32
// sums (int4: below 2^24, so exact in float32 too), and a block costs about 14 operations where
// the float32 widening took 26. The offset of an int4 block multiplies the float32 sum of the block's
// activations, once a block: sum((d q + m) x) = d sum(q x) + m sum(x). llama.cpp goes further and
// rounds the activations to 8 bits (Q8_1); these keep float32's precision.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "avx2_math.h"

namespace mmfusion {

constexpr int64_t kFixedBlock = 32;

// rows of activations in fixed point: x[r, i] = unit[r, b] * (hi[r, i] + lo[r, i] / 65536)
struct FixedRows {
  std::vector<int16_t> hi, lo;    // [rows, k]
  std::vector<float> unit, sums;  // [rows, k / 32]: a block's unit, and its values' float32 sum
  int64_t k = 0, blocks = 0;
};

// 16 int32 lanes (two vectors) into 16 int16 in order (packs interleaves the 128-bit halves)
inline __m256i pack16(__m256i a, __m256i b) { return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8); }

inline void to_fixed(const float* x, int64_t rows, int64_t k, FixedRows& f) {
  f.k = k;
  f.blocks = k / kFixedBlock;
  f.hi.resize(rows * k);
  f.lo.resize(rows * k);
  f.unit.resize(rows * f.blocks);
  f.sums.resize(rows * f.blocks);
  const __m256 sign = _mm256_set1_ps(-0.f), frac = _mm256_set1_ps(65536.f);
  for (int64_t rb = 0; rb < rows * f.blocks; ++rb) {
    const float* xb = x + rb * kFixedBlock;
    const __m256 v[4] = {_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)};
    const float most = hmax8(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
    f.sums[rb] = hadd8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
    f.unit[rb] = most / 32767.f;
    const __m256 inv = _mm256_set1_ps(most > 0.f ? 32767.f / most : 0.f);
    __m256i hi[4], lo[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 t = _mm256_mul_ps(v[i], inv);  // |t| <= 32767
      const __m256 h = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      hi[i] = _mm256_cvtps_epi32(h);
      lo[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(t, h), frac));  // t - h is exact; packs saturates 32768
    }
    auto* ho = reinterpret_cast<__m256i*>(f.hi.data() + rb * kFixedBlock);
    auto* lo_out = reinterpret_cast<__m256i*>(f.lo.data() + rb * kFixedBlock);
    _mm256_storeu_si256(ho, pack16(hi[0], hi[1]));
    _mm256_storeu_si256(ho + 1, pack16(hi[2], hi[3]));
    _mm256_storeu_si256(lo_out, pack16(lo[0], lo[1]));
    _mm256_storeu_si256(lo_out + 1, pack16(lo[2], lo[3]));
  }
}

// du[r * blocks + b] = the weights' scale of block b * the activations' unit of row r, block b
template <int R>
inline void block_units(const FixedRows& f, const uint16_t* s, float* du) {
  for (int r = 0; r < R; ++r) {
    const float* u = f.unit.data() + r * f.blocks;
    float* o = du + r * f.blocks;
    int64_t b = 0;
    for (; b + 8 <= f.blocks; b += 8) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b)));
      _mm256_storeu_ps(o + b, _mm256_mul_ps(d, _mm256_loadu_ps(u + b)));
    }
    for (; b < f.blocks; ++b) o[b] = _cvtsh_ss(s[b]) * u[b];
  }
}

// sum(q x) over a block of int16 weights (w0: values 0-15, w1: 16-31) and fixed-point activations,
// in the activations' units
inline __m256 fixed_block(__m256i w0, __m256i w1, const FixedRows& f, int64_t at) {
  const auto* h = reinterpret_cast<const __m256i*>(f.hi.data() + at);
  const auto* l = reinterpret_cast<const __m256i*>(f.lo.data() + at);
  const __m256 hs = _mm256_cvtepi32_ps(
      _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(h)), _mm256_madd_epi16(w1, _mm256_loadu_si256(h + 1))));
  const __m256 ls = _mm256_cvtepi32_ps(
      _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(l)), _mm256_madd_epi16(w1, _mm256_loadu_si256(l + 1))));
  return _mm256_fmadd_ps(ls, _mm256_set1_ps(1.f / 65536.f), hs);
}

// y[r] = x[r] . w for R rows, w one output row of int4 blocks (GGUF's Q4_1 layout: value j in the
// low nibble of byte j, value j + 16 in its high nibble; w = d q + m); du holds R * blocks floats
template <int R>
inline void int4_fixed(const FixedRows& f, const uint8_t* q, const uint16_t* s, const uint16_t* o, float* du, float* y) {
  block_units<R>(f, s, du);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < f.blocks; ++b) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * (kFixedBlock / 2)));
    const __m256i w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, mask));
    const __m256i w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(fixed_block(w0, w1, f, r * f.k + b * kFixedBlock), _mm256_broadcast_ss(du + r * f.blocks + b),
                               acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* sums = f.sums.data() + r * f.blocks;
    __m256 off = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= f.blocks; b += 8) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + b)));
      off = _mm256_fmadd_ps(m, _mm256_loadu_ps(sums + b), off);
    }
    float t = hadd8(_mm256_add_ps(acc[r], off));
    for (; b < f.blocks; ++b) t += _cvtsh_ss(o[b]) * sums[b];
    y[r] = t;
  }
}

// the same for int8 blocks (Q8_0: 32 signed bytes, w = d q); int32 sums stay below 2^28
template <int R>
inline void int8_fixed(const FixedRows& f, const int8_t* q, const uint16_t* s, const uint16_t*, float* du, float* y) {
  block_units<R>(f, s, du);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < f.blocks; ++b) {
    const auto* raw = reinterpret_cast<const __m128i*>(q + b * kFixedBlock);
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(raw));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(raw + 1));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(fixed_block(w0, w1, f, r * f.k + b * kFixedBlock), _mm256_broadcast_ss(du + r * f.blocks + b),
                               acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = hadd8(acc[r]);
}

}  // namespace mmfusion
