// Up to four rows against int4 or int8 blocks with the activations rounded to 8 bits: the `act8`
// choice of a few-row step (row_kernels). bfloat16 rows on AVX512-VNNI (the AVX512-BF16 builds),
// float32 rows on AVX2 (a model of 16-bit weights computing in float32, below).
//
// A decode step of a stream reads its weights from the cache or memory once, and the widening of
// each block to bfloat16 (qlinear_bf16.h: about 8 vector operations a block) held it at 2-4x the
// time its bytes take. Rounded to int8 a block at a time (a float32 scale each, as llama.cpp's
// Q8_0/Q8_1), the activations meet the weights' bytes as they are: vpdpbusd multiplies 64 unsigned
// by 64 signed bytes into 16 int32 sums, so a block costs under 3 operations. The sums are exact;
// the activations' rounding (half a step of their block's largest magnitude / 127) is the price, the
// same llama.cpp pays on every quantized linear. An int4 block's offset multiplies the block's sum of
// the rounded activations (Q8_1's s), so the rounding errors of both terms cancel as in
// sum(w * x8); the float32 sum of x left them apart and doubled the error.
#pragma once
#include "qlinear_bf16.h"

#if defined(MMFUSION_QLINEAR_BF16) && defined(__AVX512VNNI__)
#define MMFUSION_QLINEAR_ACT8 1
#endif
// float32 rows (16-bit weights with float32 math: a CPU without bf16 arithmetic), on AVX2: vpmaddubsw
// multiplies 32 unsigned by 32 signed bytes into pairs of int16 sums (at most 2 x 255 x 127: no
// saturation for nibbles, nor for int8 blocks made unsigned by their sign, as llama.cpp's AVX2 path
// does), vpmaddwd adds the pairs into int32
#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
#define MMFUSION_QLINEAR_ACT8_F32 1
#endif

namespace {

#ifdef MMFUSION_QLINEAR_ACT8
// The input rows rounded to 8 bits a block of 32, in the order each weight format reads them.
struct Act8Rows {
  int64_t m, k, blocks, groups;  // groups: of 4 blocks (int4), of 2 (int8)
  // int4: per row and group of 4 blocks, the 4 blocks' values 0-15 (64 bytes), then their values
  // 16-31 (64 bytes): the order of a 64-byte load of 4 blocks' nibbles, low then high.
  // int8: per row and group of 2 blocks, their 64 values in order.
  std::vector<int8_t> q;
  std::vector<float> scale;  // per row and group, 16 lanes: each lane's block's scale (dpbusd's lanes)
  std::vector<float> sums;   // int4: per row and block, scale * the sum of the block's int8 values
  std::vector<int32_t> fix;  // int8: per row and group, 16 lanes: -128 * the block's int8 sum in its first lane

  Act8Rows(const c10::BFloat16* x, int64_t m, int64_t k, bool int4)
      : m(m), k(k), blocks(k / kBlock), groups(int4 ? (k / kBlock + 3) / 4 : (k / kBlock + 1) / 2),
        q(m * groups * 128, 0), scale(m * groups * 16, 0.f), sums(int4 ? m * blocks : 0),
        fix(int4 ? 0 : m * groups * 16, 0) {
    const int64_t per = int4 ? 4 : 2;  // blocks a group
    for (int64_t r = 0; r < m; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const __m512i raw = _mm512_loadu_si512(x + r * k + b * kBlock);
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
        const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
        const float most = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const __m512 inv = _mm512_set1_ps(most > 0.f ? 127.f / most : 0.f);
        const __m512i ilo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), ihi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
        const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(ilo, ihi));
        const float d = most / 127.f;
        const int64_t g = b / per, j = b % per;
        int8_t* dst = q.data() + (r * groups + g) * 128;
        float* sc = scale.data() + (r * groups + g) * 16;
        if (int4) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * j), _mm512_cvtsepi32_epi8(ilo));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 64 + 16 * j), _mm512_cvtsepi32_epi8(ihi));
          for (int l = 0; l < 4; ++l) sc[4 * j + l] = d;
          sums[r * blocks + b] = d * static_cast<float>(total);
        } else {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * j), _mm512_cvtsepi32_epi8(ilo));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * j + 16), _mm512_cvtsepi32_epi8(ihi));
          for (int l = 0; l < 8; ++l) sc[8 * j + l] = d;
          fix[(r * groups + g) * 16 + 8 * j] = -128 * total;
        }
      }
  }
};

template <int R, int C>
inline void zero_sums(__m512 (&acc)[R][C]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
}

// y[r * C + c]: the sum of acc[r][c]'s lanes
template <int R, int C>
inline void store_sums(const __m512 (&acc)[R][C], float* y) {
  for (int r = 0; r < R; ++r) {
    if constexpr (C == 4) {
      _mm_storeu_ps(y + r * C, reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    } else {
      for (int c = 0; c < C; ++c) y[r * C + c] = _mm512_reduce_add_ps(acc[r][c]);
    }
  }
}

// R input rows against C output rows of int4 blocks (row c's at c * k / 2 bytes, c * blocks scales):
// y[r * C + c]. Four blocks a step: one 64-byte load of their nibbles, two vpdpbusd.
template <int R, int C>
inline void act8_dot_int4(const Act8Rows& x, const uint8_t* q, const uint16_t* s, const uint16_t* o, float* y) {
  const int64_t blocks = x.blocks, half = x.k / 2;
  __m512 acc[R][C];
  zero_sums<R, C>(acc);
  // the offsets' term: offset x the block's sum of x, in any lane (all are summed at the end)
  for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, blocks - b0)) - 1);
    for (int c = 0; c < C; ++c) {
      const __m512 ov = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, o + c * blocks + b0));
      for (int r = 0; r < R; ++r)
        acc[r][c] = _mm512_fmadd_ps(ov, _mm512_maskz_loadu_ps(mask, x.sums.data() + r * blocks + b0), acc[r][c]);
    }
  }
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  for (int64_t g = 0; g < x.groups; ++g) {
    const int64_t b0 = 4 * g, count = std::min<int64_t>(4, blocks - b0);
    const __mmask64 bytes = count == 4 ? ~0ull : (1ull << (16 * count)) - 1;
    const __mmask8 lanes = static_cast<__mmask8>((1u << count) - 1);
    if constexpr (C == 4) {  // the next four rows' matching 256 bytes (their blocks are 4 * k / 2 on)
      for (int i = 0; i < 4; ++i) prefetch_ahead(q + 4 * half + 4 * b0 * 16 + 64 * i);
    }
    __m512i lo_x[R], hi_x[R];
    __m512 dx[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* p = x.q.data() + (r * x.groups + g) * 128;
      lo_x[r] = _mm512_loadu_si512(p);
      hi_x[r] = _mm512_loadu_si512(p + 64);
      dx[r] = _mm512_loadu_ps(x.scale.data() + (r * x.groups + g) * 16);
    }
    for (int c = 0; c < C; ++c) {
      const __m512i v = _mm512_maskz_loadu_epi8(bytes, q + c * half + b0 * 16);
      const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      const __m512 dw = _mm512_permutexvar_ps(
          spread, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_maskz_loadu_epi16(lanes, s + c * blocks + b0))));
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, lo_x[r]), hi, hi_x[r]);
        acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx[r]), _mm512_cvtepi32_ps(dot), acc[r][c]);
      }
    }
  }
  store_sums<R, C>(acc, y);
}

// R input rows against C output rows of int8 blocks: two blocks a step. vpdpbusd takes one side
// unsigned, so the weights go in offset by 128 (a flipped sign bit) and each block's sum starts at
// -128 x the sum of its activations, which takes the offset back out exactly.
template <int R, int C>
inline void act8_dot_int8(const Act8Rows& x, const int8_t* q, const uint16_t* s, float* y) {
  const int64_t blocks = x.blocks, k = x.k;
  __m512 acc[R][C];
  zero_sums<R, C>(acc);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int64_t g = 0; g < x.groups; ++g) {
    const int64_t b0 = 2 * g;
    const bool both = b0 + 1 < blocks;
    const __mmask64 bytes = both ? ~0ull : 0xFFFFFFFFull;
    if constexpr (C == 4) {  // the next four rows' matching 256 bytes
      for (int i = 0; i < 4; ++i) prefetch_ahead(q + 4 * k + 4 * b0 * kBlock + 64 * i);
    }
    __m512i xv[R], start[R];
    __m512 dx[R];
    for (int r = 0; r < R; ++r) {
      const int64_t at = r * x.groups + g;
      xv[r] = _mm512_loadu_si512(x.q.data() + at * 128);
      start[r] = _mm512_loadu_si512(x.fix.data() + at * 16);
      dx[r] = _mm512_loadu_ps(x.scale.data() + at * 16);
    }
    for (int c = 0; c < C; ++c) {
      const __m512i w = _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes, q + c * k + b0 * kBlock), flip);
      const __m512 dw = _mm512_permutexvar_ps(
          spread, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_maskz_loadu_epi16(both ? 3 : 1, s + c * blocks + b0))));
      for (int r = 0; r < R; ++r) {
        // a lone last block: its second half of lanes multiplies zeros (x's padding) by 128
        const __m512i dot = _mm512_dpbusd_epi32(start[r], w, xv[r]);
        acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx[r]), _mm512_cvtepi32_ps(dot), acc[r][c]);
      }
    }
  }
  store_sums<R, C>(acc, y);
}

template <int R, typename Q>
inline void act8_pass(const Act8Rows& x, const Q* q, const uint16_t* s, const uint16_t* o, int64_t c, float* acc) {
  if constexpr (std::is_same_v<Q, uint8_t>) {
    c == 4 ? act8_dot_int4<R, 4>(x, q, s, o, acc) : act8_dot_int4<R, 1>(x, q, s, o, acc);
  } else {
    c == 4 ? act8_dot_int8<R, 4>(x, q, s, acc) : act8_dot_int8<R, 1>(x, q, s, acc);
  }
}

// 1 to 4 bfloat16 rows against every output row: four output rows a pass, the rest of an output
// count that is no multiple of 4 one by one
template <typename Q>
void act8_rows(const c10::BFloat16* x, int64_t m_count, int64_t k, int64_t n, const Q* qs, int64_t row_len,
               const uint16_t* scales, const uint16_t* offsets, const float* bias, c10::BFloat16* y) {
  const Act8Rows xr(x, m_count, k, std::is_same_v<Q, uint8_t>);
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, (n + 3) / 4, 4, [&](int64_t begin, int64_t end) {
    float acc[kMaxRows * 4];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t row0 = g * 4, c = n - row0 >= 4 ? 4 : 1;
      for (int64_t row = row0; row < std::min(row0 + 4, n); row += c) {
        const Q* q = qs + row * row_len;
        const uint16_t* s = scales + row * blocks;
        const uint16_t* o = offsets != nullptr ? offsets + row * blocks : nullptr;
        switch (m_count) {
          case 4: act8_pass<4>(xr, q, s, o, c, acc); break;
          case 3: act8_pass<3>(xr, q, s, o, c, acc); break;
          case 2: act8_pass<2>(xr, q, s, o, c, acc); break;
          default: act8_pass<1>(xr, q, s, o, c, acc); break;
        }
        for (int64_t r = 0; r < m_count; ++r)
          for (int64_t i = 0; i < c; ++i)
            y[r * n + row + i] = static_cast<c10::BFloat16>(acc[r * c + i] + (bias != nullptr ? bias[row + i] : 0.f));
      }
    }
  });
}
#endif

#ifdef MMFUSION_QLINEAR_ACT8_F32
// The float32 input rows rounded to 8 bits a block of 32, in order: the int8 values, a scale a block
// (its largest magnitude / 127) and scale x the sum of its int8 values (an int4 block's offset term).
struct Act8RowsF32 {
  int64_t k, blocks;
  std::vector<int8_t> q;
  std::vector<float> scale, sums;

  Act8RowsF32(const float* x, int64_t m, int64_t k)
      : k(k), blocks(k / kBlock), q(m * k), scale(m * (k / kBlock)), sums(m * (k / kBlock)) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + r * k + b * kBlock;
        __m256 v[4];
        for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
        const float most = mmfusion::hmax8(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                                         _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
        const __m256 inv = _mm256_set1_ps(most > 0.f ? 127.f / most : 0.f);
        __m256i i32[4];
        for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
        // int32 -> int16 -> int8 in order (packs interleaves the 128-bit halves: permute back)
        const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[0], i32[1]), 0xD8);
        const __m256i w16b = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[2], i32[3]), 0xD8);
        const __m256i w8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(w16, w16b), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + r * k + b * kBlock), w8);
        const float d = most / 127.f;
        scale[r * blocks + b] = d;
        sums[r * blocks + b] = d * static_cast<float>(_mm_cvtsi128_si32(t));
      }
  }
};

// an int4 block's 16 bytes as its 32 values 0-15 in order (low nibbles, then high)
inline __m256i nibbles32(const uint8_t* q) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// R float32 input rows (from r0) against C output rows of int4 or int8 blocks: y[r * C + c]. AVX2 has
// 16 vector registers: C is 4 for one or two rows, 2 for three or four.
template <int R, int C, typename Q>
inline void act8_f32_dot(const Act8RowsF32& x, int64_t r0, const Q* q, const uint16_t* s, const uint16_t* o,
                         float* y) {
  constexpr bool int4 = std::is_same_v<Q, uint8_t>;
  const int64_t blocks = x.blocks, row_len = int4 ? x.k / 2 : x.k;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][C];
  float offset[R][C] = {};
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    if constexpr (C == 4) {  // the next C rows' matching bytes: one line a block (int4), two (int8)
      const char* next = reinterpret_cast<const char*>(q + C * row_len) + b * C * (int4 ? kBlock / 2 : kBlock);
      _mm_prefetch(next, _MM_HINT_T0);
      if constexpr (!int4) _mm_prefetch(next + 64, _MM_HINT_T0);
    }
    __m256i xv[R];
    float dx[R];
    for (int r = 0; r < R; ++r) {
      xv[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + (r0 + r) * x.k + b * kBlock));
      dx[r] = x.scale[(r0 + r) * blocks + b];
    }
    for (int c = 0; c < C; ++c) {
      const float dw = half_bits(s[c * blocks + b]);
      __m256i w;
      if constexpr (int4) {
        w = nibbles32(q + c * row_len + b * (kBlock / 2));
        const float m = half_bits(o[c * blocks + b]);  // the offset x the block's sum of x
        for (int r = 0; r < R; ++r) offset[r][c] += m * x.sums[(r0 + r) * blocks + b];
      } else {
        w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * row_len + b * kBlock));
      }
      const __m256i wu = int4 ? w : _mm256_sign_epi8(w, w);  // int8: |w| unsigned, its sign moved onto x
      for (int r = 0; r < R; ++r) {
        const __m256i xs = int4 ? xv[r] : _mm256_sign_epi8(xv[r], w);
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xs), ones);
        acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx[r]), _mm256_cvtepi32_ps(dot), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * C + c] = mmfusion::hadd8(acc[r][c]) + offset[r][c];
}

template <int R, int C, typename Q>
inline void act8_f32_pass(const Act8RowsF32& x, int64_t r0, const Q* q, const uint16_t* s, const uint16_t* o,
                          int64_t c, float* acc) {
  c == C ? act8_f32_dot<R, C>(x, r0, q, s, o, acc) : act8_f32_dot<R, 1>(x, r0, q, s, o, acc);
}

// 1 to 4 float32 rows against every output row: C output rows a pass, the rest one by one
template <typename T, typename Q>
void act8_rows_f32(const float* x, int64_t m_count, int64_t k, int64_t n, const Q* qs, int64_t row_len,
                   const uint16_t* scales, const uint16_t* offsets, const float* bias, T* y) {
  const Act8RowsF32 xr(x, m_count, k);
  const int64_t blocks = k / kBlock, per = m_count <= 2 ? 4 : 2;
  at::parallel_for(0, (n + per - 1) / per, 16 / per, [&](int64_t begin, int64_t end) {
    float acc[kMaxRows * 4];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t row0 = g * per, c = n - row0 >= per ? per : 1;
      for (int64_t row = row0; row < std::min(row0 + per, n); row += c) {
        const Q* q = qs + row * row_len;
        const uint16_t* s = scales + row * blocks;
        const uint16_t* o = offsets != nullptr ? offsets + row * blocks : nullptr;
        switch (m_count) {
          case 4: act8_f32_pass<4, 2>(xr, 0, q, s, o, c, acc); break;
          case 3: act8_f32_pass<3, 2>(xr, 0, q, s, o, c, acc); break;
          case 2: act8_f32_pass<2, 4>(xr, 0, q, s, o, c, acc); break;
          default: act8_f32_pass<1, 4>(xr, 0, q, s, o, c, acc); break;
        }
        for (int64_t r = 0; r < m_count; ++r)
          for (int64_t i = 0; i < c; ++i) y[r * n + row + i] = static_cast<T>(acc[r * c + i] + (bias != nullptr ? bias[row + i] : 0.f));
      }
    }
  });
}
#endif

}  // namespace
