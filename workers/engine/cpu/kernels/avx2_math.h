// Vector helpers the AVX2 kernels share (included where AVX2 and FMA are available).
#pragma once
#include <immintrin.h>

#include "exp_math.h"

namespace mmfusion {

// e^x for x <= 0, 8 lanes (exp_math.h). Inputs below -87 give e^-87: callers mask the lanes
// that see nothing. The floor keeps 2^n a normal number, built from its exponent bits.
struct Avx2Ops {
  MMFUSION_FLOAT_OPS(__m256, _mm256)
  using Mask = __m256;  // a lane's bits all set where it is live
  static constexpr float kFloor = -87.f;
  static V broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V keep(Mask live, V v) { return _mm256_and_ps(v, live); }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V times_pow2(V p, V n) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  }
};

inline __m256 exp_neg8(__m256 x) { return exp_neg_with<Avx2Ops>(x); }

// the sums of eight vectors: lane t holds the sum of a[t]'s lanes
inline __m256 hsum8x8(const __m256 a[8]) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

inline float hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float hadd8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

}  // namespace mmfusion
