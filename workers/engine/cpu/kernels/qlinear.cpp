// Weight-only quantized linears: the paths by row count and the entry points (qlinear_int4,
// qlinear_int8, dense_strips). The layout and the paths: qlinear_common.h, qlinear_f32.h and
// qlinear_bf16.h.
#include "qlinear_act8.h"

#include <string>

namespace {

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
// one row (a stream's decode step) against every output row of int4 or int8 blocks, in fixed point
// (fixed_decode.h); dot(f, row, du) is one output row's sum. Only there: at two rows and more each
// row costs more in fixed point than the shared float32 widening.
template <typename T, typename Dot>
void fixed_row(const float* x, int64_t k, int64_t n, const float* bias, T* y, Dot dot) {
  const mmfusion::FixedRow f(x, k);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> du(k / kBlock);
    for (int64_t row = begin; row < end; ++row) {
      y[row] = static_cast<T>(dot(f, row, du.data()) + (bias != nullptr ? bias[row] : 0.f));
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
                     const uint16_t* s, const uint16_t* o, bool strips, int64_t act8) {
  const at::Tensor xc = x.contiguous();
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == n, "qlinear: bias must have ", n, " values");
#ifdef MMFUSION_QLINEAR_ACT8
  if (!strips && xc.size(0) <= std::min<int64_t>(act8, kMaxRows)) {
    const at::Tensor bf = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
    at::Tensor y = at::empty({xc.size(0), n}, xc.options());
    act8_rows(xc.data_ptr<c10::BFloat16>(), xc.size(0), xc.size(1), n, q, row_len, s, o,
              bf.defined() ? bf.data_ptr<float>() : nullptr, y.data_ptr<c10::BFloat16>());
    return y;
  }
#endif
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
                        c10::optional<at::Tensor> bias, bool strips, int64_t act8) {
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
  if (x.scalar_type() == at::kBFloat16) return bf16_call(x, n, bias, q, k / 2, s, o, strips, act8);
#endif
  if (strips) act8 = 0;  // `deterministic` asked for one order at every row count
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
    if (m <= std::min<int64_t>(act8, kMaxRows) && x.scalar_type() == at::kFloat) {
      act8_rows_f32<T>(xf, m, kk, n, q, kk / 2, s, o, b, y);
    } else if (strips) {
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
      const int64_t blocks = kk / kBlock;
      fixed_row<T>(xf, kk, n, b, y, [=](const mmfusion::FixedRow& f, int64_t row, float* du) {
        return mmfusion::int4_fixed(f, q + row * (kk / 2), s + row * blocks, o + row * blocks, du);
      });
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

std::vector<std::string> act8_dtypes() {
  std::vector<std::string> out;
#ifdef MMFUSION_QLINEAR_ACT8
  out.push_back("bfloat16");
#endif
#ifdef MMFUSION_QLINEAR_ACT8_F32
  out.push_back("float32");
#endif
  return out;
}

bool dense_strips_built() {
#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
  return true;
#else
  return false;
#endif
}

// x [M, K]; qs int8 [N, K]; scales float16 [N, K / 32]; returns [M, N] in x's dtype
// offsets: none for int8 blocks (every format's kernel takes the same arguments: workers.quant.formats)
at::Tensor qlinear_int8(at::Tensor x, at::Tensor qs, at::Tensor scales, c10::optional<at::Tensor> offsets,
                        c10::optional<at::Tensor> bias, bool strips, int64_t act8) {
  const int64_t n = qs.size(0), k = qs.size(1);
  check(x, scales, n, k, "qlinear_int8");
  TORCH_CHECK(!offsets.has_value() || !offsets->defined(), "qlinear_int8: int8 blocks take no offsets");
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous(), "qlinear_int8: qs must be contiguous int8");
  if (x.size(0) == 0) return at::empty({0, n}, x.options());
  const int8_t* q = qs.data_ptr<int8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
#ifdef MMFUSION_QLINEAR_BF16
  if (x.scalar_type() == at::kBFloat16) return bf16_call(x, n, bias, q, k, s, nullptr, strips, act8);
#endif
  if (strips) act8 = 0;  // `deterministic` asked for one order at every row count
  strips = strips && n % 16 == 0;
  if (x.size(0) >= kPanelRows && !outer_fits_f32(x.size(0), n) && !strips) {
    const int64_t blocks = k / kBlock;
    return float_panels(x, n, bias, [=](int64_t row, float* w) { widen_int8(q + row * k, s + row * blocks, k, w); });
  }
  return run(x, n, bias, [&](auto* y, const float* xf, int64_t m, int64_t kk, const float* b) {
    using T = std::remove_pointer_t<decltype(y)>;
#if defined(MMFUSION_QLINEAR_AVX512) || defined(MMFUSION_QLINEAR_AVX2)
    if (m <= std::min<int64_t>(act8, kMaxRows) && x.scalar_type() == at::kFloat) {
      act8_rows_f32<T>(xf, m, kk, n, q, kk, s, nullptr, b, y);
    } else if (strips) {
      outer_f32<T>(xf, m, kk, n, b, y, q, kk, s, nullptr);
    } else if (m > kMaxRows) {
      const int64_t blocks = kk / kBlock;
      const auto widen = [=](int64_t row, float* w) { widen_int8(q + row * kk, s + row * blocks, kk, w); };
      if (outer_fits_f32(m, n)) {
        outer_f32<T>(xf, m, kk, n, b, y, q, kk, s, nullptr);
      } else {
        tiled_rows_f32<T>(xf, m, kk, n, b, y, widen);
      }
#ifdef MMFUSION_QLINEAR_AVX2
    } else if (m == 1) {  // 8 lanes: fixed point's 13 operations a block against the widening's 16
      const int64_t blocks = kk / kBlock;
      fixed_row<T>(xf, kk, n, b, y, [=](const mmfusion::FixedRow& f, int64_t row, float* du) {
        return mmfusion::int8_fixed(f, q + row * kk, s + row * blocks, du);
      });
#endif
    } else {
      simd_rows_with<T, int8_t>(MMFUSION_DOTS(int8_dot), xf, m, kk, n, q, kk, s, nullptr, b, y);
    }
#else
    const int64_t blocks = kk / kBlock;
    qlinear_rows<T>(xf, m, kk, n, b, y, [=](int64_t row, float* w) { widen_int8(q + row * kk, s + row * blocks, kk, w); });
#endif
  });
}

// x [M, K] (float32 or bfloat16) against int4 (qs uint8 [N, K / 2], offsets) or int8 (qs int8
// [N, K], no offsets) blocks through ATen's GEMM on the weights widened to x's dtype in panels (the
// values the other paths take): oneDNN's GEMM, AMX tiles where the CPU has them. The blocks' own
// paths above win at few rows, this one may at many; which, and from how many rows, is measured on
// the machine (workers.engine.cpu.row_kernels). Returns [M, N] in x's dtype.
at::Tensor qlinear_widened(at::Tensor x, at::Tensor qs, at::Tensor scales, c10::optional<at::Tensor> offsets,
                           c10::optional<at::Tensor> bias) {
  const bool int4 = qs.scalar_type() == at::kByte;
  TORCH_CHECK(int4 || qs.scalar_type() == at::kChar, "qlinear_widened: qs must be uint8 (int4) or int8 blocks");
  TORCH_CHECK(qs.is_contiguous(), "qlinear_widened: qs must be contiguous");
  const int64_t n = qs.size(0), k = int4 ? qs.size(1) * 2 : qs.size(1), blocks = k / kBlock;
  check(x, scales, n, k, "qlinear_widened");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "qlinear_widened: x must be float32 or bfloat16, got ", x.scalar_type());
  const bool has_offsets = offsets.has_value() && offsets->defined();
  TORCH_CHECK(has_offsets == int4, "qlinear_widened: int4 blocks take offsets, int8 blocks none");
  if (int4) {
    TORCH_CHECK(offsets->scalar_type() == at::kHalf && offsets->is_contiguous() && offsets->numel() == scales.numel(),
                "qlinear_widened: offsets must be float16 like scales");
  }
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == n, "qlinear_widened: bias must have ", n, " values");
  if (x.size(0) == 0) return at::empty({0, n}, x.options());
  const at::Tensor xc = x.contiguous();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* o = int4 ? reinterpret_cast<const uint16_t*>(offsets->data_ptr<at::Half>()) : nullptr;
  const void* q = qs.data_ptr();
  const at::Tensor b = has_bias ? bias->to(xc.scalar_type()).contiguous() : at::Tensor();
  const auto widen_f32 = [=](int64_t row, float* w) {
    if (int4) {
      widen_int4(static_cast<const uint8_t*>(q) + row * (k / 2), s + row * blocks, o + row * blocks, k, w);
    } else {
      widen_int8(static_cast<const int8_t*>(q) + row * k, s + row * blocks, k, w);
    }
  };
  if (xc.scalar_type() == at::kFloat) return panels<float>(xc, n, b, widen_f32);
  return panels<c10::BFloat16>(xc, n, b, [=](int64_t row, c10::BFloat16* w) {
#ifdef MMFUSION_QLINEAR_BF16
    if (int4) {
      widen_row_bf16(static_cast<const uint8_t*>(q) + row * (k / 2), s + row * blocks, o + row * blocks, k, w);
    } else {
      widen_row_bf16(static_cast<const int8_t*>(q) + row * k, s + row * blocks, nullptr, k, w);
    }
#else
    // the same values rounded to bfloat16 as the AVX512-BF16 widening rounds them (to nearest even)
    thread_local std::vector<float> f;
    f.resize(k);
    widen_f32(row, f.data());
    for (int64_t i = 0; i < k; ++i) w[i] = static_cast<c10::BFloat16>(f[i]);
#endif
  });
}
