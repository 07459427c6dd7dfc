// Float vector math written once for every width. `Ops` is a vector type's operations, declared in
// avx2_math.h (8 lanes) and avx512_math.h (16 lanes) with MMFUSION_FLOAT_OPS below plus what each
// width does its own way (rounding, 2^n, a mask of lanes).
#pragma once

// the operations every width spells the same way but for its intrinsics' prefix (_mm256, _mm512)
#define MMFUSION_FLOAT_OPS(VEC, PREFIX)                                                      \
  using V = VEC;                                                                             \
  static constexpr int kLanes = sizeof(VEC) / sizeof(float);                                 \
  static V set1(float v) { return PREFIX##_set1_ps(v); }                                     \
  static V zero() { return PREFIX##_setzero_ps(); }                                          \
  static V load(const float* p) { return PREFIX##_load_ps(p); }                              \
  static void store(float* p, V v) { PREFIX##_store_ps(p, v); }                              \
  static V max(V a, V b) { return PREFIX##_max_ps(a, b); }                                   \
  static V mul(V a, V b) { return PREFIX##_mul_ps(a, b); }                                   \
  static V add(V a, V b) { return PREFIX##_add_ps(a, b); }                                   \
  static V sub(V a, V b) { return PREFIX##_sub_ps(a, b); }                                   \
  static V fmadd(V a, V b, V c) { return PREFIX##_fmadd_ps(a, b, c); }                       \
  static V fnmadd(V a, V b, V c) { return PREFIX##_fnmadd_ps(a, b, c); }

namespace mmfusion {

// e^x for x <= 0 (Cephes' expf: 2^n e^r with |r| <= ln2/2, relative error ~2e-7). Each width keeps
// its own floor (Ops::kFloor) and its own way to multiply by 2^n.
template <typename Ops>
inline typename Ops::V exp_neg_with(typename Ops::V x) {
  using V = typename Ops::V;
  x = Ops::max(x, Ops::set1(Ops::kFloor));
  const V n = Ops::round(Ops::mul(x, Ops::set1(1.44269504088896341f)));
  V r = Ops::fnmadd(n, Ops::set1(0.693359375f), x);
  r = Ops::fnmadd(n, Ops::set1(-2.12194440e-4f), r);
  V p = Ops::set1(1.9875691500e-4f);
  p = Ops::fmadd(p, r, Ops::set1(1.3981999507e-3f));
  p = Ops::fmadd(p, r, Ops::set1(8.3334519073e-3f));
  p = Ops::fmadd(p, r, Ops::set1(4.1665795894e-2f));
  p = Ops::fmadd(p, r, Ops::set1(1.6666665459e-1f));
  p = Ops::fmadd(p, r, Ops::set1(5.0000001201e-1f));
  p = Ops::fmadd(p, Ops::mul(r, r), Ops::add(r, Ops::set1(1.f)));
  return Ops::times_pow2(p, n);
}

}  // namespace mmfusion
