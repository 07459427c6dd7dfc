// Weight-only quantized linears with bfloat16 activations on AVX512-BF16 (qlinear_common.h):
// blocks rounded to bfloat16 and multiplied in pairs into float32 (vdpbf16ps), int4 at up to four
// rows from its nibbles, and the strips of 16 output rows for batches.
#pragma once
#include "qlinear_f32.h"

namespace {

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

}  // namespace
