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
//   float32 products; one row against int4 blocks (and against int8 blocks on AVX2) in fixed point
//   instead (fixed_decode.h: int16 halves of the activations, exact int32 products, float32's
//   precision);
// - elsewhere, plain loops the compiler vectorizes.
// Up to four input rows (a decode step of a few streams) read each weight byte once, in registers;
// 5 to 23 rows widen four output rows at a time into a buffer that stays in L1 and multiply tiles of
// input rows by them in registers; from 24 rows (a batch, a prompt's chunk) strips of output rows are
// widened once into the layout of an outer-product GEMM (bf16_outer, outer_f32), or, where the output
// rows are no whole vectors, from 96 rows ATen's GEMM multiplies the widened weights (panels).
// With `strips` (the `deterministic` key) every row count takes the strips where the output rows
// are whole vectors: a row's sums then run in one order whatever rows come with it, one row alone
// included, at the price of widening the weights for a decode step of a few rows.
//
// This file: the layout's constants and the helpers every path shares (a row widened to float32,
// ATen's GEMM over widened panels). The paths follow in qlinear_f32.h and qlinear_bf16.h, the
// dispatch and the entry points in qlinear.cpp (kernels.cpp includes them in that order).
#pragma once
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

// one output row's weights as float32, into w[0, k). With AVX2, FMA and F16C in eight-lane vectors:
// the compiler's vectorization of the plain loop below took about three times as long, which a step
// of 5 to 23 rows pays once per output row (tiled_rows_f32). The values are the same: scale * q is
// exact in float32, so the FMA rounds once as the multiply and add did.
inline void widen_int4(const uint8_t* qs, const uint16_t* scales, const uint16_t* offsets, int64_t k, float* w) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const __m256i mask = _mm256_set1_epi32(0x0F);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(scales[b])), m = _mm256_set1_ps(_cvtsh_ss(offsets[b]));
    const uint8_t* q = qs + b * (kBlock / 2);
    float* o = w + b * kBlock;
    // bytes 0-7 hold values 0-7 in their low nibbles and 16-23 in their high ones; bytes 8-15 the rest
    const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
    _mm256_storeu_ps(o, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(lo, mask)), m));
    _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask)), m));
    _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), m));
    _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), m));
  }
#else
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
#endif
}

inline void widen_int8(const int8_t* qs, const uint16_t* scales, int64_t k, float* w) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(scales[b]));
    const int8_t* q = qs + b * kBlock;
    for (int j = 0; j < kBlock; j += 8) {
      const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j)));
      _mm256_storeu_ps(w + b * kBlock + j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(v)));
    }
  }
#else
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float d = half_to_float(scales[b]);
    const int8_t* q = qs + b * kBlock;
    float* o = w + b * kBlock;
#pragma omp simd
    for (int j = 0; j < kBlock; ++j) o[j] = d * static_cast<float>(q[j]);
  }
#endif
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

}  // namespace
