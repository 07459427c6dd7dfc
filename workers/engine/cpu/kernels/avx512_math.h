// Vector helpers the AVX512 kernels share (included where AVX512F is available).
#pragma once
#include <immintrin.h>

#include "exp_math.h"

namespace mmfusion {

// e^x for x <= 0, 16 lanes (exp_math.h). Inputs below -88, -inf and NaN give a tiny positive
// number: every caller masks the lanes that see nothing.
struct Avx512Ops {
  MMFUSION_FLOAT_OPS(__m512, _mm512)
  using Mask = __mmask16;
  static constexpr float kFloor = -88.f;
  static V broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static V keep(Mask live, V v) { return _mm512_maskz_mov_ps(live, v); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V times_pow2(V p, V n) { return _mm512_scalef_ps(p, n); }
};

inline __m512 exp_neg(__m512 x) { return exp_neg_with<Avx512Ops>(x); }

#ifdef __AVX512BF16__
// 16 bfloat16 values (their bits) to float32, exactly
inline __m512 bf16_to_f32(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 float32 values to bfloat16 bits, rounded to nearest even as torch rounds
inline __m256i f32_to_bf16(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }

// n <= 16 bfloat16 values at p (the others 0), and their store
inline __m512 load_bf16(const void* p, int n = 16) {
  const __m256i b = n >= 16 ? _mm256_loadu_si256(static_cast<const __m256i*>(p))
                            : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return bf16_to_f32(b);
}

inline void store_bf16(void* p, __m512 x, int n = 16) {
  if (n >= 16)
    _mm256_storeu_si256(static_cast<__m256i*>(p), f32_to_bf16(x));
  else
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), f32_to_bf16(x));
}
#endif

// r[0..15], 16 rows of 16 32-bit elements, transposed in place: r[c] becomes column c.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[4k + c], 128-bit lane L: column 4L + c of rows 4k..4k+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);  // columns c, 8+c of rows 0-7
    const __m512i b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);  // columns 4+c, 12+c of rows 0-7
    const __m512i e = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);  // the same of rows 8-15
    const __m512i f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(a, e, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xdd);
  }
}

}  // namespace mmfusion
