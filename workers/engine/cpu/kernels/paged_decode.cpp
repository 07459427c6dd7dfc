// Decode attention over the paged KV cache, per (decode row, KV head) a pass over each half of the
// positions the row sees, merged: the query heads that share a KV head read each key and value
// once, with an online softmax in float32 (as flash-decoding does). Built at first use by
// workers/engine/cpu/extension.py; the PyTorch version in attention.py is its reference.
#include "torch_lite.h"
#include <ATen/Parallel.h>

#include "head_dims.h"

#include <algorithm>
#include <cmath>
#include <math.h>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "avx512_math.h"
#define MMFUSION_BF16_DOT 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include "avx2_math.h"
#define MMFUSION_F32_AVX2 1
#endif

namespace {

// n values to float32; bfloat16 as its bits shifted into a float's high half, which vectorizes
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <typename T>
void decode(const T* q, const T* kc, const T* vc, const int64_t* blocks, const int64_t* spans, T* out,
            int64_t rows, int64_t heads, int64_t kvh, int64_t bs, int64_t d, int64_t dv, float scale) {
  const int64_t g = heads / kvh;
  at::parallel_for(0, rows * kvh, 1, [&](int64_t begin, int64_t end) {
    // per block: its keys and values in float32, the g heads' scores, then one rescale
    std::vector<float> qf(g * d), acc(g * dv), m(g), l(g), kf(bs * d), vf(bs * dv), s(g * bs);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kvh, kh = item % kvh;
      const int64_t first = spans[r * 4], lo = spans[r * 4 + 2], hi = spans[r * 4 + 3];
      for (int64_t j = 0; j < g; ++j) {
        const T* qh = q + (r * heads + kh * g + j) * d;
        for (int64_t i = 0; i < d; ++i) qf[j * d + i] = static_cast<float>(qh[i]) * scale;
        m[j] = -std::numeric_limits<float>::infinity();
        l[j] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = lo / bs; b * bs < hi; ++b) {
        const int64_t blk = blocks[first + b];
        const int64_t t0 = std::max(lo - b * bs, int64_t(0)), t1 = std::min(hi - b * bs, bs), n = t1 - t0;
        const T* k = kc + ((blk * kvh + kh) * bs + t0) * d;
        const T* v = vc + ((blk * kvh + kh) * bs + t0) * dv;
        to_float(k, kf.data(), n * d);
        to_float(v, vf.data(), n * dv);
        for (int64_t j = 0; j < g; ++j) {
          const float* qj = qf.data() + j * d;
          float* sj = s.data() + j * bs;
          float mb = m[j];
          for (int64_t t = 0; t < n; ++t) {
            const float* kt = kf.data() + t * d;
            float dot = 0.f;
            for (int64_t i = 0; i < d; ++i) dot += qj[i] * kt[i];
            sj[t] = dot;
            mb = std::max(mb, dot);
          }
          const float c = std::exp(m[j] - mb);  // 0 on the first block (m = -inf)
          float* a = acc.data() + j * dv;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            sj[t] = expf(sj[t] - mb);
            sum += sj[t];
          }
          for (int64_t i = 0; i < dv; ++i) a[i] *= c;
          for (int64_t t = 0; t < n; ++t) {
            const float p = sj[t];
            const float* vt = vf.data() + t * dv;
            for (int64_t i = 0; i < dv; ++i) a[i] += p * vt[i];
          }
          l[j] = l[j] * c + sum;
          m[j] = mb;
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        T* o = out + (r * heads + kh * g + j) * dv;
        const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
        for (int64_t i = 0; i < dv; ++i) o[i] = static_cast<T>(acc[j * dv + i] * inv);
      }
    }
  });
}

#if defined(MMFUSION_BF16_DOT) || defined(MMFUSION_F32_AVX2)
// A work item is a row's KV heads [kh0, kh0 + span): all of them when the step has rows enough to
// keep every thread busy, so each block's keys (and values) are read as one contiguous run, which
// the hardware prefetcher follows; one each when it has few rows, so a long single stream's
// attention still spreads over the threads.
inline int64_t heads_per_item(int64_t rows, int64_t kvh) {
  return rows >= 2 * static_cast<int64_t>(at::get_num_threads()) ? kvh : 1;
}

// The blocks are anywhere in the pool, so the hardware prefetcher cannot follow them from one to
// the next: the vector paths ask for the keys and values `ahead` blocks past block b of work item
// `item` while they compute it. That is the row's own block, or past its last one the next item's
// first ones. Returns the element offset in the caches of the item's heads in that block, or -1
// when there is none.
inline int64_t prefetch_offset(const int64_t* blocks, const int64_t* spans, int64_t item, int64_t end, int64_t b,
                               int64_t ahead, int64_t kvh, int64_t span, int64_t bs, int64_t d) {
  const int64_t per_row = kvh / span;
  const int64_t r = item / per_row, kh = item % per_row * span;
  const int64_t first = spans[r * 4], hi = spans[r * 4 + 3];
  if ((b + ahead) * bs < hi) return (blocks[first + b + ahead] * kvh + kh) * bs * d;
  if (item + 1 >= end) return -1;
  const int64_t r2 = (item + 1) / per_row, kh2 = (item + 1) % per_row * span;
  const int64_t b2 = spans[r2 * 4 + 2] / bs + (b + ahead) - (hi - 1) / bs - 1;
  return b2 * bs < spans[r2 * 4 + 3] ? (blocks[spans[r2 * 4] + b2] * kvh + kh2) * bs * d : -1;
}

// How far ahead the vector paths ask for blocks, and into L2 (T1): a request into L1 for a
// block's every line at once filled the core's miss buffers and stalled it; asked a KV head's
// part at a time, two blocks ahead, a step's attention ran 1.5x as fast from memory.
constexpr int64_t PREFETCH = 2;

// one block's keys and values (`bytes` each) into the cache, a line at a time
inline void prefetch_block(const void* k, const void* v, int64_t bytes) {
  for (int64_t x = 0; x < bytes; x += 64) {
    _mm_prefetch(static_cast<const char*>(k) + x, _MM_HINT_T1);
    _mm_prefetch(static_cast<const char*>(v) + x, _MM_HINT_T1);
  }
}

// Each (row, KV heads) cell's positions are walked as two items, the blocks of its first half and
// of its second, merged at the end as flash-decoding merges its splits. A single stream has as many
// cells as KV heads, and SmolLM2's 3 shared out over 2 threads left one idle a third of the time;
// its 6 halves keep both busy. A row's halves depend only on its own positions, so a row's result
// is the same whatever rows share its step (`deterministic`), and a row of one block has an empty
// second half, which merges to the one-pass result bit for bit.
constexpr int64_t kHalves = 2;

// The walk every vector path takes, whatever its dtype: work items of (row, KV heads, half) shared
// out over the threads, each half's blocks in order with the ones ahead prefetched, tiles of at
// most Path::TILE positions; then each head's two halves merged and divided by their softmax total.
// A Path holds one thread's scratch and does a tile's work: the scores of a KV head's group of
// query heads, their online softmax (m, l) and the values weighed by it (acc), for heads
// [j0, j0 + g).
template <typename Path>
void decode_walk(const typename Path::T* q, const typename Path::T* kc, const typename Path::T* vc,
                 const int64_t* blocks, const int64_t* spans, typename Path::T* out, int64_t rows, int64_t heads,
                 int64_t kvh, int64_t bs, float scale) {
  using T = typename Path::T;
  constexpr int D = Path::D;
  const int64_t g = heads / kvh;
  const int64_t span = heads_per_item(rows, kvh), per_row = kvh / span, hg = span * g;
  const int64_t cells = rows * per_row, items = cells * kHalves;
  // each item's sums (hg heads of D), maxima and totals, merged once every item is done; the
  // calling thread keeps the buffer (a large batch's is megabytes, whose fresh pages would fault
  // at every layer), and every item writes its part before the merge reads it
  thread_local std::vector<float> scratch;
  const auto need = static_cast<size_t>(items * hg * (D + 2));
  if (scratch.size() < need) scratch.resize(need);
  float* const accs = scratch.data();
  float* const ms = accs + items * hg * D;
  float* const ls = ms + items * hg;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Path path(g, hg, scale);
    const int64_t cell_end = (end + kHalves - 1) / kHalves;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t cell = item / kHalves, half = item % kHalves;
      const int64_t r = cell / per_row, kh0 = cell % per_row * span;
      const int64_t first = spans[r * 4], lo = spans[r * 4 + 2], hi = spans[r * 4 + 3];
      const int64_t b_lo = lo / bs, b_hi = (hi + bs - 1) / bs, mid = b_lo + (b_hi - b_lo) / 2;
      const int64_t from = half == 0 ? b_lo : mid, to = half == 0 ? mid : b_hi;
      float* acc = accs + item * hg * D;
      float* m = ms + item * hg;
      float* l = ls + item * hg;
      for (int64_t j = 0; j < hg; ++j) {
        path.query(j, q + (r * heads + kh0 * g + j) * D);
        m[j] = -std::numeric_limits<float>::infinity();
        l[j] = 0.f;
      }
      std::fill(acc, acc + hg * D, 0.f);
      for (int64_t b = from; b < to; ++b) {
        const int64_t blk = blocks[first + b];
        const int64_t b0 = std::max(lo - b * bs, int64_t(0)), b1 = std::min(hi - b * bs, bs);
        const int64_t ahead = prefetch_offset(blocks, spans, cell, cell_end, b, PREFETCH, kvh, span, bs, D);
        for (int64_t kh = 0; kh < span; ++kh) {
          if (ahead >= 0) prefetch_block(kc + ahead + kh * bs * D, vc + ahead + kh * bs * D, bs * D * sizeof(T));
          const T* kb = kc + (blk * kvh + kh0 + kh) * bs * D;
          const T* vb = vc + (blk * kvh + kh0 + kh) * bs * D;
          for (int64_t t0 = b0; t0 < b1; t0 += Path::TILE) {
            const int n = static_cast<int>(std::min<int64_t>(Path::TILE, b1 - t0));
            path.tile(kb + t0 * D, vb + t0 * D, n, kh * g, m, l, acc);
          }
        }
      }
      path.finish(m, l, acc);
    }
  });
  at::parallel_for(0, cells, 16, [&](int64_t begin, int64_t end) {
    for (int64_t cell = begin; cell < end; ++cell) {
      const int64_t r = cell / per_row, kh0 = cell % per_row * span;
      for (int64_t j = 0; j < hg; ++j) {
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t h = 0; h < kHalves; ++h) top = std::max(top, ms[(cell * kHalves + h) * hg + j]);
        float w[kHalves], total = 0.f;
        for (int64_t h = 0; h < kHalves; ++h) {
          const float mh = ms[(cell * kHalves + h) * hg + j];
          // a half that saw no position weighs nothing (its maximum is -inf, as is a row's that saw none)
          w[h] = mh == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(mh - top);
          total += ls[(cell * kHalves + h) * hg + j] * w[h];
        }
        T* o = out + (r * heads + kh0 * g + j) * D;
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t i = 0; i < D; ++i) {
          float v = 0.f;
          for (int64_t h = 0; h < kHalves; ++h) v += accs[((cell * kHalves + h) * hg + j) * D + i] * w[h];
          o[i] = static_cast<T>(v * inv);
        }
      }
    }
  });
}

// decode_walk of Path<D> for the head size of q, where it has a path (head_dims.h); kAny8: the path
// takes any multiple of 8, so the smaller sizes get it too
template <template <int> class Path, bool kAny8 = false>
bool decode_dispatch(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value,
                     const torch::Tensor& blocks, const torch::Tensor& spans, torch::Tensor& out, float scale) {
  using T = typename Path<64>::T;
  const int64_t d = q.size(2);
  if (key.scalar_type() != c10::CppTypeToScalarType<T>::value || value.size(3) != d) return false;
  auto walk = [&](auto tag) {
    decode_walk<Path<decltype(tag)::value>>(q.data_ptr<T>(), key.data_ptr<T>(), value.data_ptr<T>(),
                                            blocks.data_ptr<int64_t>(), spans.data_ptr<int64_t>(), out.data_ptr<T>(),
                                            q.size(0), q.size(1), key.size(1), key.size(2), scale);
  };
  if constexpr (kAny8) {
    return mmfusion::with_any8_head_dim(d, walk);
  } else {
    return mmfusion::with_head_dim(d, walk);
  }
}
#endif

#ifdef MMFUSION_BF16_DOT
// bfloat16 with AVX512-BF16, head size D (a multiple of 32), positions in the lanes: a tile of 16
// keys is transposed in registers (pair p of every position in one vector), so each head's 16
// scores take one vdpbf16ps per pair with the query's pair broadcast, straight from the cache with
// no conversion of the keys. The scores of up to KEEP tiles of a KV head wait in a buffer, and then
// one softmax update serves them all: a maximum, a rescale and a total per head every 128
// positions, not every 16. A head's update is a chain of dependent reductions and an exp, and per
// tile those chains, not the arithmetic, set the pace. The values are then weighed tile by tile,
// widened to float32 in registers once for all the heads of the group. Sums in float32.
constexpr int64_t CHUNK = 16;
constexpr int KEEP = 8;

// acc[h] = acc[h] * corr[h] + sum over the kept tiles' positions t of p[h][t] * v[t], for H heads
// (sums [H][D] one after another, weights `stride` a head, 16 a tile): each position's values are
// widened and loaded once for the H heads, whose sums stay in registers; the order of the sums is a
// single head's
template <int D, int H>
inline void weigh_values(const c10::BFloat16* const* vp, const int* vn, int tiles, const float* p, int64_t stride,
                         const float* corr, float* acc) {
  constexpr int OV = D / 16;
  __m512 o[H][OV];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < OV; ++c) o[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + 16 * c), _mm512_set1_ps(corr[h]));
  for (int i = 0; i < tiles; ++i) {
    const float* pt = p + i * CHUNK;
    for (int t = 0; t < vn[i]; ++t) {
      const __m256i* vt = reinterpret_cast<const __m256i*>(vp[i] + t * D);
      for (int c = 0; c < OV; ++c) {
        const __m512 v = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(vt + c));
        for (int h = 0; h < H; ++h) o[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(pt[h * stride + t]), v, o[h][c]);
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < OV; ++c) _mm512_storeu_ps(acc + h * D + 16 * c, o[h][c]);
}

// tiles of up to 16 positions for a KV head's g query heads (decode_walk's Path); `span` KV heads
// of a work item keep their tiles apart
template <int D_>
struct Bf16Decode {
  using T = c10::BFloat16;
  static constexpr int D = D_;
  static constexpr int64_t TILE = CHUNK;
  static constexpr int QP = D / 2, OV = D / 16;
  static constexpr int64_t ROW = KEEP * CHUNK;  // a head's kept scores
  const int64_t g, span;
  alignas(64) __m512i kt[QP];  // kt[p]: pair p of the tile's positions
  std::vector<float> sc;  // [span][g][ROW]: the kept tiles' scores, then their weights
  std::vector<const T*> vp;  // [span][KEEP]: the kept tiles' values
  std::vector<int> vn;  // [span][KEEP]: their positions
  std::vector<int> kept;  // [span]: tiles kept
  std::vector<float> cj;  // each head's rescale of its earlier sums
  std::vector<uint32_t> qb;  // the item's queries, pairs of bfloat16
  const __m512 vscale, ninf;

  Bf16Decode(int64_t g, int64_t hg, float scale)
      : g(g), span(hg / g), sc(hg * ROW), vp(span * KEEP), vn(span * KEEP), kept(span, 0), cj(g), qb(hg * QP),
        vscale(_mm512_set1_ps(scale)), ninf(_mm512_set1_ps(-std::numeric_limits<float>::infinity())) {}

  void query(int64_t j, const T* q) {
    const uint32_t* qh = reinterpret_cast<const uint32_t*>(q);
    std::copy(qh, qh + QP, qb.data() + j * QP);
  }

  void tile(const T* kb, const T* vb, int n, int64_t j0, float* m, float* l, float* acc) {
    const int64_t s = j0 / g;
    const int k = kept[s];
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    for (int c = 0; c < QP / 16; ++c) {
      __m512i rr[16];
      for (int t = 0; t < 16; ++t) rr[t] = t < n ? _mm512_loadu_si512(kb + t * D + 32 * c) : _mm512_setzero_si512();
      mmfusion::transpose16(rr);
      for (int i = 0; i < 16; ++i) kt[16 * c + i] = rr[i];
    }
    for (int64_t j = j0; j < j0 + g; ++j) {
      const uint32_t* qj = qb.data() + j * QP;
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;  // four chains of the dot products
      for (int p = 0; p < QP; p += 4) {
        s0 = _mm512_dpbf16_ps(s0, (__m512bh)kt[p], (__m512bh)_mm512_set1_epi32(static_cast<int>(qj[p])));
        s1 = _mm512_dpbf16_ps(s1, (__m512bh)kt[p + 1], (__m512bh)_mm512_set1_epi32(static_cast<int>(qj[p + 1])));
        s2 = _mm512_dpbf16_ps(s2, (__m512bh)kt[p + 2], (__m512bh)_mm512_set1_epi32(static_cast<int>(qj[p + 2])));
        s3 = _mm512_dpbf16_ps(s3, (__m512bh)kt[p + 3], (__m512bh)_mm512_set1_epi32(static_cast<int>(qj[p + 3])));
      }
      _mm512_storeu_ps(sc.data() + j * ROW + k * CHUNK,
                       _mm512_mask_mul_ps(ninf, live, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)), vscale));
    }
    vp[s * KEEP + k] = vb;
    vn[s * KEEP + k] = n;
    kept[s] = k + 1;
    if (k + 1 == KEEP) flush(s, m, l, acc);
  }

  // the softmax update of KV head s's kept tiles, and their values weighed into its heads' sums
  void flush(int64_t s, float* m, float* l, float* acc) {
    const int k = kept[s];
    if (k == 0) return;
    for (int64_t j = s * g; j < (s + 1) * g; ++j) {
      float* sj = sc.data() + j * ROW;
      __m512 top = _mm512_loadu_ps(sj);
      for (int i = 1; i < k; ++i) top = _mm512_max_ps(top, _mm512_loadu_ps(sj + i * CHUNK));
      const float mb = std::max(m[j], _mm512_reduce_max_ps(top));
      const float corr = std::exp(m[j] - mb);  // 0 on the first update (m = -inf)
      const __m512 vmb = _mm512_set1_ps(mb);
      __m512 total = _mm512_setzero_ps();
      for (int i = 0; i < k; ++i) {
        const __m512 x = _mm512_loadu_ps(sj + i * CHUNK);
        // a position past the row's end scored -inf and weighs exactly 0
        const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ), mmfusion::exp_neg(_mm512_sub_ps(x, vmb)));
        _mm512_storeu_ps(sj + i * CHUNK, e);
        total = _mm512_add_ps(total, e);
      }
      l[j] = l[j] * corr + _mm512_reduce_add_ps(total);
      m[j] = mb;
      cj[j - s * g] = corr;
    }
    const T* const* v = vp.data() + s * KEEP;
    const int* n = vn.data() + s * KEEP;
    for (int64_t j = 0; j < g;) {
      const int64_t h = s * g + j, left = g - j;
      const float* p = sc.data() + h * ROW;
      if (left >= 3 && 3 * OV <= 12) {
        weigh_values<D, 3>(v, n, k, p, ROW, cj.data() + j, acc + h * D);
        j += 3;
      } else if (left >= 2 && 2 * OV <= 16) {
        weigh_values<D, 2>(v, n, k, p, ROW, cj.data() + j, acc + h * D);
        j += 2;
      } else {
        weigh_values<D, 1>(v, n, k, p, ROW, cj.data() + j, acc + h * D);
        j += 1;
      }
    }
    kept[s] = 0;
  }

  // the work item's last tiles: its sums, maxima and totals are whole after this
  void finish(float* m, float* l, float* acc) {
    for (int64_t s = 0; s < span; ++s) flush(s, m, l, acc);
  }
};

#endif

#ifdef MMFUSION_F32_AVX2
// float32 with AVX2 and FMA (the KV cache of 16-bit weights computing in float32, and of float32
// models), head size D (a multiple of 8): the keys and values are read from the cache in place
// (no copy into a float buffer), eight positions a tile; each head's eight dot products are eight
// vector accumulators summed across in one transposing reduction, and the softmax over the tile is
// vector work. The next block's keys and values are prefetched, as the bf16 path does.
template <int D_>
struct F32Decode {
  using T = float;
  static constexpr int D = D_;
  static constexpr int64_t TILE = 8;
  static constexpr int V = D / 8;
  const int64_t g;
  const float scale;
  std::vector<float> qs;  // the item's queries, scaled
  alignas(32) float pj[TILE];
  const __m256 ninf;
  const __m256i lane;

  F32Decode(int64_t g, int64_t hg, float scale)
      : g(g), scale(scale), qs(hg * D), ninf(_mm256_set1_ps(-std::numeric_limits<float>::infinity())),
        lane(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)) {}

  void query(int64_t j, const float* qh) {
    for (int i = 0; i < D; ++i) qs[j * D + i] = qh[i] * scale;
  }

  void finish(float*, float*, float*) {}  // each tile's update is whole

  void tile(const float* kb, const float* vb, int n, int64_t j0, float* m, float* l, float* acc) {
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
    for (int64_t j = j0; j < j0 + g; ++j) {
      const float* qj = qs.data() + j * D;
      __m256 a[TILE];
      for (int t = 0; t < TILE; ++t) a[t] = _mm256_setzero_ps();
      for (int t = 0; t < n; ++t) {
        const float* kt = kb + t * D;
        __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(qj), _mm256_loadu_ps(kt));
        for (int c = 1; c < V; ++c) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qj + 8 * c), _mm256_loadu_ps(kt + 8 * c), s0);
        a[t] = s0;
      }
      const __m256 sc = _mm256_blendv_ps(ninf, mmfusion::hsum8x8(a), live);
      const float mb = std::max(m[j], mmfusion::hmax8(sc));
      // 0 on the first tile (m = -inf); exactly 1 where the maximum stands, most tiles after the
      // first few, without a scalar exp a tile and head (an eighth of the walk at 512 positions)
      const float corr = mb == m[j] ? 1.f : std::exp(m[j] - mb);
      const __m256 e = _mm256_and_ps(mmfusion::exp_neg8(_mm256_sub_ps(sc, _mm256_set1_ps(mb))), live);
      l[j] = l[j] * corr + mmfusion::hadd8(e);
      m[j] = mb;
      _mm256_store_ps(pj, e);
      float* aj = acc + j * D;
      __m256 o[V];
      const __m256 cv = _mm256_set1_ps(corr);
      for (int c = 0; c < V; ++c) o[c] = _mm256_mul_ps(_mm256_loadu_ps(aj + 8 * c), cv);
      for (int t = 0; t < n; ++t) {
        const __m256 pt = _mm256_set1_ps(pj[t]);
        const float* vt = vb + t * D;
        for (int c = 0; c < V; ++c) o[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * c), o[c]);
      }
      for (int c = 0; c < V; ++c) _mm256_storeu_ps(aj + 8 * c, o[c]);
    }
  }
};
#endif

}  // namespace

// q [D, H, d]; key/value caches of one layer [num_blocks, kvh, block, d|dv] (contiguous);
// blocks [T] the rows' block lists one after another; spans [D, 4]: (first entry in blocks,
// entries, lo, hi) with [lo, hi) the positions the row sees, counted from its first block.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor key, torch::Tensor value, torch::Tensor blocks,
                           torch::Tensor spans, double scale) {
  TORCH_CHECK(q.dim() == 3 && key.dim() == 4 && value.dim() == 4, "paged_decode: bad ranks");
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous(), "paged_decode: caches must be contiguous");
  q = q.to(key.scalar_type()).contiguous();
  blocks = blocks.to(torch::kLong).contiguous();
  spans = spans.to(torch::kLong).contiguous();
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kvh = key.size(1), bs = key.size(2), dv = value.size(3);
  TORCH_CHECK(heads % kvh == 0, "paged_decode: heads must be a multiple of KV heads");
  auto out = torch::empty({rows, heads, dv}, q.options());
#ifdef MMFUSION_BF16_DOT
  if (decode_dispatch<Bf16Decode>(q, key, value, blocks, spans, out, static_cast<float>(scale))) return out;
#endif
#ifdef MMFUSION_F32_AVX2
  if (decode_dispatch<F32Decode, true>(q, key, value, blocks, spans, out, static_cast<float>(scale))) return out;
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(),
                     blocks.data_ptr<int64_t>(), spans.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), rows, heads,
                     kvh, bs, d, dv, static_cast<float>(scale));
  });
  return out;
}

// which paths this build has, for tests and logs
std::vector<std::string> paths() {
  std::vector<std::string> p{"generic"};
#ifdef MMFUSION_F32_AVX2
  p.push_back("f32_avx2");
#endif
#ifdef MMFUSION_BF16_DOT
  p.push_back("bf16_avx512");
#endif
  return p;
}
