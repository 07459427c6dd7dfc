// A bfloat16 linear over weights packed once into the layout AMX tiles read (pairs of inputs side by
// side, panels of 64 or 32 output rows): on AMX tiles through ATen's batch-reduce GEMM
// (at::native::cpublas::brgemm, oneDNN's micro-kernel), and on a CPU with AVX512-BF16 and no tiles
// through the strips' register tiles (qlinear_bf16.h's outer_tile: the same layout is vdpbf16ps's, a
// pair of 16 output rows a vector). The packed weights are a plain tensor, not oneDNN's opaque one,
// so a file of them can be mapped by every copy of a model (row_kernels' "packed" way). oneDNN's own
// linear on its prepacked weights costs 30-40 us a call at few rows on a 2-core Sapphire Rapids,
// where the tiles cost 7-20; on an AVX512-BF16 EPYC the quantized blocks' strips, which widen the
// blocks on every call, took 1.3-1.6x oneDNN's time on SmolLM2's gate/up at 12-20 rows.
#include <ATen/native/CPUBlas.h>

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "torch_lite.h"

namespace {
// output rows a panel: 64 where the output rows divide into them, else 32 (two tiles' columns).
// One call of the micro-kernel covers a panel, so wider panels halve the calls and the times each
// row block of activations is read: on SmolLM2's linears (2-core Sapphire Rapids, the layouts
// alternated call by call) panels of 64 took 0.80-0.93x the time of 32 at 64 to 512 rows, and the
// same at 16.
constexpr int64_t kPanel = 32, kWidePanel = 64;
// input rows a call of the micro-kernel: two tiles' rows. Sixteen for 1,536 inputs (whose 32 rows
// of activations overflow L1) took 1.1-1.25x the time of 32 at 64 to 512 rows in the same
// measurements.
constexpr int64_t kRowsACall = 32;

int64_t panel_for(int64_t n) { return n % kWidePanel == 0 ? kWidePanel : kPanel; }
}  // namespace

bool amx_packs() { return at::native::cpublas::could_pack(at::kBFloat16); }

bool bf16_pack_supported() {
#ifdef MMFUSION_QLINEAR_BF16
  return true;  // the tiles where the CPU has them, else the strips' register tiles
#else
  return amx_packs();
#endif
}

namespace {
// panel p of w [N, K] in the tiles' layout: pair i of inputs of output row j at [i, j] (32 bits)
void pack_pairs(const c10::BFloat16* w, int64_t k, int64_t panel, int64_t p, c10::BFloat16* dst) {
  auto* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t j = 0; j < panel; ++j) {
    const auto* row = reinterpret_cast<const uint32_t*>(w + (p * panel + j) * k);
    for (int64_t i = 0; i < k / 2; ++i) out[i * panel + j] = row[i];
  }
}
}  // namespace

// w [N, K] bfloat16 (N a multiple of kPanel, K even) -> [N / P, K, P] in the tiles' layout, P
// output rows a panel (panel_for(N)): the shape says the width, so either multiplies right
at::Tensor bf16_pack(at::Tensor w) {
  TORCH_CHECK(bf16_pack_supported(), "bf16_pack: this CPU has neither AMX tiles nor AVX512-BF16 for bfloat16");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "bf16_pack: w must be a 2-d bfloat16 tensor");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n % kPanel == 0 && k % 2 == 0, "bf16_pack: out features must be a multiple of ", kPanel,
              " and in features even, got ", n, "x", k);
  const int64_t panel = panel_for(n);
  at::Tensor out = at::empty({n / panel, k, panel}, w.options());
  auto* dst = out.data_ptr<c10::BFloat16>();
  if (!amx_packs()) {
    const at::Tensor wc = w.contiguous();
    const auto* src = wc.data_ptr<c10::BFloat16>();
    at::parallel_for(0, n / panel, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) pack_pairs(src, k, panel, p, dst + p * k * panel);
    });
    return out;
  }
  const at::Tensor wt = w.t().contiguous();  // [K, N]: what the packing reads
  const auto* src = wt.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n / panel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      at::native::cpublas::pack(k, panel, n, panel, at::kBFloat16, at::kBFloat16, src + p * panel, dst + p * k * panel);
    }
  });
  return out;
}

// x [M, K] bfloat16 @ W.T (+ bias) for W packed by bf16_pack: [M, N] bfloat16, summed in float32
at::Tensor bf16_packed_linear(at::Tensor x, at::Tensor packed, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_packed_linear: x must be 2-d bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  (packed.size(2) == kPanel || packed.size(2) == kWidePanel),
              "bf16_packed_linear: packed must be bf16_pack's result");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), panel = packed.size(2), n = panels * panel;
  TORCH_CHECK(packed.size(1) == k, "bf16_packed_linear: x has ", k, " features, the weights ", packed.size(1));
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == n, "bf16_packed_linear: bias must have ", n, " values");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const at::Tensor xc = x.contiguous();
  const at::Tensor b = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const auto* a = xc.data_ptr<c10::BFloat16>();
  const auto* w = packed.data_ptr<c10::BFloat16>();
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  auto* y = out.data_ptr<c10::BFloat16>();
  const int64_t blocks = (m + kRowsACall - 1) / kRowsACall;
#ifdef MMFUSION_QLINEAR_BF16
  if (!amx_packs()) {  // vdpbf16ps over the same layout: MR rows x the panel's vectors in registers
    const auto* wp = reinterpret_cast<const uint32_t*>(w);
    at::parallel_for(0, panels * blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t p = i / blocks, m0 = (i % blocks) * kRowsACall, rows = std::min(kRowsACall, m - m0);
        row_tiles(rows, [&](int64_t r0, int64_t mr) {
          with_rows(mr, [&]<int MR>() {
            const int64_t at = m0 + r0;
            if (panel == kWidePanel) {
              outer_tile<MR, 4>(a + at * k, k, wp + p * (k / 2) * panel, panel, bp, p * panel, n, y + at * n);
            } else {
              outer_tile<MR, 2>(a + at * k, k, wp + p * (k / 2) * panel, panel, bp, p * panel, n, y + at * n);
            }
          });
        });
      }
    });
    return out;
  }
#else
  TORCH_CHECK(amx_packs(), "bf16_packed_linear: this build has no AVX512-BF16 path and the CPU no AMX tiles");
#endif
  // a panel's weights (K x its width) stay in L1/L2 while every block of rows passes them
  at::parallel_for(0, panels * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> c(kRowsACall * panel);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = i / blocks, m0 = (i % blocks) * kRowsACall, rows = std::min(kRowsACall, m - m0);
      at::native::cpublas::brgemm(rows, panel, k, k, panel, panel, false, a + m0 * k, w + p * k * panel, c.data());
      for (int64_t r = 0; r < rows; ++r) {
        c10::BFloat16* row = y + (m0 + r) * n + p * panel;
        const float* cr = c.data() + r * panel;
#ifdef __AVX512BF16__
        for (int64_t j = 0; j < panel; j += 16) {
          __m512 v = _mm512_loadu_ps(cr + j);
          if (bp) v = _mm512_add_ps(v, _mm512_loadu_ps(bp + p * panel + j));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
        }
#else
        for (int64_t j = 0; j < panel; ++j) row[j] = static_cast<c10::BFloat16>(cr[j] + (bp ? bp[p * panel + j] : 0.f));
#endif
      }
    }
    at::native::cpublas::brgemm_release();
  });
  return out;
}
