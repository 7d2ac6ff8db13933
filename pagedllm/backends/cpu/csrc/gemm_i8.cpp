// W8A8 GEMM: y[M, N] = (qx[M, K] . qw[N, K]) * sx[M] * sw[N] (+ bias[N]), where qx is x rounded
// per row (token) to int8 with sx = max|x[m, :]| / 127, and qw the per-output-channel int8 weight.
//
// Why: at a few dozen rows the weight-only int8 GEMM (gemm.cpp) is bound by float32 FMAs, not by
// bytes, so it is barely faster than bf16. Integer dot products do 4 multiply-adds per byte lane:
// on AVX2, vpmaddubsw (u8 x s8 -> pairs summed to s16) then vpmaddwd by ones (-> s32) do 32 MACs
// in two multiply uops, twice the MACs of two FMAs. vpmaddubsw saturates when both pair products
// are large, so its unsigned operand is |x| and the sign of x moves onto w (vpsignb): with both
// sides in [-127, 127] a pair sums to at most 2 * 127 * 127 < 2^15, nothing saturates and the
// int32 sums are exact. AVX-512 VNNI's vpdpbusd (u8 x s8 summed straight into s32) cannot
// saturate, so there w is offset by 128 to make it unsigned and 128 * sum_k(x) is taken off once
// per row of x.
//
// Layout: weights packed once at load as [ceil(N/16)][ceil(K/4)][16][4]: for each group of 4
// consecutive k, a panel's 16 columns x 4 k are 64 contiguous bytes (one zmm, two ymm), which is
// what the dot-product instructions consume against a broadcast 4-byte group of x. K is padded
// with zero weights (and zero activations).
#include "gemm_i8.h"

#include "convert.h"
#include "dtype_dispatch.h"
#include "gemm_amx.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedllm::gemm {
namespace {

constexpr int64_t kCols = 16;                  // output columns per panel
constexpr int64_t kGroup = 4;                  // consecutive k per group
constexpr int64_t kGroupBytes = kCols * kGroup;  // 64
// K-groups per block: a 16 KiB block of one panel's weights stays in L1 across all row tiles.
constexpr int64_t kBlockGroups = 256;

inline int32_t load_group(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#if defined(__AVX512VNNI__)
constexpr int kTileRows = 12;  // 12 zmm accumulators, the weights, the flip constant
constexpr bool kOffsetW = true;

// vpdpbusd multiplies unsigned by signed bytes. The weights take the unsigned side, offset by 128
// in registers (one xor per 64 bytes, shared by every row), so that x, signed, is the operand
// the instruction broadcasts straight from memory: one instruction per row and group of 4 k.
template <int R>
inline void tile(const int8_t* x, int64_t ldx, const int8_t* w, int64_t gc, int32_t* c,
                 bool accumulate) {
  __m512i acc[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    acc[r] = accumulate ? _mm512_loadu_si512(c + r * kCols) : _mm512_setzero_si512();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // s8 -> u8 = s8 + 128
  for (int64_t g = 0; g < gc; ++g) {
    const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(w + g * kGroupBytes), flip);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(load_group(x + r * ldx + g * kGroup));
      acc[r] = _mm512_dpbusd_epi32(acc[r], wv, xv);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_storeu_si512(c + r * kCols, acc[r]);
}

#elif defined(__AVX2__)
constexpr int kTileRows = 4;  // 8 ymm accumulators + 2 weights + 4 temporaries of 16 registers
constexpr bool kOffsetW = false;

template <int R>
inline void tile(const int8_t* x, int64_t ldx, const int8_t* w, int64_t gc, int32_t* c,
                 bool accumulate) {
  __m256i lo[R], hi[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    lo[r] = accumulate ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * kCols))
                       : _mm256_setzero_si256();
    hi[r] = accumulate ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * kCols + 8))
                       : _mm256_setzero_si256();
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < gc; ++g) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * kGroupBytes));
    const __m256i w1 =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * kGroupBytes + 32));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i xs = _mm256_set1_epi32(load_group(x + r * ldx + g * kGroup));
      const __m256i xa = _mm256_abs_epi8(xs);  // |x| as u8; the sign moves onto w
      const __m256i p0 = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(w0, xs));
      const __m256i p1 = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(w1, xs));
      lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(p0, ones));
      hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(p1, ones));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * kCols), lo[r]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * kCols + 8), hi[r]);
  }
}

#else
constexpr int kTileRows = 4;
constexpr bool kOffsetW = false;

template <int R>
inline void tile(const int8_t* x, int64_t ldx, const int8_t* w, int64_t gc, int32_t* c,
                 bool accumulate) {
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < kCols; ++j) {
      int32_t s = accumulate ? c[r * kCols + j] : 0;
      for (int64_t g = 0; g < gc; ++g)
        for (int64_t t = 0; t < kGroup; ++t)
          s += static_cast<int32_t>(x[r * ldx + g * kGroup + t]) *
               static_cast<int32_t>(w[g * kGroupBytes + j * kGroup + t]);
      c[r * kCols + j] = s;
    }
  }
}
#endif

// tile<rows> for a run-time row count 1..kTileRows.
template <int R = kTileRows>
inline void tile_rows(int rows, const int8_t* x, int64_t ldx, const int8_t* w, int64_t gc,
                      int32_t* c, bool accumulate) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1>(rows, x, ldx, w, gc, c, accumulate);
  }
  tile<R>(x, ldx, w, gc, c, accumulate);
}

// acc[M][16] = qx[M, 4 * groups] . panel; qx rows are ldx bytes apart.
void panel_s32(const int8_t* qx, int64_t m, int64_t ldx, const int8_t* wp, int64_t groups,
               int32_t* acc) {
  for (int64_t g0 = 0; g0 < groups; g0 += kBlockGroups) {
    const int64_t gc = std::min(kBlockGroups, groups - g0);
    for (int64_t m0 = 0; m0 < m; m0 += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - m0));
      tile_rows(rows, qx + m0 * ldx + g0 * kGroup, ldx, wp + g0 * kGroupBytes, gc,
                acc + m0 * kCols, g0 > 0);
    }
  }
}

#if defined(__AVX512BF16__)
// From this many bf16 rows an int8 weight-only layer converts its weights for vdpbf16ps instead
// of running x's two int8 planes (int8_split_gemm; benchmarks/linear_cpu.py's int8_planes_cpp
// against int8_split_cpp on a Zen 4 EPYC, see docs/backends.md). Below it the planes win.
constexpr int64_t kDpMinRows = 32;
#endif

// Whether the integer sums of m rows run on AMX-INT8 tiles (whole 64-k tiles, enough rows).
bool sums_on_tiles(int64_t m, int64_t groups, bool allow_amx) {
  return allow_amx && m >= amx::kMinRowsInt8 && groups % 16 == 0 && amx::int8_available();
}

// Rows of x per pass over the panels. Every panel reads all rows of its pass again, so a pass
// must stay in L2 (measured at K = 2048 on AMX-INT8: 1024 rows in one pass took 2.8x the time of
// 512). A multiple of 48 rows: three AMX row tiles, four of the VNNI kernel's 12-row tiles.
constexpr int64_t kPassBytes = int64_t{1} << 20;
constexpr int64_t kPassRowMultiple = 48;

int64_t pass_rows(int64_t m, int64_t ldx) {
  const int64_t fit = std::max<int64_t>(1, kPassBytes / (ldx * kPassRowMultiple));
  return std::min(m, fit * kPassRowMultiple);
}

// Runs every panel (threads split them) and hands each panel's int32 sums, corrected for the
// offset of the weights where the build uses one, to store(acc, r0, rows, n0, cols): rows
// r0..r0+rows of x (acc row 0 is row r0) against columns n0..n0+cols. With AMX-INT8 (and whole
// 64-k tiles) the tiles compute the same exact sums, signed by signed, with no offset.
template <typename Store>
void for_each_panel(const int8_t* qx, int64_t m, int64_t ldx, const int8_t* w, int64_t groups,
                    int64_t n, bool allow_amx, const Store& store) {
  const int64_t panels = (n + kCols - 1) / kCols;
  const bool tiles = sums_on_tiles(m, groups, allow_amx);
  const std::vector<uint8_t> xa = tiles ? amx::pack_int8_rows(qx, m, ldx) : std::vector<uint8_t>{};
  // sum_k (w + 128) x = sum_k w x + 128 sum_k x: one correction per row of x.
  const bool offset_w = kOffsetW && !tiles;
  std::vector<int32_t> offset(offset_w ? static_cast<size_t>(m) : 0);
  if (offset_w) {
    for (int64_t r = 0; r < m; ++r) {
      int32_t sum = 0;
      for (int64_t i = 0; i < ldx; ++i) sum += qx[r * ldx + i];
      offset[r] = 128 * sum;
    }
  }
  const int64_t step = pass_rows(m, ldx);
  for (int64_t r0 = 0; r0 < m; r0 += step) {  // r0 is a multiple of 16: a whole row tile
    const int64_t rows = std::min(step, m - r0), row_tiles = (rows + 15) / 16;
    auto panel_at = [&](int64_t p) { return w + p * groups * kGroupBytes; };
    auto store_panel = [&](const int32_t* acc, int64_t p) {
      const int64_t n0 = p * kCols;
      store(acc, r0, rows, n0, std::min(kCols, n - n0));
    };
    if (tiles) {  // two panels at a time share the loads of x's tiles
      const int64_t tile_rows = row_tiles * 16;
      at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t begin, int64_t end) {
        std::vector<int32_t> acc(static_cast<size_t>(2 * tile_rows * kCols));
        int32_t* acc1 = acc.data() + tile_rows * kCols;
        amx::begin_tiles();
        for (int64_t q = begin; q < end; ++q) {
          const int64_t p = 2 * q;
          const bool pair = p + 1 < panels;
          // A tiles are 16 rows x 64 bytes, so row r0 starts at byte r0 * ldx.
          amx::panels_int8(xa.data() + r0 * ldx, row_tiles, groups, panel_at(p),
                           pair ? panel_at(p + 1) : nullptr, acc.data(), acc1);
          store_panel(acc.data(), p);
          if (pair) store_panel(acc1, p + 1);
        }
        amx::end_tiles();
      });
      continue;
    }
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      std::vector<int32_t> acc(static_cast<size_t>(rows * kCols));
      for (int64_t p = begin; p < end; ++p) {
        panel_s32(qx + r0 * ldx, rows, ldx, panel_at(p), groups, acc.data());
        if (offset_w) {
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < kCols; ++j) acc[r * kCols + j] -= offset[r0 + r];
        }
        store_panel(acc.data(), p);
      }
    });
  }
}

// max|row[i]|, vectorised: max is exact in any order.
inline float row_absmax(const float* row, int64_t k) {
  int64_t i = 0;
  float amax = 0.f;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + i)));
  amax = _mm512_reduce_max_ps(vmax);
#elif PAGEDLLM_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(row + i)));
  amax = hmax8(vmax);
#endif
  for (; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
  return amax;
}

// q[i] = clamp(round(row[i] / scale), -127, 127): a true division and round-half-to-even, as
// PyTorch's `(x / s).round()` computes it, so the vector bodies agree with it bit for bit.
inline void quantize_row(const float* row, int64_t k, float scale, int8_t* q) {
  int64_t i = 0;
#if defined(__AVX512F__)
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 vs = _mm512_set1_ps(scale);
  const __m512 lim = _mm512_set1_ps(127.f), nlim = _mm512_set1_ps(-127.f);
  for (; i + 16 <= k; i += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(row + i), vs), kRound);
    v = _mm512_min_ps(lim, _mm512_max_ps(nlim, v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
  }
#elif PAGEDLLM_AVX2
  const __m256 vs = _mm256_set1_ps(scale);
  const __m256 lim = _mm256_set1_ps(127.f), nlim = _mm256_set1_ps(-127.f);
  for (; i + 8 <= k; i += 8) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + i), vs),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(lim, _mm256_max_ps(nlim, v));
    const __m256i w = _mm256_cvtps_epi32(v);
    const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(h, h));
  }
#endif
  for (; i < k; ++i) {
    const float v = std::nearbyint(row[i] / scale);
    q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
}

// Row r of x -> q[r, 0:ldq] (zeros past k) and s[r] = max|x[r]| / 127 (1 for an all-zero row),
// or absmax[r] / 127 where the caller gives each row's maximum (a row-parallel shard of a weight
// scaled as its whole row is).
template <typename In>
void quantize_into(const In* x, int64_t m, int64_t k, int64_t ldq, const float* absmax, int8_t* q,
                   float* s) {
  at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(k));
    for (int64_t r = begin; r < end; ++r) {
      load_floats(x + r * k, row.data(), k);
      float scale = (absmax ? absmax[r] : row_absmax(row.data(), k)) / 127.f;
      if (!(scale > 0.f)) scale = 1.f;  // an all-zero row: any scale gives zeros
      s[r] = scale;
      int8_t* qr = q + r * ldq;
      quantize_row(row.data(), k, scale, qr);
      std::fill(qr + k, qr + ldq, int8_t{0});
    }
  });
}

// The two-plane split of int8 weight-only layers (int8_split_gemm): each row of x becomes
// hi * s_hi + lo * s_lo with int8 hi and lo, s_hi = max|x| / 127 and s_lo = s_hi / 254, so the
// remainder x - hi * s_hi (at most s_hi / 2) is itself rounded to int8: x is kept to
// max|x| / 64516, finer than bf16's own rounding of the row's large elements (2^-9 relative),
// and the GEMM becomes an exact integer one on 2M rows, which AMX-INT8 runs at twice the
// multiply-adds of AMX-BF16 and with no conversion of the weights.
//
// Plane rows: tokens in chunks of 8, each chunk one 16-row tile of its tokens' hi rows then their
// lo rows (2 * tokens rows in the last, shorter chunk), so both planes of a token always fall in
// the same pass over the panels and small batches fill a tile: 1-8 tokens take one.
constexpr int64_t kSplitChunk = 8;
constexpr float kLoSteps = 254.f;

struct PlaneRows {
  int64_t hi, lo;
};

inline PlaneRows plane_rows(int64_t token, int64_t m) {
  const int64_t chunk = token / kSplitChunk, j = token % kSplitChunk;
  const int64_t base = chunk * 2 * kSplitChunk;
  const int64_t count = std::min(kSplitChunk, m - chunk * kSplitChunk);
  return {base + j, base + count + j};
}

// The row's two planes and scales: the formula of pagedllm.layers.quantization.int8.split_rows,
// rounding for rounding (products and differences as separate float operations).
inline void split_row(const float* row, int64_t k, int64_t ldq, int8_t* hi, int8_t* lo,
                      float* s_hi, float* s_lo) {
  float sh = row_absmax(row, k) / 127.f;
  if (!(sh > 0.f)) sh = 1.f;  // an all-zero row: any scale gives zeros
  const float sl = sh / kLoSteps, inv_h = 1.f / sh, inv_l = 1.f / sl;
  *s_hi = sh;
  *s_lo = sl;
  int64_t i = 0;
#if defined(__AVX512F__)
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 lim = _mm512_set1_ps(127.f), nlim = _mm512_set1_ps(-127.f);
  const __m512 vh = _mm512_set1_ps(sh), vih = _mm512_set1_ps(inv_h), vil = _mm512_set1_ps(inv_l);
  for (; i + 16 <= k; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    __m512 h = _mm512_roundscale_ps(_mm512_mul_ps(v, vih), kRound);
    h = _mm512_min_ps(lim, _mm512_max_ps(nlim, h));
    // Explicitly rounded operations: GCC may fuse a plain vector multiply and subtract.
    const __m512 r = _mm512_sub_round_ps(v, _mm512_mul_round_ps(h, vh, kRound), kRound);
    __m512 l = _mm512_roundscale_ps(_mm512_mul_ps(r, vil), kRound);
    l = _mm512_min_ps(lim, _mm512_max_ps(nlim, l));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(h)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(l)));
  }
#endif
  for (; i < k; ++i) {
    const float h = std::min(127.f, std::max(-127.f, std::nearbyint(row[i] * inv_h)));
    volatile float p = h * sh;  // no fused multiply-subtract: the reference rounds the product
    const float l = std::min(127.f, std::max(-127.f, std::nearbyint((row[i] - p) * inv_l)));
    hi[i] = static_cast<int8_t>(h);
    lo[i] = static_cast<int8_t>(l);
  }
  std::fill(hi + k, hi + ldq, int8_t{0});
  std::fill(lo + k, lo + ldq, int8_t{0});
}

template <typename In>
void split_into(const In* x, int64_t m, int64_t k, int64_t ldq, int8_t* q, float* s) {
  at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(k));
    for (int64_t t = begin; t < end; ++t) {
      load_floats(x + t * k, row.data(), k);
      const PlaneRows pr = plane_rows(t, m);
      split_row(row.data(), k, ldq, q + pr.hi * ldq, q + pr.lo * ldq, s + pr.hi, s + pr.lo);
    }
  });
}

void check_packed(const char* name, const torch::Tensor& packed, int64_t k, int64_t n) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kChar && packed.dim() == 3 &&
                  packed.size(2) == kGroupBytes && packed.is_contiguous(),
              name, ": packed weight must be a contiguous int8 [N/16, K/4, 64], got ",
              packed.sizes());
  const int64_t panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == (k + kGroup - 1) / kGroup, name, ": x has K=", k,
              ", weight has ", packed.size(1), " groups of 4");
  TORCH_CHECK(n > (panels - 1) * kCols && n <= panels * kCols, name, ": N=", n,
              " does not fit ", panels, " panels of 16");
}

// (int8 [planes * M, 4 * groups], float32 [planes * M]) for x [M, K]: one row per token
// (planes 1, quantize_into, optionally scaled by the given row maxima) or two (split_into).
std::tuple<torch::Tensor, torch::Tensor> rows_padded(const char* name, const torch::Tensor& x,
                                                     int64_t groups, int64_t planes,
                                                     const float* absmax = nullptr) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, name, ": x must be a CPU [M, K], got ",
              x.sizes());
  const torch::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), ldq = groups * kGroup;
  torch::Tensor q = torch::empty({planes * m, ldq}, xc.options().dtype(at::kChar));
  torch::Tensor s = torch::empty({planes * m}, xc.options().dtype(at::kFloat));
  auto* qp = q.data_ptr<int8_t>();
  auto* sp = s.data_ptr<float>();
  with_float_elements(xc, name, [&](const auto* in) {
    if (planes == 1) {
      quantize_into(in, m, k, ldq, absmax, qp, sp);
    } else {
      split_into(in, m, k, ldq, qp, sp);
    }
  });
  return {q, s};
}

std::tuple<torch::Tensor, torch::Tensor> quantize_padded(const torch::Tensor& x, int64_t groups) {
  return rows_padded("w8a8", x, groups, 1);
}

// (int8 [2M, 4 * groups] in plane-row order, float32 [2M]) for x [M, K].
std::tuple<torch::Tensor, torch::Tensor> split_padded(const torch::Tensor& x, int64_t groups) {
  return rows_padded("int8_split", x, groups, 2);
}

#if defined(__AVX512F__)
// 16 float32 -> Out, rounded to nearest even as the scalar casts round.
inline void store16(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }
inline void store16(at::Half* y, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(y, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store16(at::BFloat16* y, __m512 v, __mmask16 mask) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(y, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
#else
  alignas(64) float f[16];
  _mm512_store_ps(f, v);
  for (int j = 0; j < 16; ++j)
    if ((mask >> j) & 1) y[j] = static_cast<at::BFloat16>(f[j]);
#endif
}
#endif

// y[r, n0:n0+cols] = acc[r] * sx[r] * sw (+ bias): with AVX-512 16 outputs at a time (at 64 rows
// and N = 16384 the scalar loop cost as much as the AMX tiles' whole GEMM).
template <typename Out>
void store_rows(const int32_t* acc, int64_t m, int64_t n, int64_t n0, int64_t cols,
                const float* sx, const float* sw, const float* bias, Out* y) {
#if defined(__AVX512F__)
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 w = _mm512_maskz_loadu_ps(mask, sw + n0);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < m; ++r) {
    __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + r * kCols));
    v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(sx[r])), w);
    if (bias) v = _mm512_add_ps(v, b);
    store16(y + r * n + n0, v, mask);
  }
#else
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      float v = static_cast<float>(acc[r * kCols + j]) * sx[r] * sw[n0 + j];
      if (bias != nullptr) v += bias[n0 + j];
      y[r * n + n0 + j] = static_cast<Out>(v);
    }
  }
#endif
}

// y[t, n0:n0+cols] = (hi . w * s_hi + lo . w * s_lo) * sw (+ bias) for the tokens of plane
// rows r0..r0+rows (whole chunks: r0 is a multiple of 16); acc row 0 is plane row r0.
template <typename Out>
void store_split(const int32_t* acc, int64_t r0, int64_t rows, int64_t m, int64_t n, int64_t n0,
                 int64_t cols, const float* s, const float* sw, const float* bias, Out* y) {
#if defined(__AVX512F__)
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 w = _mm512_maskz_loadu_ps(mask, sw + n0);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
#endif
  for (int64_t c0 = 0; c0 < rows; c0 += 2 * kSplitChunk) {
    const int64_t t0 = (r0 + c0) / 2;  // chunk (r0 + c0) / 16 starts at token 8 * that
    const int64_t count = std::min(kSplitChunk, m - t0);
    for (int64_t j = 0; j < count; ++j) {
      const int32_t* hi = acc + (c0 + j) * kCols;
      const int32_t* lo = acc + (c0 + count + j) * kCols;
      const float sh = s[r0 + c0 + j], sl = s[r0 + c0 + count + j];
      Out* out = y + (t0 + j) * n + n0;
#if defined(__AVX512F__)
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(lo)), _mm512_set1_ps(sl));
      v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(hi)), _mm512_set1_ps(sh), v);
      v = _mm512_mul_ps(v, w);
      if (bias) v = _mm512_add_ps(v, b);
      store16(out, v, mask);
#else
      for (int64_t c = 0; c < cols; ++c) {
        float v = (static_cast<float>(hi[c]) * sh + static_cast<float>(lo[c]) * sl) * sw[n0 + c];
        if (bias != nullptr) v += bias[n0 + c];
        out[c] = static_cast<Out>(v);
      }
#endif
    }
  }
}

template <typename Out>
void split_out(const torch::Tensor& q, const torch::Tensor& s, int64_t m,
               const torch::Tensor& packed, int64_t n, const float* sw, const float* bias,
               bool allow_amx, Out* y) {
  const float* sp = s.data_ptr<float>();
  for_each_panel(q.data_ptr<int8_t>(), 2 * m, q.size(1), packed.data_ptr<int8_t>(),
                 packed.size(1), n, allow_amx,
                 [&](const int32_t* acc, int64_t r0, int64_t rows, int64_t n0, int64_t cols) {
                   store_split(acc, r0, rows, m, n, n0, cols, sp, sw, bias, y);
                 });
}

template <typename Out>
void gemm_out(const torch::Tensor& qx, const torch::Tensor& sx, const torch::Tensor& packed,
              int64_t n, const float* sw, const float* bias, bool allow_amx, Out* y) {
  const float* sxp = sx.data_ptr<float>();
  const int64_t m = qx.size(0);
  for_each_panel(qx.data_ptr<int8_t>(), m, qx.size(1), packed.data_ptr<int8_t>(), packed.size(1),
                 n, allow_amx,
                 [&](const int32_t* acc, int64_t r0, int64_t rows, int64_t n0, int64_t cols) {
                   store_rows(acc, rows, n, n0, cols, sxp + r0, sw, bias, y + r0 * n);
                 });
}

}  // namespace

torch::Tensor pack_w8a8(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kChar,
              "pack_w8a8: weight must be a CPU int8 [N, K], got ", weight.scalar_type(), " ",
              weight.sizes());
  const torch::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = (n + kCols - 1) / kCols, groups = (k + kGroup - 1) / kGroup;
  torch::Tensor out = torch::zeros({panels, groups, kGroupBytes}, w.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t rows = std::min<int64_t>(kCols, n - p * kCols);
      int8_t* panel = dst + p * groups * kGroupBytes;
      for (int64_t j = 0; j < rows; ++j) {
        const int8_t* row = src + (p * kCols + j) * k;
        const int64_t whole = k / kGroup;
        for (int64_t g = 0; g < whole; ++g)
          std::memcpy(panel + g * kGroupBytes + j * kGroup, row + g * kGroup, kGroup);
        for (int64_t i = whole * kGroup; i < k; ++i)
          panel[whole * kGroupBytes + j * kGroup + (i - whole * kGroup)] = row[i];
      }
    }
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> quantize_rows(const torch::Tensor& x,
                                                       const c10::optional<torch::Tensor>& absmax) {
  TORCH_CHECK(x.dim() == 2, "quantize_rows: x must be [M, K], got ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1);
  torch::Tensor amax;
  if (absmax.has_value()) {
    amax = absmax->contiguous();
    TORCH_CHECK(amax.device().is_cpu() && amax.scalar_type() == at::kFloat && amax.dim() == 1 &&
                    amax.size(0) == m,
                "quantize_rows: absmax must be a CPU float32 [M] = [", m, "], got ",
                amax.scalar_type(), " ", amax.sizes());
  }
  // Rows padded to whole groups only when K is not a multiple of 4: weights quantised at load
  // are [N, K] exactly, and a copy of a 64 MB weight would cost as much as quantising it.
  const int64_t groups = (k + kGroup - 1) / kGroup;
  auto [q, s] = rows_padded("quantize_rows", x, groups, 1, amax.defined() ? amax.data_ptr<float>() : nullptr);
  if (groups * kGroup == k) return {q, s};
  return {q.narrow(1, 0, k).contiguous(), s};
}

torch::Tensor w8a8_gemm_s32(const torch::Tensor& qx, const torch::Tensor& packed, int64_t n,
                            bool allow_amx) {
  TORCH_CHECK(qx.device().is_cpu() && qx.dim() == 2 && qx.scalar_type() == at::kChar,
              "w8a8_gemm_s32: qx must be a CPU int8 [M, K]");
  const int64_t m = qx.size(0), k = qx.size(1);
  check_packed("w8a8_gemm_s32", packed, k, n);
  const int64_t ldx = packed.size(1) * kGroup;
  torch::Tensor xp = torch::zeros({m, ldx}, qx.options());
  xp.narrow(1, 0, k).copy_(qx);
  torch::Tensor y = torch::empty({m, n}, qx.options().dtype(at::kInt));
  int32_t* yp = y.data_ptr<int32_t>();
  for_each_panel(xp.data_ptr<int8_t>(), m, ldx, packed.data_ptr<int8_t>(), packed.size(1), n,
                 allow_amx,
                 [&](const int32_t* acc, int64_t r0, int64_t rows, int64_t n0, int64_t cols) {
                   for (int64_t r = 0; r < rows; ++r)
                     std::memcpy(yp + (r0 + r) * n + n0, acc + r * kCols, cols * sizeof(int32_t));
                 });
  return y;
}

namespace {

// The checks both float-output GEMMs make; returns the bias as float32 (undefined if none).
torch::Tensor checked_bias(const char* name, const torch::Tensor& x, const torch::Tensor& packed,
                           int64_t n, const torch::Tensor& w_scale,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, name, ": x must be a CPU [M, K], got ",
              x.sizes());
  check_packed(name, packed, x.size(1), n);
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() &&
                  w_scale.numel() == n,
              name, ": w_scale must be a contiguous float32 [N]");
  if (!bias.has_value()) return {};
  TORCH_CHECK(bias->numel() == n, name, ": bias must have N=", n, " elements");
  return bias->to(at::kFloat).contiguous();
}

// fn(Out*) for y's dtype (float32, bf16 or fp16: the dtypes x may have).
template <typename Fn>
void with_output(torch::Tensor& y, const Fn& fn) {
  switch (y.scalar_type()) {
    case at::kFloat:
      return fn(y.data_ptr<float>());
    case at::kBFloat16:
      return fn(y.data_ptr<at::BFloat16>());
    default:
      return fn(y.data_ptr<at::Half>());
  }
}

}  // namespace

torch::Tensor w8a8_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                        const torch::Tensor& w_scale,
                        const c10::optional<torch::Tensor>& bias, bool allow_amx) {
  const torch::Tensor b = checked_bias("w8a8_gemm", x, packed, n, w_scale, bias);
  auto [qx, sx] = quantize_padded(x, packed.size(1));
  torch::Tensor y = torch::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  const float* sw = w_scale.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  with_output(y, [&](auto* out) { gemm_out(qx, sx, packed, n, sw, bp, allow_amx, out); });
  return y;
}

std::tuple<torch::Tensor, torch::Tensor> split_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "split_rows: x must be [M, K], got ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1);
  auto [q, s] = split_padded(x, (k + kGroup - 1) / kGroup);
  // Back to (hi rows, then lo rows) in token order: the layout a reference builds.
  std::vector<int64_t> order(static_cast<size_t>(2 * m));
  for (int64_t t = 0; t < m; ++t) {
    const PlaneRows pr = plane_rows(t, m);
    order[t] = pr.hi;
    order[m + t] = pr.lo;
  }
  const torch::Tensor index = torch::tensor(order, torch::kLong);
  return {q.index_select(0, index).narrow(1, 0, k).contiguous(), s.index_select(0, index)};
}

int64_t int8_dp_min_rows() {
#if defined(__AVX512BF16__)
  return kDpMinRows;
#else
  return 0;
#endif
}

torch::Tensor int8_split_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                              const torch::Tensor& w_scale,
                              const c10::optional<torch::Tensor>& bias, bool allow_amx,
                              int64_t dp_min_rows) {
  const torch::Tensor b = checked_bias("int8_split_gemm", x, packed, n, w_scale, bias);
  const int64_t m = x.size(0);
#if defined(__AVX512BF16__)
  // Many bf16 rows: the weights converted once per K-block for vdpbf16ps (gemm_dp.h), unless
  // AMX-INT8 tiles run the planes (faster than either there).
  const int64_t from = dp_min_rows < 0 ? kDpMinRows : dp_min_rows;
  const bool tiles = sums_on_tiles(2 * m, packed.size(1), allow_amx);  // the planes' 2M rows
  if (from > 0 && m >= from && !tiles && x.scalar_type() == at::kBFloat16 && x.size(1) % 2 == 0) {
    return int8_groups_dp_gemm(x, packed, n, w_scale.data_ptr<float>(),
                               b.defined() ? b.data_ptr<float>() : nullptr);
  }
#else
  (void)dp_min_rows;
#endif
  auto [q, s] = split_padded(x, packed.size(1));
  torch::Tensor y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* sw = w_scale.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  with_output(y, [&](auto* out) { split_out(q, s, m, packed, n, sw, bp, allow_amx, out); });
  return y;
}

std::string int8_dot_isa() {
#if defined(__AVX512VNNI__)
  return "avx512vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace pagedllm::gemm
