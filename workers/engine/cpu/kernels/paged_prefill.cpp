// Prefill attention over the paged KV cache: every prompt chunk of a step in one call, reading the
// keys and values straight from their blocks (no gather into a contiguous copy, no mask tensor),
// causal and windowed by position, with an online softmax in float32 (flash attention's).
//
// The query rows of one KV head (its query heads times the chunk's tokens) sit in the 16 lanes of
// a vector, so the scores of one key position are one vdpbf16ps per 32 elements of the head with
// the key broadcast from the cache, and the softmax over a tile of 16 positions needs no
// horizontal reductions. Values are widened to float32 once per tile and the probabilities stay
// float32 (the decode kernel's precision). bfloat16 with AVX512-BF16, and float32 with AVX2 and FMA
// (8 query rows a vector), heads of 64, 128 or 256; attention.py's PyTorch path serves everything
// else and is this kernel's reference.
#include "torch_lite.h"
#include <ATen/Parallel.h>

#include "head_dims.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "avx512_math.h"
#define MMFUSION_PREFILL_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include "avx2_math.h"
#define MMFUSION_PREFILL_F32 1
#endif

namespace {

#if defined(MMFUSION_PREFILL_BF16) || defined(MMFUSION_PREFILL_F32)
template <typename T>
struct Layout {
  const T *q, *kc, *vc;
  T* out;
  const int64_t *blocks, *segs;
  int64_t q_tok, q_head, o_tok, o_head;  // strides (elements) of a token and a head in q and out
  int64_t heads, kvh, bs, window;
  float scale;
};

// One work item's query rows, as every path lays them in the lanes of a vector: up to LANES rows
// (token-major, then the query heads of KV head kh) of segment s from row0; each lane's position and
// the first position it sees (a lane past the rows sees none), and the key positions [klo, khi) that
// any lane sees. `place(lane, query)` puts a lane's query row where the path wants it.
template <int LANES>
struct ItemRows {
  int64_t tok0, boff, first_pos, g, rows;
  int64_t klo = std::numeric_limits<int64_t>::max(), khi = 0;
  alignas(64) int32_t pos[LANES], lo[LANES];

  template <typename T, typename Place>
  ItemRows(const Layout<T>& L, int64_t s, int64_t kh, int64_t row0, Place place) {
    const int64_t* seg = L.segs + s * 5;
    const int64_t length = seg[1], start = seg[2];
    tok0 = seg[0], boff = seg[3], first_pos = seg[4];
    g = L.heads / L.kvh;
    rows = std::min<int64_t>(LANES, length * g - row0);
    for (int64_t k = 0; k < LANES; ++k) {
      if (k >= rows) {
        pos[k] = -1;
        lo[k] = std::numeric_limits<int32_t>::max();
        continue;
      }
      const int64_t r = row0 + k, i = r / g, j = r % g;
      place(k, L.q + (tok0 + i) * L.q_tok + (kh * g + j) * L.q_head);
      pos[k] = static_cast<int32_t>(start + i);
      lo[k] = static_cast<int32_t>(L.window > 0 ? std::max<int64_t>(0, start + i - L.window + 1) : 0);
      klo = std::min<int64_t>(klo, lo[k]);
      khi = std::max<int64_t>(khi, start + i + 1);
    }
  }

  // the element offset in the caches of key position p's keys (and values) of KV head kh
  template <typename T>
  int64_t offset(const Layout<T>& L, int64_t kh, int64_t p, int64_t d) const {
    const int64_t rel = p - first_pos, blk = L.blocks[boff + rel / L.bs];
    return (blk * L.kvh + kh) * L.bs * d + (rel % L.bs) * d;
  }

  // each row's output: its sums (acc[dim][lane], d of them) times its lane's 1/l
  template <typename T>
  void store(const Layout<T>& L, int64_t kh, int64_t row0, int64_t d, const float* acc, const float* inv) const {
    for (int64_t k = 0; k < rows; ++k) {
      const int64_t r = row0 + k, i = r / g, j = r % g;
      T* o = L.out + (tok0 + i) * L.o_tok + (kh * g + j) * L.o_head;
      for (int64_t dd = 0; dd < d; ++dd) o[dd] = static_cast<T>(acc[dd * LANES + k] * inv[k]);
    }
  }
};

// A tile's online softmax and the values it weighs, the same for every width (Ops: exp_math.h): the
// lanes' scores sc[t] of the tile's n positions (-inf where a lane does not see t; seen[t]: the
// lanes that do; mx: their maximum) update each lane's running max m and total l, and the sums
// acc[dim][lane] take position t's values (vrows[t], float32) weighed by the probabilities (pr).
template <typename Ops, int D>
inline void softmax_tile(const typename Ops::V* sc, const typename Ops::Mask* seen, int n, typename Ops::V mx,
                         const float* const* vrows, float* pr, float* acc, typename Ops::V& m, typename Ops::V& l) {
  using V = typename Ops::V;
  constexpr int W = Ops::kLanes;
  const V mnew = Ops::max(m, mx);
  const V corr = mmfusion::exp_neg_with<Ops>(Ops::sub(m, mnew));
  V sum = Ops::zero();
  for (int t = 0; t < n; ++t) {
    const V e = Ops::keep(seen[t], mmfusion::exp_neg_with<Ops>(Ops::sub(sc[t], mnew)));
    Ops::store(pr + t * W, e);
    sum = Ops::add(sum, e);
  }
  l = Ops::fmadd(l, corr, sum);
  m = mnew;
  for (int c = 0; c < D / W; ++c) {
    V a[W];
    for (int k = 0; k < W; ++k) a[k] = Ops::mul(Ops::load(acc + (W * c + k) * W), corr);
    for (int t = 0; t < n; ++t) {
      const V pt = Ops::load(pr + t * W);
      const float* vt = vrows[t] + W * c;
      for (int k = 0; k < W; ++k) a[k] = Ops::fmadd(pt, Ops::broadcast(vt + k), a[k]);
    }
    for (int k = 0; k < W; ++k) Ops::store(acc + (W * c + k) * W, a[k]);
  }
}

// every work item of the step's segments, (segment, KV head, first row) a LANES rows apart, over the
// threads: item(s, kh, row0)
template <int LANES, typename T, typename Item>
void prefill_items(const Layout<T>& L, int64_t num_segs, Item item) {
  const int64_t g = L.heads / L.kvh;
  std::vector<int64_t> items;  // (segment, kv head, first row) flattened in threes
  for (int64_t s = 0; s < num_segs; ++s) {
    const int64_t rows = L.segs[s * 5 + 1] * g;
    for (int64_t kh = 0; kh < L.kvh; ++kh)
      for (int64_t r = 0; r < rows; r += LANES) items.insert(items.end(), {s, kh, r});
  }
  const int64_t n = static_cast<int64_t>(items.size()) / 3;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) item(items[it * 3], items[it * 3 + 1], items[it * 3 + 2]);
  });
}
#endif

#ifdef MMFUSION_PREFILL_BF16
constexpr int LANES = 16;  // query rows per work item, and key positions per tile

// one work item: up to 16 query rows (token-major, then the query heads of KV head kh) of segment s
template <int D>
void prefill_item(const Layout<c10::BFloat16>& L, int64_t s, int64_t kh, int64_t row0) {
  constexpr int P = D / 2;  // bf16 pairs in a head
  alignas(64) uint32_t qt[P * LANES];  // qt[p][lane]: pair p of the lane's query
  std::fill(qt, qt + P * LANES, 0u);
  const ItemRows<LANES> R(L, s, kh, row0, [&](int64_t k, const c10::BFloat16* q) {
    const uint32_t* qr = reinterpret_cast<const uint32_t*>(q);
    for (int p = 0; p < P; ++p) qt[p * LANES + k] = qr[p];
  });
  const int64_t klo = R.klo, khi = R.khi;
  const __m512i vpos = _mm512_load_si512(R.pos), vlo = _mm512_load_si512(R.lo);
  const __m512 vscale = _mm512_set1_ps(L.scale), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

  alignas(64) float acc[D * LANES];  // acc[dim][lane]
  alignas(64) float vf[LANES * D];   // this tile's values in float32
  alignas(64) float pr[LANES * LANES];  // this tile's probabilities, [position][lane]
  std::fill(acc, acc + D * LANES, 0.f);
  __m512 m = ninf, l = _mm512_setzero_ps();

  for (int64_t t0 = klo; t0 < khi; t0 += LANES) {
    const int n = static_cast<int>(std::min<int64_t>(LANES, khi - t0));
    const uint32_t* kp[LANES];
    for (int t = 0; t < n; ++t) {
      const int64_t off = R.offset(L, kh, t0 + t, D);
      kp[t] = reinterpret_cast<const uint32_t*>(L.kc + off);
      const __m256i* vt = reinterpret_cast<const __m256i*>(L.vc + off);
      for (int c = 0; c < D / 16; ++c)
        _mm512_store_ps(vf + t * D + 16 * c, _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(vt + c)));
    }
    __m512 sc[LANES];
    for (int t = 0; t < n; ++t) sc[t] = _mm512_setzero_ps();
    for (int p = 0; p < P; ++p) {
      const __m512bh qp = (__m512bh)_mm512_load_si512(qt + p * LANES);
      for (int t = 0; t < n; ++t)
        sc[t] = _mm512_dpbf16_ps(sc[t], qp, (__m512bh)_mm512_set1_epi32(static_cast<int>(kp[t][p])));
    }
    __mmask16 seen[LANES];
    __m512 mx = ninf;
    for (int t = 0; t < n; ++t) {
      const __m512i kpos = _mm512_set1_epi32(static_cast<int32_t>(t0 + t));
      seen[t] = _mm512_cmple_epi32_mask(kpos, vpos) & _mm512_cmpge_epi32_mask(kpos, vlo);
      sc[t] = _mm512_mask_mul_ps(ninf, seen[t], sc[t], vscale);
      mx = _mm512_max_ps(mx, sc[t]);
    }
    const float* vrows[LANES];
    for (int t = 0; t < n; ++t) vrows[t] = vf + t * D;
    softmax_tile<mmfusion::Avx512Ops, D>(sc, seen, n, mx, vrows, pr, acc, m, l);
  }
  alignas(64) float inv[LANES];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_max_ps(l, _mm512_set1_ps(1e-30f))));
  R.store(L, kh, row0, D, acc, inv);
}
#endif

#ifdef MMFUSION_PREFILL_F32
constexpr int LANES8 = 8;  // float32: query rows per work item, and key positions per tile

// the float32 twin of prefill_item: 8 query rows in the lanes of an AVX2 vector; each key
// position's scores are D fused multiply-adds with the key's elements broadcast from the cache
template <int D>
void prefill_item_f32(const Layout<float>& L, int64_t s, int64_t kh, int64_t row0) {
  alignas(32) float qt[D * LANES8];  // qt[dim][lane]
  std::fill(qt, qt + D * LANES8, 0.f);
  const ItemRows<LANES8> R(L, s, kh, row0, [&](int64_t k, const float* qr) {
    for (int d = 0; d < D; ++d) qt[d * LANES8 + k] = qr[d];
  });
  const int64_t klo = R.klo, khi = R.khi;
  const __m256i vpos = _mm256_load_si256(reinterpret_cast<const __m256i*>(R.pos));
  const __m256i vlo = _mm256_load_si256(reinterpret_cast<const __m256i*>(R.lo));
  const __m256 vscale = _mm256_set1_ps(L.scale), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());

  alignas(32) float acc[D * LANES8];  // acc[dim][lane]
  alignas(32) float pr[LANES8 * LANES8];  // this tile's probabilities, [position][lane]
  std::fill(acc, acc + D * LANES8, 0.f);
  __m256 m = ninf, l = _mm256_setzero_ps();

  for (int64_t t0 = klo; t0 < khi; t0 += LANES8) {
    const int n = static_cast<int>(std::min<int64_t>(LANES8, khi - t0));
    const float *kp[LANES8], *vp[LANES8];
    for (int t = 0; t < n; ++t) {
      const int64_t off = R.offset(L, kh, t0 + t, D);
      kp[t] = L.kc + off;
      vp[t] = L.vc + off;
    }
    __m256 sc[LANES8];
    for (int t = 0; t < n; ++t) sc[t] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m256 qd = _mm256_load_ps(qt + d * LANES8);
      for (int t = 0; t < n; ++t) sc[t] = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kp[t] + d), sc[t]);
    }
    __m256 seen[LANES8];
    __m256 mx = ninf;
    for (int t = 0; t < n; ++t) {
      const __m256i kpos = _mm256_set1_epi32(static_cast<int32_t>(t0 + t));
      // kpos <= pos and kpos >= lo
      const __m256i out_of = _mm256_or_si256(_mm256_cmpgt_epi32(kpos, vpos), _mm256_cmpgt_epi32(vlo, kpos));
      seen[t] = _mm256_castsi256_ps(_mm256_xor_si256(out_of, _mm256_set1_epi32(-1)));
      sc[t] = _mm256_blendv_ps(ninf, _mm256_mul_ps(sc[t], vscale), seen[t]);
      mx = _mm256_max_ps(mx, sc[t]);
    }
    softmax_tile<mmfusion::Avx2Ops, D>(sc, seen, n, mx, vp, pr, acc, m, l);
  }
  alignas(32) float inv[LANES8];
  _mm256_store_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_max_ps(l, _mm256_set1_ps(1e-30f))));
  R.store(L, kh, row0, D, acc, inv);
}
#endif

}  // namespace

// out [N, H, d] (written at the segments' rows only) and q [N, H, d], any strides but a contiguous
// last dimension; key/value caches of one layer [num_blocks, kvh, block, d] (contiguous); blocks: the
// segments' block lists one after another; segs [S, 5]: (first token row, tokens, position of
// the first token, offset of its block list in blocks, position its first block starts at);
// window: positions a query sees back from its own (0: all). Returns false where this build or
// these shapes have no kernel (the caller's PyTorch path serves).
bool paged_prefill(torch::Tensor out, torch::Tensor q, torch::Tensor key, torch::Tensor value, torch::Tensor blocks,
                   torch::Tensor segs, int64_t window, double scale) {
  const int64_t d = q.size(2);
  const auto dt = q.scalar_type();
  if (key.scalar_type() != dt || value.scalar_type() != dt || out.scalar_type() != dt || value.size(3) != d ||
      key.size(3) != d || q.stride(2) != 1 || out.stride(2) != 1 || !key.is_contiguous() || !value.is_contiguous())
    return false;
  TORCH_CHECK(blocks.scalar_type() == torch::kLong && segs.scalar_type() == torch::kLong && blocks.is_contiguous() &&
              segs.is_contiguous(), "paged_prefill: blocks and segs must be contiguous int64");
  TORCH_CHECK(q.size(1) % key.size(1) == 0, "paged_prefill: heads must be a multiple of KV heads");
#ifdef MMFUSION_PREFILL_BF16
  if (dt == at::kBFloat16) {
    Layout<c10::BFloat16> L{q.data_ptr<c10::BFloat16>(), key.data_ptr<c10::BFloat16>(), value.data_ptr<c10::BFloat16>(),
             out.data_ptr<c10::BFloat16>(), blocks.data_ptr<int64_t>(), segs.data_ptr<int64_t>(),
             q.stride(0), q.stride(1), out.stride(0), out.stride(1), q.size(1), key.size(1), key.size(2), window,
             static_cast<float>(scale)};
    return mmfusion::with_head_dim(d, [&](auto tag) {
      prefill_items<LANES>(L, segs.size(0), [&](int64_t s, int64_t kh, int64_t row0) {
        prefill_item<decltype(tag)::value>(L, s, kh, row0);
      });
    });
  }
#endif
#ifdef MMFUSION_PREFILL_F32
  if (dt == at::kFloat) {
    Layout<float> L{q.data_ptr<float>(), key.data_ptr<float>(), value.data_ptr<float>(), out.data_ptr<float>(),
                blocks.data_ptr<int64_t>(), segs.data_ptr<int64_t>(), q.stride(0), q.stride(1), out.stride(0),
                out.stride(1), q.size(1), key.size(1), key.size(2), window, static_cast<float>(scale)};
    return mmfusion::with_head_dim(d, [&](auto tag) {
      prefill_items<LANES8>(L, segs.size(0), [&](int64_t s, int64_t kh, int64_t row0) {
        prefill_item_f32<decltype(tag)::value>(L, s, kh, row0);
      });
    });
  }
#endif
  return false;
}
