// The rotary embedding of q and k and the write of k and v into the paged cache, in one pass per
// token for the lean forward: in PyTorch these were five operations on q and k and two indexed
// writes per layer, most of a decode step's non-matmul operations. It rounds where the PyTorch
// version does (each product, then their sum, to the tensor's dtype), so results are bit-equal.
#include "torch_lite.h"

#include "head_dims.h"
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "avx512_math.h"
#define MMFUSION_ROPE_BF16 1
#endif

namespace {

// one token: its q and k heads rotated in place, then its k and v copied into the cache. No
// contraction of a product and a sum into one fused multiply-add: torch rounds between them.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_token(T* row, const T* c, const T* s, T* kd, T* vd,
                                                                 int64_t heads, int64_t kvh, int64_t d, int64_t bs,
                                                                 at::opmath_type<T>* x) {
  using F = at::opmath_type<T>;
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads + kvh; ++h) {
    T* y = row + h * d;
    for (int64_t i = 0; i < d; ++i) x[i] = static_cast<F>(y[i]);
    for (int64_t i = 0; i < d; ++i) {
      const F rolled = x[i < half ? i + half : i - half];  // s holds the sine with its first half negated
      const T a = static_cast<T>(x[i] * static_cast<F>(c[i]));
      const T b = static_cast<T>(rolled * static_cast<F>(s[i]));
      y[i] = static_cast<T>(static_cast<F>(a) + static_cast<F>(b));
    }
  }
  if (kd == nullptr) return;  // a padding row: nothing to cache
  for (int64_t h = 0; h < kvh; ++h) {
    const T* k = row + (heads + h) * d;
    const T* v = row + (heads + kvh + h) * d;
    for (int64_t i = 0; i < d; ++i) {
      kd[h * bs * d + i] = k[i];
      vd[h * bs * d + i] = v[i];
    }
  }
}

#ifdef MMFUSION_ROPE_BF16
// bfloat16 heads of d = 32 k elements, 16 lanes at a time, with the generic path's roundings: each
// product to bfloat16, then their sum (a conversion between them, so no fused multiply-add)
template <int V>  // V = d / 16 vectors per head
void rope_token_bf16(c10::BFloat16* row, const c10::BFloat16* c, const c10::BFloat16* s, c10::BFloat16* kd,
                     c10::BFloat16* vd, int64_t heads, int64_t kvh, int64_t bs) {
  using mmfusion::bf16_to_f32;
  using mmfusion::f32_to_bf16;
  constexpr int D = V * 16;
  __m512 cv[V], sv[V];
  for (int i = 0; i < V; ++i) {
    cv[i] = mmfusion::load_bf16(c + 16 * i);
    sv[i] = mmfusion::load_bf16(s + 16 * i);
  }
  for (int64_t h = 0; h < heads + kvh; ++h) {
    c10::BFloat16* y = row + h * D;
    __m512 x[V];
    for (int i = 0; i < V; ++i) x[i] = mmfusion::load_bf16(y + 16 * i);
    for (int i = 0; i < V; ++i) {
      const __m512 a = bf16_to_f32(f32_to_bf16(_mm512_mul_ps(x[i], cv[i])));
      const __m512 b = bf16_to_f32(f32_to_bf16(_mm512_mul_ps(x[(i + V / 2) % V], sv[i])));
      mmfusion::store_bf16(y + 16 * i, _mm512_add_ps(a, b));
    }
  }
  if (kd == nullptr) return;
  for (int64_t h = 0; h < kvh; ++h) {
    std::memcpy(kd + h * bs * D, row + (heads + h) * D, D * sizeof(c10::BFloat16));
    std::memcpy(vd + h * bs * D, row + (heads + kvh + h) * D, D * sizeof(c10::BFloat16));
  }
}

bool rope_rows_bf16(c10::BFloat16* qkv, const c10::BFloat16* cos, const c10::BFloat16* sin, c10::BFloat16* kc,
                    c10::BFloat16* vc, const int64_t* blocks, const int64_t* offsets, int64_t n, int64_t writes,
                    int64_t heads, int64_t kvh, int64_t d, int64_t bs) {
  return mmfusion::with_head_dim(d, [&](auto tag) {
    constexpr int V = decltype(tag)::value / 16;
    const int64_t width = (heads + 2 * kvh) * d;
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t base = t < writes ? (blocks[t] * kvh * bs + offsets[t]) * d : 0;
        rope_token_bf16<V>(qkv + t * width, cos + t * d, sin + t * d, t < writes ? kc + base : nullptr,
                           t < writes ? vc + base : nullptr, heads, kvh, bs);
      }
    });
  });
}
#endif

template <typename T>
void rope_rows(T* qkv, const T* cos, const T* sin, T* kc, T* vc, const int64_t* blocks, const int64_t* offsets,
               int64_t n, int64_t writes, int64_t heads, int64_t kvh, int64_t d, int64_t bs) {
  const int64_t width = (heads + 2 * kvh) * d;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<at::opmath_type<T>> x(d);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t base = t < writes ? (blocks[t] * kvh * bs + offsets[t]) * d : 0;
      rope_token<T>(qkv + t * width, cos + t * d, sin + t * d, t < writes ? kc + base : nullptr,
                    t < writes ? vc + base : nullptr, heads, kvh, d, bs, x.data());
    }
  });
}

}  // namespace

// qkv [N, (heads + 2 kvh) d] (contiguous): q and k are rotated in place; cos, sin [N, d] in its
// dtype (sin with its first half negated); key/value caches of one layer [num_blocks, kvh, block, d];
// blocks/offsets [W] (W <= N): where token t's k and v go.
void rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor key, torch::Tensor value,
                torch::Tensor blocks, torch::Tensor offsets, int64_t heads, int64_t kvh) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
              key.is_contiguous() && value.is_contiguous(), "rope_write: tensors must be contiguous");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
              key.scalar_type() == qkv.scalar_type() && value.scalar_type() == qkv.scalar_type(),
              "rope_write: one dtype for all");
  const int64_t d = key.size(3);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kvh) * d && d % 2 == 0 && cos.size(1) == d, "rope_write: bad shapes");
  blocks = blocks.to(torch::kLong).contiguous();
  offsets = offsets.to(torch::kLong).contiguous();
#ifdef MMFUSION_ROPE_BF16
  if (qkv.scalar_type() == at::kBFloat16 &&
      rope_rows_bf16(qkv.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(),
                     key.data_ptr<c10::BFloat16>(), value.data_ptr<c10::BFloat16>(), blocks.data_ptr<int64_t>(),
                     offsets.data_ptr<int64_t>(), qkv.size(0), blocks.size(0), heads, kvh, d, key.size(2)))
    return;
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_write", [&] {
    rope_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                        key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), blocks.data_ptr<int64_t>(),
                        offsets.data_ptr<int64_t>(), qkv.size(0), blocks.size(0), heads, kvh, d, key.size(2));
  });
}
