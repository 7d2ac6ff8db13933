// Group-wise weight GEMM: y[M, N] = x[M, K] @ W^T (+ bias) for 4-bit (q * scale + offset) and
// 8-bit (q * scale) weights in groups of 32 along K, packed once at load (gemm_q4_layout.h).
//
// Paths, chosen per call:
// - float: no rounding of x. float32/fp16 x: weights dequantised in registers (few rows) or
//   once per K-block into a float32 scratch shared by the row tiles (many rows), float32 FMAs.
//   bf16 x in avx512bf16 builds: vdpbf16ps on q, scaled per group (gemm_q4_float.h); batches
//   of 4+ rows on processors with AMX-BF16: a tile product per group (gemm_amx.h), scaled the
//   same way. Only the float32 summation differs from the definition.
// - dot: x rounded to int8 per group of 32, integer dot products (gemm_q4_dot.h): half the
//   instructions of vdpbf16ps per weight or less. The caller chooses (dot=); the CPU backend
//   takes it only where the user sets int8_activations, for bf16/fp16 batches of every size,
//   prefill included, never in an LM head (groupwise_linear.dot_rows).
// Threads take the panels from a TaskQueue (task_queue.h); each panel is streamed front to back,
// once per row tile.
#include "gemm_q4.h"
#include "task_queue.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "dtype_dispatch.h"
#include "gemm_amx.h"
#include "gemm_q4_avx2.h"
#include "gemm_q4_avx2_tiles.h"
#include "gemm_q4_dot.h"
#include "gemm_q4_dot_tiles.h"
#include "gemm_q4_float.h"

namespace pagedllm::gemm::q4 {
namespace {

// The float path dequantises in registers up to this many rows, then into a scratch once per
// K-block of a panel pair (f32: 4 groups x 2 panels = 16 KiB, bf16: 8 groups = 16 KiB + scales).
constexpr int64_t kF32BlockGroups = 4;
#if defined(__AVX512BF16__)
constexpr int64_t kBf16BlockGroups = 8;
#endif

// -- output -----------------------------------------------------------------------------------
template <typename Out>
void store(const float* c, int64_t rows, int64_t n, int64_t n0, const float* bias, Out* y) {
  const int64_t cols = std::min(kCols, n - n0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      float v = c[r * kCols + j];
      if (bias != nullptr) v += bias[n0 + j];
      y[r * n + n0 + j] = static_cast<Out>(v);
    }
}

// Which kernel few rows of bf16 x (decode) take on a 4-bit layer (IQ4 levels on AVX-512: the
// float ones; the dot kernel reads no levels), chosen per call (groupwise_gemm's rows_kernel):
// - kSplit (the default): x as two int8 rows per row (quantize_rows_split: ~16 bits against each
//   group's largest value, finer than x's own bf16 rounding for every element within 2^8 of it)
//   on the integer dot kernel, the two rows' sums added. The products cost ~1/4 of the float
//   kernels' conversions: a Q4_K layer at 1 / 2 / 3 rows 1.5x / 1.6x / 1.6x vdpbf16ps on a Xeon.
// - kDp: vdpbf16ps on q (bf16_rows), kFma: float32 FMAs on q (bf16_rows_fma): exact products,
//   float32 sums, so the definition up to summation order; FMAs are the faster on Intel's cores
//   (gemm_q4_float.h), vdpbf16ps on a Zen 4 EPYC.
// AVX2 builds without AVX-512 (no vdpbf16ps; every layer, 8-bit, Q6_K and IQ4 levels too):
// kSplit rounds x to int16 per group against a power of two (gemm_q4_avx2.h's
// avx2_i16_rows: exact for every bf16 element within 2^7 of its group's largest), kDp and kFma
// both run float32 FMAs on q (avx2_rows: exact products; IQ4 levels: run_f32's).
enum class Bf16RowsKernel { kSplit, kDp, kFma };

Bf16RowsKernel rows_kernel_of(const char* op, const std::string& name) {
  if (name == "split") return Bf16RowsKernel::kSplit;
  if (name == "dp") return Bf16RowsKernel::kDp;
  if (name == "fma") return Bf16RowsKernel::kFma;
  TORCH_CHECK(false, op, ": rows_kernel must be 'split', 'dp' or 'fma', got '", name, "'");
  return Bf16RowsKernel::kSplit;  // not reached
}

struct Problem {
  int64_t m, k, n, groups;
  const uint8_t* w;  // packed panels
  Format f;
  const float* bias;
  Bf16RowsKernel rows = Bf16RowsKernel::kSplit;  // few bf16 rows on a 4-bit layer
  int64_t panel_bytes() const { return f.panel_bytes(groups); }
  int64_t panels() const { return (n + kCols - 1) / kCols; }
};

// -- float32 activations ----------------------------------------------------------------------
template <int Bits, typename Out>
void run_f32(const float* x, const Problem& pb, Out* y) {
  const int64_t m = pb.m, k = pb.k;
  if (m <= kF32Rows) {
    at::parallel_for(0, pb.panels(), 1, [&](int64_t p0, int64_t p1) {
      float c[kF32Rows * kCols];
      for (int64_t p = p0; p < p1; ++p) {
        with_rows<kF32Rows>(static_cast<int>(m), [&](auto r) {
          f32_rows<Bits, decltype(r)::value>(x, k, pb.w + p * pb.panel_bytes(), pb.groups, pb.f, c);
        });
        store(c, m, pb.n, p * kCols, pb.bias, y);
      }
    });
    return;
  }
  const int64_t pairs = (pb.panels() + 1) / 2, kb = kF32BlockGroups * kGroup;
  at::parallel_for(0, pairs, 1, [&](int64_t q0, int64_t q1) {
    std::vector<float> acc(static_cast<size_t>(2 * m * kCols));
    std::vector<float> scratch(static_cast<size_t>(2 * kb * kCols));
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t p = 2 * q, np = std::min<int64_t>(2, pb.panels() - p);
      for (int64_t g0 = 0; g0 < pb.groups; g0 += kF32BlockGroups) {
        const int64_t gc = std::min(kF32BlockGroups, pb.groups - g0), kc = gc * kGroup;
        for (int64_t i = 0; i < np; ++i)
          f32_block(pb.w + (p + i) * pb.panel_bytes(), g0, gc, pb.f,
                    scratch.data() + i * kb * kCols);
        for (int64_t m0 = 0; m0 < m; m0 += kTileRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - m0));
          with_rows<kTileRows>(rows, [&](auto r) {
            constexpr int R = decltype(r)::value;
            const float* xr = x + m0 * k + g0 * kGroup;
            float* c = acc.data() + m0 * kCols;
            if (kTilePanels == 2 && np == 2) {
              f32_tile<R, 2>(xr, k, scratch.data(), kb * kCols, kc, c, m * kCols, g0 > 0);
            } else {
              for (int64_t i = 0; i < np; ++i)
                f32_tile<R, 1>(xr, k, scratch.data() + i * kb * kCols, 0, kc,
                               c + i * m * kCols, 0, g0 > 0);
            }
          });
        }
      }
      for (int64_t i = 0; i < np; ++i)
        store(acc.data() + i * m * kCols, m, pb.n, (p + i) * kCols, pb.bias, y);
    }
  });
}

// Rows of bf16 x from which run_bf16 takes AMX tiles here (0: never: no tiles, or no
// vdpbf16ps build).
int64_t amx_rows() {
#if defined(PAGEDLLM_GEMM_DP)
  return amx::available() ? amx::kMinGroupRows : 0;
#else
  return 0;
#endif
}

#if defined(__AVX512BF16__)
// Rows of x whose split rows fill one dot tile (the split kernel's register rows).
constexpr int64_t kSplitRows = kDotRows / 2;
#endif

// The bf16 rows from which a call on a layer of format f, under `kernel` for its few rows, runs
// on AMX tiles (0: never here). Split rows are twice the rows on the dot kernel: up to
// kSplitRows they fill one dot tile and beat the tiles (a 2048 x 2048 Q4_K layer at 4 rows on a
// Xeon: 134 against 184 us), past it the tiles win (8 rows: 265 against 176 us). dispatch,
// register_rows and the path names (groupwise_amx_rows) all ask here.
int64_t tile_rows(const Format& f, Bf16RowsKernel kernel) {
  const int64_t from = amx_rows();
#if defined(__AVX512BF16__)
  if (from > 0 && f.bits == 4 && !f.levels && kernel == Bf16RowsKernel::kSplit)
    return std::max(from, kSplitRows + 1);
#endif
  (void)f;
  (void)kernel;
  return from;
}

}  // namespace

// The kernels of bf16 rows the build runs for groupwise_gemm's rows_kernel (none: no vdpbf16ps).
std::vector<std::string> bf16_rows_kernels() {
#if defined(__AVX512BF16__)
  return {"split", "dp", "fma"};
#else
  return {};
#endif
}

int64_t int16_rows() {
#if defined(PAGEDLLM_Q4_AVX2_ROWS)
  return kAvx2ChunkedRows;
#else
  return 0;
#endif
}

int64_t int16_tiles_from() {
#if defined(PAGEDLLM_Q4_AVX2_TILES)
  return kAvx2ChunkedRows + 1;
#else
  return 0;
#endif
}

namespace {

#if defined(__AVX512BF16__)
// -- bf16 activations (vdpbf16ps) -------------------------------------------------------------
// xs[r * groups + g]: the float32 sum of row r's group g (the offsets' factor).
std::vector<float> group_sums(const uint16_t* x, int64_t m, int64_t k) {
  const int64_t groups = k / kGroup;
  std::vector<float> xs(static_cast<size_t>(m * groups));
  for (int64_t i = 0; i < m * groups; ++i) {
    const uint16_t* p = x + i * kGroup;  // rows are k = 32 * groups apart
    xs[i] = _mm512_reduce_add_ps(v_add(w_load(Bf16W{}, p), w_load(Bf16W{}, p + 16)).v);
  }
  return xs;
}

// x widened to float32 (exact) for bf16_rows_fma where the call takes it for Bits' layers,
// else empty (bf16_rows reads x itself).
template <int Bits>
std::vector<float> fma_rows_x(const uint16_t* x, int64_t m, int64_t k, Bf16RowsKernel kernel) {
  if (Bits != 4 || kernel != Bf16RowsKernel::kFma) return {};
  std::vector<float> xf(static_cast<size_t>(m * k));
  for (int64_t i = 0; i < m * k; ++i) xf[i] = c10::detail::f32_from_bits(x[i]);
  return xf;
}

// c[R][16] = R rows of x @ one panel on the register kernels: bf16_rows_fma where xf holds the
// widened rows (fma_rows_x), else bf16_rows.
template <int Bits, int R>
void bf16_panel_rows(const uint16_t* x, const float* xf, int64_t ldx, const float* xs,
                     int64_t ldxs, const uint8_t* panel, int64_t groups, const Format& f,
                     float* c) {
  if constexpr (Bits == 4)
    if (xf != nullptr) return bf16_rows_fma<R>(xf, ldx, xs, ldxs, panel, groups, f, c);
  bf16_rows<Bits, R>(x, ldx, xs, ldxs, panel, groups, f, c);
}

// Batches on AMX tiles (gemm_amx.h's panel_groups): per panel, K-blocks converted as below,
// every row tile's group sums from tile products.
template <int Bits>
void run_bf16_tiles(const uint16_t* x, const std::vector<float>& xs, const Problem& pb,
                    at::BFloat16* y) {
  const int64_t m = pb.m, groups = pb.groups;
  constexpr int64_t kb = kBf16BlockGroups;
  const std::vector<uint8_t> xa = amx::pack_bf16_rows(x, m, pb.k);
  const bool halves = pb.f.two_scales(), offsets = pb.f.with_offset;
  const int64_t m_pad = (m + 15) / 16 * 16;  // whole tiles of rows
  std::vector<float> xs_pad(static_cast<size_t>(m_pad * groups), 0.0f);
  std::copy(xs.begin(), xs.end(), xs_pad.begin());
  at::parallel_for(0, pb.panels(), 1, [&](int64_t p0, int64_t p1) {
    amx::begin_group_tiles(halves, m);
    std::vector<float> acc(static_cast<size_t>(m_pad * kCols));
    std::vector<uint16_t> wbuf(static_cast<size_t>(kb * 16 * dp::kPairWords));
    std::vector<float> so(static_cast<size_t>(kb * 2 * kCols));
    for (int64_t p = p0; p < p1; ++p) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t g0 = 0; g0 < groups; g0 += kb) {
        const int64_t gc = std::min(kb, groups - g0);
        bf16_block<Bits>(pb.w + p * pb.panel_bytes(), g0, gc, pb.f, wbuf.data(), so.data());
        amx::panel_groups(xa.data(), m, groups, g0, wbuf.data(), so.data(), gc, offsets, halves,
                          xs_pad.data(), acc.data());
      }
      store(acc.data(), m, pb.n, p * kCols, pb.bias, y);
    }
    amx::end_tiles();
  });
}

template <int Bits>
void run_bf16(const uint16_t* x, const Problem& pb, bool allow_amx, at::BFloat16* y) {
  const int64_t m = pb.m, k = pb.k, groups = pb.groups;
  const std::vector<float> xs = group_sums(x, m, k);
  const int64_t tiles_from = tile_rows(pb.f, pb.rows);
  if (allow_amx && tiles_from > 0 && m >= tiles_from) {
    run_bf16_tiles<Bits>(x, xs, pb, y);
    return;
  }
  if (m <= kBf16Rows) {
    const std::vector<float> xf = fma_rows_x<Bits>(x, m, k, pb.rows);
    const float* xfp = xf.empty() ? nullptr : xf.data();
    at::parallel_for(0, pb.panels(), 1, [&](int64_t p0, int64_t p1) {
      float c[kBf16Rows * kCols];
      for (int64_t p = p0; p < p1; ++p) {
        with_rows<kBf16Rows>(static_cast<int>(m), [&](auto r) {
          bf16_panel_rows<Bits, decltype(r)::value>(x, xfp, k, xs.data(), groups,
                                                    pb.w + p * pb.panel_bytes(), groups, pb.f, c);
        });
        store(c, m, pb.n, p * kCols, pb.bias, y);
      }
    });
    return;
  }
  constexpr int64_t kb = kBf16BlockGroups;
  const int64_t pairs = (pb.panels() + 1) / 2;
  const bool offsets = pb.f.with_offset;
  at::parallel_for(0, pairs, 1, [&](int64_t q0, int64_t q1) {
    std::vector<float> acc(static_cast<size_t>(2 * m * kCols));
    std::vector<uint16_t> wbuf(static_cast<size_t>(2 * kb * 16 * dp::kPairWords));
    std::vector<float> so(static_cast<size_t>(2 * kb * 2 * kCols));
    const int64_t wstride = kb * 16 * dp::kPairWords, sstride = kb * 2 * kCols;
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t p = 2 * q, np = std::min<int64_t>(2, pb.panels() - p);
      // An odd last panel runs as its own pair (the second half's sums are dropped).
      const int64_t second = np == 2 ? 1 : 0;
      for (int64_t g0 = 0; g0 < groups; g0 += kb) {
        const int64_t gc = std::min(kb, groups - g0);
        for (int64_t i = 0; i < np; ++i)
          bf16_block<Bits>(pb.w + (p + i) * pb.panel_bytes(), g0, gc, pb.f,
                           wbuf.data() + i * wstride, so.data() + i * sstride);
        for (int64_t m0 = 0; m0 < m; m0 += kBf16TileRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kBf16TileRows, m - m0));
          with_rows<kBf16TileRows>(rows, [&](auto r) {
            constexpr int R = decltype(r)::value;
            const uint16_t* xr = x + m0 * k + g0 * kGroup;
            const uint16_t* w1 = wbuf.data() + second * wstride;
            const float* so1 = so.data() + second * sstride;
            float* c0 = acc.data() + m0 * kCols;
            float* c1 = acc.data() + (m + m0) * kCols;
            if (pb.f.two_scales())
              bf16_tile_halves<R>(xr, k, wbuf.data(), w1, so.data(), so1, gc, c0, c1, g0 > 0);
            else
              bf16_tile<R>(xr, k, xs.data() + m0 * groups + g0, groups, wbuf.data(), w1,
                           so.data(), so1, gc, offsets, c0, c1, g0 > 0);
          });
        }
      }
      for (int64_t i = 0; i < np; ++i)
        store(acc.data() + i * m * kCols, m, pb.n, (p + i) * kCols, pb.bias, y);
    }
  });
}
#endif

// -- the integer dot path ---------------------------------------------------------------------
struct QuantizedRows {
  std::vector<int8_t> q;  // [M][K]
  std::vector<float> dx, xsum;  // [M][groups]: scale, scale * sum(xq)
  std::vector<int32_t> qsum;    // [M][groups]: sum(xq)
};

template <typename In>
QuantizedRows quantize_rows(const In* x, int64_t m, int64_t k) {
  const int64_t groups = k / kGroup;
  QuantizedRows out{std::vector<int8_t>(static_cast<size_t>(m * k)),
                    std::vector<float>(static_cast<size_t>(m * groups)),
                    std::vector<float>(static_cast<size_t>(m * groups)),
                    std::vector<int32_t>(static_cast<size_t>(m * groups))};
  at::parallel_for(0, m * groups, 64, [&](int64_t i0, int64_t i1) {
    float buf[kGroup];
    for (int64_t i = i0; i < i1; ++i) {
      const float* src;
      if constexpr (std::is_same_v<In, float>) {
        src = x + i * kGroup;
      } else {
        for (int64_t j = 0; j < kGroup; ++j) buf[j] = static_cast<float>(x[i * kGroup + j]);
        src = buf;
      }
      const int32_t sum = quantize_group(src, out.q.data() + i * kGroup, &out.dx[i]);
      out.qsum[i] = sum;
      out.xsum[i] = out.dx[i] * static_cast<float>(sum);
    }
  });
  return out;
}

// Each row of x as two int8 rows, for the split kernel of few bf16 rows: row 2i rounds x as
// quantize_rows does, row 2i + 1 rounds the rest r = x - dx * xq (one rounding: an FMA) the same
// way, so x = dx xq + dx' xq' + e with |e| <= dx' / 2 <= max|x| / 64,516 per group: ~16 bits
// against max|x| where int8 keeps 7, below the bf16 rounding of x itself for every element
// within 2^8 of its group's largest. Its definition: groupwise_linear.split_activation_groups.
template <typename In>
QuantizedRows quantize_rows_split(const In* x, int64_t m, int64_t k) {
  const int64_t groups = k / kGroup;
  const auto size = static_cast<size_t>(2 * m * groups);
  QuantizedRows out{std::vector<int8_t>(static_cast<size_t>(2 * m * k)), std::vector<float>(size),
                    std::vector<float>(size), std::vector<int32_t>(size)};
  at::parallel_for(0, m * groups, 64, [&](int64_t i0, int64_t i1) {
    float src[kGroup], rest[kGroup];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = i / groups, g = i % groups;
      for (int64_t j = 0; j < kGroup; ++j) src[j] = static_cast<float>(x[i * kGroup + j]);
      const int64_t at[2] = {2 * row * groups + g, (2 * row + 1) * groups + g};
      int8_t* q[2] = {out.q.data() + 2 * row * k + g * kGroup,
                      out.q.data() + (2 * row + 1) * k + g * kGroup};
      for (int part = 0; part < 2; ++part) {
        const float* in = part == 0 ? src : rest;
        const int32_t sum = quantize_group(in, q[part], &out.dx[at[part]]);
        out.qsum[at[part]] = sum;
        out.xsum[at[part]] = out.dx[at[part]] * static_cast<float>(sum);
        if (part == 0)
          for (int64_t j = 0; j < kGroup; ++j)
            rest[j] = std::fma(-out.dx[at[0]], static_cast<float>(q[0][j]), src[j]);
      }
    }
  });
  return out;
}

// Each group sum's integer correction (dot_rows): -8 sum(xq) (4-bit), 128 sum(xq) (8-bit);
// two-scale layers (Q6_K) sum each half group apart: 128 sum(xq) per 16 k, [M][groups][2].
std::vector<int32_t> dot_corrections(const QuantizedRows& qx, int bits, bool two) {
  if (!two) {
    std::vector<int32_t> corr(qx.qsum.size());
    for (size_t i = 0; i < corr.size(); ++i) corr[i] = (bits == 4 ? -8 : 128) * qx.qsum[i];
    return corr;
  }
  std::vector<int32_t> corr(2 * qx.qsum.size());
  for (size_t h = 0; h < corr.size(); ++h) {
    int32_t sum = 0;
    for (int64_t j = 0; j < kGroup / 2; ++j) sum += qx.q[h * (kGroup / 2) + j];
    corr[h] = 128 * sum;
  }
  return corr;
}

#if defined(PAGEDLLM_Q4_AVX2_TILES)
// The register tiles' schedule on AVX2, shared by the int16 tiles of bf16 x and the dot tiles of
// int8 x: the rows split into tiles of at most Rows as evenly as they go (8 rows: 4 + 4, not
// 6 + 2), in passes over the panels of as many whole tiles as keep x in L2 (chunk_bytes of
// x_row_bytes a row), at least chunk_tiles of them, since each pass prepares every panel's q
// again; a pass over a panel is a task the threads take from a TaskQueue. Per panel and K-block
// of block_groups groups, widen(scratch, panel, g0, gc) prepares the block once in the thread's
// Scratch, then tile(scratch, rows, m0, g0, gc, c, accumulate) runs each tile of the pass (rows:
// with_rows' constant) into its totals c.
template <int Rows, typename Scratch, typename Out, typename Widen, typename Tile>
void run_row_tiles(const Problem& pb, int64_t x_row_bytes, int64_t chunk_bytes,
                   int64_t chunk_tiles, int64_t block_groups, Out* y, const Widen& widen,
                   const Tile& tile) {
  const int64_t m = pb.m, groups = pb.groups;
  const int64_t tiles = (m + Rows - 1) / Rows;
  const int64_t per = (m + tiles - 1) / tiles;  // rows per tile, the last one fewer
  const int64_t chunk = std::max(chunk_bytes / x_row_bytes / per, chunk_tiles) * per;
  const int64_t panels = pb.panels(), passes = (m + chunk - 1) / chunk;
  on_demand(passes * panels, [&](TaskQueue& queue) {  // a task: one pass over one panel
    std::vector<float> acc(static_cast<size_t>(std::min(chunk, m) * kCols));
    Scratch scratch;
    for (int64_t t0, t1; queue.next(t0, t1);) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t c0 = t / panels * chunk, c1 = std::min(m, c0 + chunk), p = t % panels;
        const uint8_t* panel = pb.w + p * pb.panel_bytes();
        for (int64_t g0 = 0; g0 < groups; g0 += block_groups) {
          const int64_t gc = std::min(block_groups, groups - g0);
          widen(scratch, panel, g0, gc);
          for (int64_t m0 = c0; m0 < c1; m0 += per) {
            const int rows = static_cast<int>(std::min(per, c1 - m0));
            with_rows<Rows>(rows, [&](auto r) {
              tile(scratch, r, m0, g0, gc, acc.data() + (m0 - c0) * kCols, g0 > 0);
            });
          }
        }
        store(acc.data(), c1 - c0, pb.n, p * kCols, pb.bias, y + c0 * pb.n);
      }
    }
  });
}
#endif

#if defined(PAGEDLLM_Q4_DOT_TILES)
// A thread's scratch of split q and their scales for one K-block (i8_block).
struct I8Scratch {
  std::vector<__m256i> w = std::vector<__m256i>(kI8BlockGroups * kI8GroupVecs);
  std::vector<float> so = std::vector<float>(kI8BlockGroups * 2 * kCols);
};

// More than kDotRows rows of int8 x on a 4-bit layer (gemm_q4_dot_tiles.h): per panel K-blocks
// of split q shared by the row tiles (run_row_tiles). Every row's result is dot_rows' for it.
template <typename Out>
void run_dot_tiles(const QuantizedRows& qx, const std::vector<int32_t>& corr, const Problem& pb,
                   Out* y) {
  const int64_t k = pb.k, groups = pb.groups;
  const bool centred = !pb.f.with_offset;
  const auto split = [&](I8Scratch& s, const uint8_t* panel, int64_t g0, int64_t gc) {
    with_layout<4, false>(pb.f, [&](auto layout) {
      i8_block<decltype(layout)>(panel, g0, gc, pb.f, s.w.data(), s.so.data());
    });
  };
  const auto tile = [&](const I8Scratch& s, auto r, int64_t m0, int64_t g0, int64_t gc,
                        float* c, bool accumulate) {
    const int64_t at = m0 * groups + g0;
    i8_tile<decltype(r)::value>(qx.q.data() + m0 * k + g0 * kGroup, k, qx.dx.data() + at,
                                qx.xsum.data() + at, corr.data() + at, groups, s.w.data(),
                                s.so.data(), gc, pb.f.with_offset, centred, c, accumulate);
  };
  run_row_tiles<kI8TileRows, I8Scratch>(pb, k, kI8ChunkBytes, kI8ChunkTiles, kI8BlockGroups, y,
                                        split, tile);
}
#endif

template <int Bits, typename Out>
void run_dot(const QuantizedRows& qx, const Problem& pb, Out* y) {
  const int64_t m = pb.m, k = pb.k, groups = pb.groups;
  const std::vector<int32_t> corr = dot_corrections(qx, Bits, pb.f.two_scales());
#if defined(PAGEDLLM_Q4_DOT_TILES)
  if (Bits == 4 && m > kDotRows) return run_dot_tiles(qx, corr, pb, y);
#endif
  const int64_t corr_row = pb.f.two_scales() ? 2 : 1;  // corrections per group
  on_demand(pb.panels(), [&](TaskQueue& queue) {
    float c[kDotRows * kCols];
    for (int64_t p0, p1; queue.next(p0, p1);) {
      for (int64_t p = p0; p < p1; ++p) {
        for (int64_t m0 = 0; m0 < m; m0 += kDotRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kDotRows, m - m0));
          const int64_t a = m0 * groups;
          with_rows<kDotRows>(rows, [&](auto r) {
            dot_rows<Bits, decltype(r)::value>(qx.q.data() + m0 * k, k, qx.dx.data() + a,
                                               qx.xsum.data() + a, corr.data() + a * corr_row,
                                               groups, pb.w + p * pb.panel_bytes(), groups,
                                               pb.f, c);
          });
          store(c, rows, pb.n, p * kCols, pb.bias, y + m0 * pb.n);
        }
      }
    }
  });
}

#if defined(__AVX512BF16__)
// c[rows][16] = rows (<= kBf16Rows) of x from row lo @ one panel, from their split rows in qx
// (quantize_rows_split): the dot kernel on both int8 rows of each, their sums added.
template <int Bits>
void split_rows(const QuantizedRows& qx, const int32_t* corr, int64_t lo, int64_t rows,
                int64_t k, int64_t groups, const uint8_t* panel, const Format& f, float* c) {
  static_assert(kDotRows % 2 == 0, "a dot tile holds whole pairs of split rows");
  float pairs[2 * kBf16Rows * kCols];
  for (int64_t m0 = 0; m0 < 2 * rows; m0 += kDotRows) {
    const int n = static_cast<int>(std::min<int64_t>(kDotRows, 2 * rows - m0));
    const int64_t a = (2 * lo + m0) * groups;
    with_rows<kDotRows>(n, [&](auto r) {
      dot_rows<Bits, decltype(r)::value>(qx.q.data() + (2 * lo + m0) * k, k, qx.dx.data() + a,
                                         qx.xsum.data() + a, corr + a, groups, panel, groups, f,
                                         pairs + m0 * kCols);
    });
  }
  for (int64_t r = 0; r < rows; ++r)
    _mm512_storeu_ps(c + r * kCols, _mm512_add_ps(_mm512_loadu_ps(pairs + 2 * r * kCols),
                                                  _mm512_loadu_ps(pairs + (2 * r + 1) * kCols)));
}

// Few bf16 rows on a 4-bit layer, split kernel: every panel's rows at once (split_rows).
template <int Bits>
void run_split(const c10::BFloat16* x, const Problem& pb, at::BFloat16* y) {
  const QuantizedRows qx = quantize_rows_split(x, pb.m, pb.k);
  const std::vector<int32_t> corr = dot_corrections(qx, Bits, false);
  at::parallel_for(0, pb.panels(), 1, [&](int64_t p0, int64_t p1) {
    float c[kBf16Rows * kCols];
    for (int64_t p = p0; p < p1; ++p) {
      split_rows<Bits>(qx, corr.data(), 0, pb.m, pb.k, pb.groups, pb.w + p * pb.panel_bytes(),
                       pb.f, c);
      store(c, pb.m, pb.n, p * kCols, pb.bias, y);
    }
  });
}
#endif

#if defined(PAGEDLLM_Q4_AVX2_ROWS)
// Few rows of bf16 / fp16 x on AVX2 (gemm_q4_avx2.h), prepared once per call, then every panel
// on the threads, in chunks of kAvx2Rows rows (bf16: up to kAvx2ChunkedRows in all). bf16 x
// under the default rows kernel (kSplit: as on AVX-512, x finely rounded to integers) is
// rounded to int16 per group of 32 against a power of two and meets q in vpmaddwd
// (avx2_i16_rows); fp16 x, kDp / kFma, and calls whose x holds an inf or a NaN take float32
// FMAs on q (avx2_rows), whose products are exact.
static_assert(kAvx2Rows == kF32Rows, "register_rows bounds the grouped calls' groups by kF32Rows");

struct Avx2Rows {
  bool i16 = false;             // which kernel: the int16 one, or the float one
  std::vector<float> xn, gsum;  // float: [m, k] and [m, groups]; int16: xn holds s [m, groups]
  std::vector<int32_t> xw;      // int16: [m, groups * kI16Words]
};

// fn(r) for every row r < m: on the threads past kAvx2Rows rows (a chunked call's rows are
// rounded independently, and on one thread they delayed every panel), else on this one.
template <typename Fn>
void rows_on_threads(int64_t m, const Fn& fn) {
  if (m <= kAvx2Rows) {
    for (int64_t r = 0; r < m; ++r) fn(r);
    return;
  }
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) fn(r);
  });
}

template <typename X>
Avx2Rows avx2_x(const X* x, int64_t m, int64_t k, int bits, Bf16RowsKernel kernel) {
  const int64_t groups = k / kGroup;
  Avx2Rows a;
  a.gsum.resize(static_cast<size_t>(m * groups));
  if constexpr (std::is_same_v<X, c10::BFloat16>) {
    if (kernel == Bf16RowsKernel::kSplit) {
      const auto* bits16 = reinterpret_cast<const uint16_t*>(x);
      a.xn.resize(static_cast<size_t>(m * groups));
      a.xw.resize(static_cast<size_t>(m * groups * kI16Words));
      std::atomic<bool> finite{true};
      rows_on_threads(m, [&](int64_t r) {
        if (finite.load(std::memory_order_relaxed) &&
            !avx2_i16_x_rows(bits16 + r * k, k, bits, a.xw.data() + r * groups * kI16Words,
                             a.xn.data() + r * groups, a.gsum.data() + r * groups))
          finite.store(false, std::memory_order_relaxed);
      });
      a.i16 = finite.load();
      if (a.i16) return a;
      a.xw.clear();
    }
  }
  a.xn.assign(static_cast<size_t>(m * k), 0.f);
  rows_on_threads(m, [&](int64_t r) {
    avx2_x_rows(x + r * k, k, bits, a.xn.data() + r * k, a.gsum.data() + r * groups);
  });
  return a;
}

// c[rows][16] = rows lo.. of the prepared x @ one panel.
template <int Bits>
void avx2_panel(const Avx2Rows& a, int64_t lo, int64_t rows, int64_t k, const uint8_t* panel,
                const Format& f, float* c) {
  const int64_t groups = k / kGroup;
  const auto run = [&](auto r, auto halves, auto bits) {
    constexpr int R = decltype(r)::value;
    constexpr bool H = decltype(halves)::value;
    constexpr int B = decltype(bits)::value;
    if (a.i16) {
      with_layout<B, H>(f, [&](auto layout) {
        avx2_i16_rows<B, R, H, decltype(layout)>(
            a.xw.data() + lo * groups * kI16Words, groups * kI16Words, a.xn.data() + lo * groups,
            a.gsum.data() + lo * groups, groups, panel, groups, f, c);
      });
    } else {
      avx2_rows<B, R, H>(a.xn.data() + lo * k, k, a.gsum.data() + lo * groups, groups, panel,
                         groups, f, c);
    }
  };
  using Same = std::integral_constant<int, Bits>;
  with_rows<kAvx2Rows>(static_cast<int>(rows), [&](auto r) {
    if constexpr (Bits == 8) {
      if (f.six()) return run(r, std::true_type{}, std::integral_constant<int, 6>{});
      if (f.two_scales()) return run(r, std::true_type{}, Same{});
    }
    run(r, std::false_type{}, Same{});
  });
}

// Whether a call of x's type under `kernel` on a layer of format f has a kernel here: the int16
// one (bf16 x, kSplit) reads every format, the float one (avx2_rows) all but IQ4 levels.
template <typename X>
bool avx2_runs(const Format& f, Bf16RowsKernel kernel) {
  return avx2_rows_format(f) ||
         (std::is_same_v<X, c10::BFloat16> && kernel == Bf16RowsKernel::kSplit);
}

// False, having written nothing, where the rows need the float kernel and it does not read f
// (IQ4 levels whose x holds an inf or a NaN): the caller runs run_f32.
template <int Bits, typename X>
bool run_avx2_rows(const X* x, const Problem& pb, X* y) {
  if (!avx2_runs<X>(pb.f, pb.rows)) return false;
  const Avx2Rows a = avx2_x(x, pb.m, pb.k, kernel_bits<Bits>(pb.f), pb.rows);
  if (!a.i16 && !avx2_rows_format(pb.f)) return false;
  on_demand(pb.panels(), [&](TaskQueue& queue) {
    float c[kAvx2Rows * kCols];
    for (int64_t p0, p1; queue.next(p0, p1);) {
      for (int64_t p = p0; p < p1; ++p) {
        for (int64_t lo = 0; lo < pb.m; lo += kAvx2Rows) {
          const int64_t rows = std::min(kAvx2Rows, pb.m - lo);
          avx2_panel<Bits>(a, lo, rows, pb.k, pb.w + p * pb.panel_bytes(), pb.f, c);
          store(c, rows, pb.n, p * kCols, pb.bias, y + lo * pb.n);
        }
      }
    }
  });
  return true;
}

// The same for a grouped call's groups (each at most kAvx2Rows rows), every panel a task.
template <int Bits, typename X>
bool run_avx2_grouped(const X* x, int64_t rows, const std::vector<int64_t>& lo,
                      const std::vector<int64_t>& count, const Problem& shape,
                      const std::function<const uint8_t*(int64_t)>& panel_of, X* y) {
  if (!avx2_runs<X>(shape.f, shape.rows)) return false;
  const Avx2Rows a = avx2_x(x, rows, shape.k, kernel_bits<Bits>(shape.f), shape.rows);
  if (!a.i16 && !avx2_rows_format(shape.f)) return false;
  const int64_t panels = shape.panels();
  on_demand(static_cast<int64_t>(lo.size()) * panels, [&](TaskQueue& queue) {
    float c[kAvx2Rows * kCols];
    for (int64_t t0, t1; queue.next(t0, t1);) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t i = t / panels;
        avx2_panel<Bits>(a, lo[i], count[i], shape.k, panel_of(t), shape.f, c);
        store(c, count[i], shape.n, (t % panels) * kCols, nullptr, y + lo[i] * shape.n);
      }
    }
  });
  return true;
}
#endif

#if defined(PAGEDLLM_Q4_AVX2_TILES)
// A thread's scratch of widened q and their scales for one K-block (i16_block).
struct I16Scratch {
  std::vector<int32_t> w = std::vector<int32_t>(kI16BlockGroups * kI16GroupInts);
  std::vector<float> so = std::vector<float>(kI16BlockGroups * 2 * kCols);
};

// More than kAvx2ChunkedRows rows of bf16 x under the default rows kernel on AVX2
// (gemm_q4_avx2_tiles.h): every row rounded to int16 as run_avx2_rows rounds it, then per
// panel K-blocks of widened q shared by the row tiles (i16_block, i16_tile), the rows split
// into tiles of at most kI16TileRows as evenly as they go (8 rows: 4 + 4, not 6 + 2). Returns
// false, having written nothing, where a row holds an inf or a NaN: the caller runs the float
// path, which carries them as the definition does.
template <int Bits>
bool run_avx2_tiles(const c10::BFloat16* x, const Problem& pb, at::BFloat16* y) {
  const int64_t m = pb.m, k = pb.k, groups = pb.groups, words = groups * kI16Words;
  std::vector<int32_t> xw(static_cast<size_t>(m * words));
  std::vector<float> xs(static_cast<size_t>(m * groups)), gsum(xs.size());
  const auto* bits16 = reinterpret_cast<const uint16_t*>(x);
  std::atomic<bool> finite{true};
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1 && finite.load(std::memory_order_relaxed); ++r)
      if (!avx2_i16_x_rows(bits16 + r * k, k, kernel_bits<Bits>(pb.f), xw.data() + r * words,
                           xs.data() + r * groups, gsum.data() + r * groups))
        finite.store(false, std::memory_order_relaxed);
  });
  if (!finite.load()) return false;
  const bool two = pb.f.two_scales(), offsets = !two && (Bits == 4 || pb.f.with_offset);
  const auto widen = [&](I16Scratch& s, const uint8_t* panel, int64_t g0, int64_t gc) {
    const auto widen_as = [&](auto bits, auto two_scales) {
      with_layout<decltype(bits)::value, decltype(two_scales)::value>(pb.f, [&](auto layout) {
        i16_block<decltype(bits)::value, decltype(layout)>(panel, g0, gc, pb.f, s.w.data(),
                                                           s.so.data());
      });
    };
    using Same = std::integral_constant<int, Bits>;
    if (pb.f.six()) {  // (8-bit layers only)
      if constexpr (Bits == 8) widen_as(std::integral_constant<int, 6>{}, std::true_type{});
    } else if (two)
      widen_as(Same{}, std::true_type{});
    else
      widen_as(Same{}, std::false_type{});
  };
  const auto tile = [&](const I16Scratch& s, auto r, int64_t m0, int64_t g0, int64_t gc,
                        float* c, bool accumulate) {
    constexpr int R = decltype(r)::value;
    const int32_t* xr = xw.data() + m0 * words + g0 * kI16Words;
    const int64_t at = m0 * groups + g0;
    if (two)
      i16_tile<R, true>(xr, words, xs.data() + at, gsum.data() + at, groups, s.w.data(),
                        s.so.data(), gc, false, c, accumulate);
    else
      i16_tile<R, false>(xr, words, xs.data() + at, gsum.data() + at, groups, s.w.data(),
                         s.so.data(), gc, offsets, c, accumulate);
  };
  const int64_t x_row_bytes = words * static_cast<int64_t>(sizeof(int32_t));
  run_row_tiles<kI16TileRows, I16Scratch>(pb, x_row_bytes, kI16ChunkBytes, kI16ChunkTiles,
                                          kI16BlockGroups, y, widen, tile);
  return true;
}
#endif

template <int Bits>
void dispatch(const torch::Tensor& x, const Problem& pb, bool dot, bool allow_amx,
              torch::Tensor& y) {
  if (dot) {
    with_float_elements(x, "groupwise", [&](const auto* xp) {
      const QuantizedRows qx = quantize_rows(xp, pb.m, pb.k);
      with_float_elements(y, "groupwise", [&](auto* yp) { run_dot<Bits>(qx, pb, yp); });
    });
    return;
  }
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    // The split kernel up to the rows from which tiles run (tile_rows), or its whole tile.
    const int64_t tiles_from = allow_amx ? tile_rows(pb.f, pb.rows) : 0;
    if (Bits == 4 && !pb.f.levels && pb.m <= (tiles_from > 0 ? tiles_from - 1 : kBf16Rows) &&
        pb.rows == Bf16RowsKernel::kSplit) {
      return run_split<Bits>(x.data_ptr<c10::BFloat16>(), pb, y.data_ptr<at::BFloat16>());
    }
    return run_bf16<Bits>(reinterpret_cast<const uint16_t*>(x.data_ptr()), pb, allow_amx,
                          y.data_ptr<at::BFloat16>());
  }
#endif
#if defined(PAGEDLLM_Q4_AVX2_TILES)
  if (pb.m > kAvx2ChunkedRows && x.scalar_type() == at::kBFloat16 &&
      pb.rows == Bf16RowsKernel::kSplit &&
      run_avx2_tiles<Bits>(x.data_ptr<c10::BFloat16>(), pb, y.data_ptr<at::BFloat16>()))
    return;
#endif
#if defined(PAGEDLLM_Q4_AVX2_ROWS)
  // bf16 rows in chunks up to kAvx2ChunkedRows (measured on the int16 kernel); fp16 rows up to
  // kAvx2Rows: the float kernel's chunks of four did not beat run_f32's tiles past them (1B
  // Q4_0 gate/up at 16 rows 0.6-0.8x, Q8_0 1.1-1.9x: mixed, so not taken).
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  if (pb.m <= (bf16 ? kAvx2ChunkedRows : kAvx2Rows)) {
    if (bf16 &&
        run_avx2_rows<Bits>(x.data_ptr<at::BFloat16>(), pb, y.data_ptr<at::BFloat16>()))
      return;
    if (x.scalar_type() == at::kHalf &&
        run_avx2_rows<Bits>(x.data_ptr<at::Half>(), pb, y.data_ptr<at::Half>()))
      return;
  }
#endif
  const torch::Tensor xf = x.to(at::kFloat).contiguous();
  with_float_elements(y, "groupwise",
                      [&](auto* yp) { run_f32<Bits>(xf.data_ptr<float>(), pb, yp); });
}

// packed: the panels of an [n, k] layer in format f (what pack_groupwise made), or an error
// that starts with `op`.
void check_panels(const char* op, const torch::Tensor& packed, int64_t n, int64_t k,
                  const Format& f) {
  const int64_t groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0 && (!f.factored || groups % Format::kSuper == 0), op, ": K=", k,
              " is not a multiple of ", f.factored ? 256 : 32);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte &&
                  packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(1) == f.panel_bytes(groups),
              op, ": packed must be a contiguous uint8 [N/16, ", f.panel_bytes(groups),
              "] for K=", k, " in this format, got ", packed.scalar_type(), " ", packed.sizes());
  const int64_t panels = packed.size(0);
  TORCH_CHECK(n > (panels - 1) * kCols && n <= panels * kCols, op, ": N=", n, " does not fit ",
              panels, " panels of 16");
}

}  // namespace

// Declared in gemm_q4.h: the decode stack (decode_stack.cpp) calls them too.
torch::Tensor groupwise_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                             int64_t bits, bool half_scales, bool with_offset, bool factored,
                             const c10::optional<torch::Tensor>& bias, bool dot, bool levels,
                             bool allow_amx, const std::string& rows_kernel) {
  torch::Tensor y = torch::empty({x.dim() == 2 ? x.size(0) : 0, n}, x.options());
  groupwise_gemm_into(x, packed, n, bits, half_scales, with_offset, factored, bias, dot, levels,
                      allow_amx, rows_kernel, y);
  return y;
}

void groupwise_gemm_into(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                         int64_t bits, bool half_scales, bool with_offset, bool factored,
                         const c10::optional<torch::Tensor>& bias, bool dot, bool levels,
                         bool allow_amx, const std::string& rows_kernel, torch::Tensor& y) {
  const Format f = format_of(bits, half_scales, with_offset, factored, levels);
  const Bf16RowsKernel kernel = rows_kernel_of("groupwise_gemm", rows_kernel);
  TORCH_CHECK(!(dot && f.six()), "groupwise_gemm: six-bit weights never take the dot path");
  TORCH_CHECK(!(dot && f.levels), "groupwise_gemm: IQ4 levels never take the dot path");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "groupwise_gemm: x must be a CPU [M, K], got ",
              x.sizes());
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup;
  check_panels("groupwise_gemm", packed, n, k, f);
  torch::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "groupwise_gemm: bias must have N=", n, " elements");
    b = bias->to(at::kFloat).contiguous();
  }
  const torch::Tensor xc = x.contiguous();
  TORCH_CHECK(y.dim() == 2 && y.size(0) == m && y.size(1) == n && y.is_contiguous() &&
                  y.scalar_type() == xc.scalar_type() && y.device().is_cpu(),
              "groupwise_gemm: out must be a contiguous [", m, ", ", n, "] tensor of x's dtype");
  with_float_elements(xc, "groupwise", [](const auto*) {});  // rejects other dtypes
  if (m == 0) return;
  const Problem pb{m, k, n, groups, packed.data_ptr<uint8_t>(), f,
                   b.defined() ? b.data_ptr<float>() : nullptr, kernel};
  if (bits == 4)
    dispatch<4>(xc, pb, dot, allow_amx, y);
  else  // 8, and six (Q6_K at 6 bits): the 8-bit kernels, which read a six block by f.six()
    dispatch<8>(xc, pb, dot, allow_amx, y);
}

namespace {

// -- grouped: rows of x by group, each group its own layer (an MoE layer's experts) ----------
// Whether dispatch runs m rows of x's dtype on the register kernels (the float path's few-row
// tiles, the split kernel; the dot path at every batch) for a layer of format f under `kernel`:
// those groups can share one parallel region.
bool register_rows(int64_t m, at::ScalarType dtype, bool dot, const Format& f,
                   Bf16RowsKernel kernel) {
  if (dot) return true;
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) {
    const int64_t tiles_from = tile_rows(f, kernel);
    return m <= kBf16Rows && !(tiles_from > 0 && m >= tiles_from);
  }
#endif
  (void)dtype;
  (void)f;
  (void)kernel;
  return m <= kF32Rows;
}

// The groups of one region: rows lo[i].. (rows[i] of them) times the panels at w[i].
struct RowGroups {
  std::vector<int64_t> lo, rows;
  std::vector<const uint8_t*> w;
  int64_t size() const { return static_cast<int64_t>(w.size()); }
};

// Every group's every panel as one task list over the threads, each task the kernels dispatch
// would run on that panel for that group's rows (the same arithmetic, bit for bit).
template <int Bits>
void run_grouped(const torch::Tensor& x, const RowGroups& rg, const Problem& shape, bool dot,
                 torch::Tensor& y) {
  const int64_t k = shape.k, n = shape.n, groups = shape.groups, panels = shape.panels();
  const int64_t tasks = rg.size() * panels, bytes = shape.panel_bytes();
  const Format& f = shape.f;
  const auto panel_of = [&](int64_t t) { return rg.w[t / panels] + (t % panels) * bytes; };
  if (dot) {
    with_float_elements(x, "groupwise", [&](const auto* xp) {
      const QuantizedRows qx = quantize_rows(xp, x.size(0), k);
      const std::vector<int32_t> corr = dot_corrections(qx, Bits, f.two_scales());
      const int64_t corr_row = f.two_scales() ? 2 : 1;
      with_float_elements(y, "groupwise", [&](auto* yp) {
        at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
          float c[kDotRows * kCols];
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t i = t / panels, p = t % panels;
            for (int64_t m0 = rg.lo[i]; m0 < rg.lo[i] + rg.rows[i]; m0 += kDotRows) {
              const int rows = static_cast<int>(std::min<int64_t>(kDotRows, rg.lo[i] + rg.rows[i] - m0));
              const int64_t a = m0 * groups;
              with_rows<kDotRows>(rows, [&](auto r) {
                dot_rows<Bits, decltype(r)::value>(qx.q.data() + m0 * k, k, qx.dx.data() + a,
                                                   qx.xsum.data() + a,
                                                   corr.data() + a * corr_row, groups,
                                                   panel_of(t), groups, f, c);
              });
              store(c, rows, n, p * kCols, nullptr, yp + m0 * n);
            }
          }
        });
      });
    });
    return;
  }
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    auto* yp = y.data_ptr<at::BFloat16>();
    if (Bits == 4 && !f.levels && shape.rows == Bf16RowsKernel::kSplit) {
      const QuantizedRows qx = quantize_rows_split(x.data_ptr<c10::BFloat16>(), x.size(0), k);
      const std::vector<int32_t> corr = dot_corrections(qx, Bits, false);
      at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
        float c[kBf16Rows * kCols];
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t i = t / panels, lo = rg.lo[i];
          split_rows<Bits>(qx, corr.data(), lo, rg.rows[i], k, groups, panel_of(t), f, c);
          store(c, rg.rows[i], n, (t % panels) * kCols, nullptr, yp + lo * n);
        }
      });
      return;
    }
    const std::vector<float> xs = group_sums(xp, x.size(0), k);
    const std::vector<float> xf = fma_rows_x<Bits>(xp, x.size(0), k, shape.rows);
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      float c[kBf16Rows * kCols];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t i = t / panels, lo = rg.lo[i];
        with_rows<kBf16Rows>(static_cast<int>(rg.rows[i]), [&](auto r) {
          bf16_panel_rows<Bits, decltype(r)::value>(
              xp + lo * k, xf.empty() ? nullptr : xf.data() + lo * k, k, xs.data() + lo * groups,
              groups, panel_of(t), groups, f, c);
        });
        store(c, rg.rows[i], n, (t % panels) * kCols, nullptr, yp + lo * n);
      }
    });
    return;
  }
#endif
#if defined(PAGEDLLM_Q4_AVX2_ROWS)
  // register_rows: every group within kAvx2Rows
  if (x.scalar_type() == at::kBFloat16 &&
      run_avx2_grouped<Bits>(x.data_ptr<at::BFloat16>(), x.size(0), rg.lo, rg.rows, shape,
                             panel_of, y.data_ptr<at::BFloat16>()))
    return;
  if (x.scalar_type() == at::kHalf &&
      run_avx2_grouped<Bits>(x.data_ptr<at::Half>(), x.size(0), rg.lo, rg.rows, shape, panel_of,
                             y.data_ptr<at::Half>()))
    return;
#endif
  const torch::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  with_float_elements(y, "groupwise", [&](auto* yp) {
    at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
      float c[kF32Rows * kCols];
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t i = t / panels, lo = rg.lo[i];
        with_rows<kF32Rows>(static_cast<int>(rg.rows[i]), [&](auto r) {
          f32_rows<Bits, decltype(r)::value>(xp + lo * k, k, panel_of(t), groups, f, c);
        });
        store(c, rg.rows[i], n, (t % panels) * kCols, nullptr, yp + lo * n);
      }
    });
  });
}

}  // namespace

torch::Tensor groupwise_gemm_grouped(const torch::Tensor& x, const std::vector<torch::Tensor>& packed,
                                     const std::vector<int64_t>& starts, int64_t n, int64_t bits,
                                     bool half_scales, bool with_offset, bool factored, bool dot,
                                     bool levels, const std::string& rows_kernel) {
  const Format f = format_of(bits, half_scales, with_offset, factored, levels);
  const Bf16RowsKernel kernel = rows_kernel_of("groupwise_gemm_grouped", rows_kernel);
  TORCH_CHECK(!(dot && f.six()), "groupwise_gemm_grouped: six-bit weights never take the dot path");
  TORCH_CHECK(!(dot && f.levels), "groupwise_gemm_grouped: IQ4 levels never take the dot path");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2,
              "groupwise_gemm_grouped: x must be a CPU [P, K], got ", x.sizes());
  const int64_t rows = x.size(0), k = x.size(1), count = static_cast<int64_t>(packed.size());
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == count + 1 && starts.front() == 0 &&
                  starts.back() == rows,
              "groupwise_gemm_grouped: starts must be ", count + 1,
              " row offsets from 0 to the ", rows, " rows of x");
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(starts[i] <= starts[i + 1], "groupwise_gemm_grouped: starts must not decrease");
    check_panels("groupwise_gemm_grouped", packed[i], n, k, f);
  }
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty({rows, n}, xc.options());
  with_float_elements(xc, "groupwise_gemm_grouped", [](const auto*) {});
  RowGroups shared;  // groups on the register kernels: one region
  const Problem shape{0, k, n, k / kGroup, nullptr, f, nullptr, kernel};
  for (int64_t i = 0; i < count; ++i) {
    const int64_t m = starts[i + 1] - starts[i];
    if (m == 0) continue;
    const auto* w = packed[i].data_ptr<uint8_t>();
    if (register_rows(m, xc.scalar_type(), dot, f, kernel)) {
      shared.lo.push_back(starts[i]);
      shared.rows.push_back(m);
      shared.w.push_back(w);
      continue;
    }
    // A batch the per-call GEMM gives tiles or the scratch: that call, on this group's rows.
    const Problem pb{m, k, n, shape.groups, w, f, nullptr, kernel};
    torch::Tensor yg = y.narrow(0, starts[i], m);
    if (bits == 4)
      dispatch<4>(xc.narrow(0, starts[i], m), pb, dot, true, yg);
    else
      dispatch<8>(xc.narrow(0, starts[i], m), pb, dot, true, yg);
  }
  if (shared.size() > 0) {
    if (bits == 4)
      run_grouped<4>(xc, shared, shape, dot, y);
    else
      run_grouped<8>(xc, shared, shape, dot, y);
  }
  return y;
}

std::tuple<torch::Tensor, torch::Tensor> quantize_groups(const torch::Tensor& x, bool split) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) % kGroup == 0,
              "quantize_groups: x must be a CPU [M, K] with K a multiple of 32, got ", x.sizes());
  const torch::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), rows = split ? 2 * m : m;
  torch::Tensor q = torch::empty({rows, k}, xc.options().dtype(at::kChar));
  torch::Tensor dx = torch::empty({rows, k / kGroup}, xc.options().dtype(at::kFloat));
  with_float_elements(xc, "groupwise", [&](const auto* xp) {
    const QuantizedRows qx = split ? quantize_rows_split(xp, m, k) : quantize_rows(xp, m, k);
    std::memcpy(q.data_ptr<int8_t>(), qx.q.data(), qx.q.size());
    std::memcpy(dx.data_ptr<float>(), qx.dx.data(), qx.dx.size() * sizeof(float));
  });
  return {q, dx};
}

int64_t amx_rows_from(bool four_bit_split) {
  Format f;
  f.bits = four_bit_split ? 4 : 8;
  return tile_rows(f, Bf16RowsKernel::kSplit);
}

std::tuple<int64_t, int64_t> register_tile_rows() { return {kF32Rows, kDotRows}; }

}  // namespace pagedllm::gemm::q4
