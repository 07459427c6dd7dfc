// One row of float32 activations (a stream's decode step) against int4 or int8 blocks, multiplied
// in integers (included where AVX2, FMA and F16C are available).
//
// Widening every weight to float32 costs a conversion and a multiply-add a weight before the
// product itself, and at one row a decode step does little else. Here each block of 32
// activations is written once a call in fixed point instead, x = unit * (hi + lo / 65536) with hi
// and lo int16 and unit the block's largest magnitude / 32767: 31 bits a value, finer than
// float32's 24 for the block's largest values (the outputs keep to the float32 tolerance of the
// kernel tests). The weights then widen only to int16, vpmaddwd multiplies them by both halves
// sixteen at a time into exact int32 sums (below 2^24 for int8 blocks too, so exact in float32),
// and a block costs about 13 operations where the float32 widening took 18 (int4) or 16 (int8). The
// offset of an int4 block multiplies the float32 sum of the block's activations, once a block:
// sum((d q + m) x) = d sum(q x) + m sum(x). llama.cpp goes further and rounds the activations to
// 8 bits (Q8_1); these keep float32's precision.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "avx2_math.h"

namespace mmfusion {

constexpr int64_t kFixedBlock = 32;

// 16 int32 lanes (two vectors) into 16 int16 in order (packs interleaves the 128-bit halves)
inline __m256i pack16(__m256i a, __m256i b) { return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8); }

// a row of activations in fixed point: x[i] = unit[b] * (hi[i] + lo[i] / 65536), b = i / 32
struct FixedRow {
  std::vector<int16_t> hi, lo;    // [k]
  std::vector<float> unit, sums;  // [k / 32]: a block's unit, and its values' float32 sum
  int64_t blocks;

  FixedRow(const float* x, int64_t k) : hi(k), lo(k), unit(k / kFixedBlock), sums(k / kFixedBlock), blocks(k / kFixedBlock) {
    const __m256 sign = _mm256_set1_ps(-0.f), frac = _mm256_set1_ps(65536.f);
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + b * kFixedBlock;
      const __m256 v[4] = {_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)};
      const float most = hmax8(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
      sums[b] = hadd8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
      unit[b] = most / 32767.f;
      const __m256 inv = _mm256_set1_ps(most > 0.f ? 32767.f / most : 0.f);
      __m256i h32[4], l32[4];
      for (int i = 0; i < 4; ++i) {
        const __m256 t = _mm256_mul_ps(v[i], inv);  // |t| <= 32767
        const __m256 h = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        h32[i] = _mm256_cvtps_epi32(h);
        l32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(t, h), frac));  // t - h is exact; packs saturates 32768
      }
      auto* ho = reinterpret_cast<__m256i*>(hi.data() + b * kFixedBlock);
      auto* lo_out = reinterpret_cast<__m256i*>(lo.data() + b * kFixedBlock);
      _mm256_storeu_si256(ho, pack16(h32[0], h32[1]));
      _mm256_storeu_si256(ho + 1, pack16(h32[2], h32[3]));
      _mm256_storeu_si256(lo_out, pack16(l32[0], l32[1]));
      _mm256_storeu_si256(lo_out + 1, pack16(l32[2], l32[3]));
    }
  }
};

// d * unit for each of a row's blocks, into du
inline void block_units(const FixedRow& f, const uint16_t* s, float* du) {
  int64_t b = 0;
  for (; b + 8 <= f.blocks; b += 8) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b)));
    _mm256_storeu_ps(du + b, _mm256_mul_ps(d, _mm256_loadu_ps(f.unit.data() + b)));
  }
  for (; b < f.blocks; ++b) du[b] = _cvtsh_ss(s[b]) * f.unit[b];
}

// the float32 sum of block b for w0, w1 its 32 integer weights (values 0-15 and 16-31) as int16:
// exact int32 sums for each half of x, joined in float32
inline __m256 fixed_block(const FixedRow& f, int64_t b, __m256i w0, __m256i w1) {
  const auto* h = reinterpret_cast<const __m256i*>(f.hi.data() + b * kFixedBlock);
  const auto* l = reinterpret_cast<const __m256i*>(f.lo.data() + b * kFixedBlock);
  const __m256 hs = _mm256_cvtepi32_ps(
      _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(h)), _mm256_madd_epi16(w1, _mm256_loadu_si256(h + 1))));
  const __m256 ls = _mm256_cvtepi32_ps(
      _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(l)), _mm256_madd_epi16(w1, _mm256_loadu_si256(l + 1))));
  return _mm256_fmadd_ps(ls, _mm256_set1_ps(1.f / 65536.f), hs);
}

// sum over a row's blocks of du[b] times block b's sum, where weights(b, w0, w1) widens block b;
// the blocks alternate between two sums, so that each waits on the FMA half as often
template <typename Weights>
inline __m256 fixed_blocks(const FixedRow& f, const float* du, Weights weights) {
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  __m256i w0, w1;
  int64_t b = 0;
  for (; b + 2 <= f.blocks; b += 2) {
    weights(b, w0, w1);
    even = _mm256_fmadd_ps(fixed_block(f, b, w0, w1), _mm256_broadcast_ss(du + b), even);
    weights(b + 1, w0, w1);
    odd = _mm256_fmadd_ps(fixed_block(f, b + 1, w0, w1), _mm256_broadcast_ss(du + b + 1), odd);
  }
  if (b < f.blocks) {
    weights(b, w0, w1);
    even = _mm256_fmadd_ps(fixed_block(f, b, w0, w1), _mm256_broadcast_ss(du + b), even);
  }
  return _mm256_add_ps(even, odd);
}

// x . w for w one output row of int4 blocks (GGUF's Q4_1 layout: value j in the low nibble of byte
// j, value j + 16 in its high nibble; w = d q + m); du: room for the row's blocks' d * unit
inline float int4_fixed(const FixedRow& f, const uint8_t* q, const uint16_t* s, const uint16_t* o, float* du) {
  block_units(f, s, du);
  const __m256i mask = _mm256_set1_epi16(0x0F);
  const __m256 dots = fixed_blocks(f, du, [&](int64_t b, __m256i& w0, __m256i& w1) {
    // byte j widened to int16 holds value j in its low four bits and value j + 16 in the next four
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * (kFixedBlock / 2))));
    w0 = _mm256_and_si256(v, mask);
    w1 = _mm256_srli_epi16(v, 4);
  });
  __m256 off = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= f.blocks; b += 8) {
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + b)));
    off = _mm256_fmadd_ps(m, _mm256_loadu_ps(f.sums.data() + b), off);
  }
  float t = hadd8(_mm256_add_ps(dots, off));
  for (; b < f.blocks; ++b) t += _cvtsh_ss(o[b]) * f.sums[b];
  return t;
}

// x . w for w one output row of int8 blocks (GGUF's Q8_0: 32 signed bytes, w = d q)
inline float int8_fixed(const FixedRow& f, const int8_t* q, const uint16_t* s, float* du) {
  block_units(f, s, du);
  return hadd8(fixed_blocks(f, du, [&](int64_t b, __m256i& w0, __m256i& w1) {
    const auto* qb = reinterpret_cast<const __m128i*>(q + b * kFixedBlock);
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(qb));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(qb + 1));
  }));
}

}  // namespace mmfusion
