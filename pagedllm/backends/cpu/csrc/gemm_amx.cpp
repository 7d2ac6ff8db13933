// AMX tiles for the weight GEMM (see gemm_amx.h for why and when).
//
// Per panel of 16 output columns and per K-block of 256 pairs of k, the weights are converted
// once into pair order (gemm_dp.h's pair_row: row i holds (k=2i, 2i+1) for each of the 16
// columns), which is exactly the layout of an AMX B tile: 16 pair rows of 64 bytes. x is copied
// once per call into A-tile order (pack_rows; 16 rows x 32 bf16 per tile, zero-padded to whole
// tiles), and each panel's [M][16] float32 sums live in C tiles (16 rows x 64 bytes) over an
// accumulator of the same layout as the other paths'. One B tile feeds up to three C tiles (48
// rows), each with an A tile of its own: a fourth would have to reuse an A tile that a tile
// product may still be reading. So a converted weight is read from L1 once per 48 rows.
//
// W8A8 (and the split planes of int8 weight-only layers) needs no conversion: its packed weights
// are B tiles already, read straight from memory. There two row tiles meet two panels at a time
// (block_int8), four tile products for four tile loads.
#include "gemm_amx.h"

#include "gemm_dp.h"

#if defined(PAGEDLLM_GEMM_DP)
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,amx-int8")

namespace pagedllm::gemm::amx {
namespace {

constexpr int64_t kCols = 16;
constexpr int64_t kTile = 16;          // rows of an A/C tile; pair rows of a B tile
constexpr int64_t kBlockPairs = 256;   // pairs of k converted per block: 16 KiB
constexpr int64_t kPairWords = 32;     // bf16 per pair row
constexpr int kMaxRowTiles = 3;        // C tiles fed by one B tile
constexpr int64_t kRowBytes = 64;      // every tile row
constexpr int64_t kTileBytes = kTile * kRowBytes;
constexpr int64_t kPrefetchTiles = 4;  // B tiles read ahead from memory (W8A8)

// The 64-byte operand of ldtilecfg (palette 1): every tile used here is 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr TileConfig make_config() {
  TileConfig cfg{1, 0, {}, {}, {}};
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTile;
  }
  return cfg;
}

// A constant in memory, not a local: GCC's _tile_loadconfig tells the compiler that its asm
// reads only the first 8 bytes of the operand, so the stores that fill a local configuration
// may be dropped as dead (seen here: tilezero then faulted with an illegal instruction).
alignas(64) constexpr TileConfig kTileConfig = make_config();

// panel_groups' configurations: two sets of tiles (consecutive groups alternate), C and A tiles
// of 4, 8 or 16 rows by the rows a batch fills (a tile product, load and store cost in
// proportion to their rows); for two-scale groups (halves of 16 k) B tiles of 8 pair rows and
// A tiles of 16 bf16 a row.
constexpr int kGroupRowKinds = 3;  // 4, 8, 16 rows
constexpr TileConfig make_group_config(bool halves, int64_t rows) {
  TileConfig cfg = make_config();  // two sets: C tmm0 / tmm1, B tmm3 / tmm2, A tmm4 / tmm5
  for (int t : {0, 1, 4, 5}) cfg.rows[t] = static_cast<uint8_t>(rows);
  if (halves) {  // B tiles of 8 pair rows, A tiles of 16 bf16 a row
    for (int t : {2, 3}) cfg.rows[t] = kTile / 2;
    for (int t : {4, 5}) cfg.colsb[t] = kRowBytes / 2;
  }
  return cfg;
}
alignas(64) constexpr TileConfig kGroupConfigs[2][kGroupRowKinds] = {
    {make_group_config(false, 4), make_group_config(false, 8), make_group_config(false, kTile)},
    {make_group_config(true, 4), make_group_config(true, 8), make_group_config(true, kTile)}};

// Which configuration a batch of m rows uses: 4, 8 or (every row tile past 8 rows) 16 rows.
int group_row_kind(int64_t m) { return m <= 4 ? 0 : (m <= 8 ? 1 : 2); }

void configure_tiles() { _tile_loadconfig(&kTileConfig); }

// CPUID leaf 7 EDX: AMX-BF16 is bit 22, AMX-TILE bit 24, AMX-INT8 bit 25.
constexpr unsigned kAmxBf16Bit = 22, kAmxTileBit = 24, kAmxInt8Bit = 25;

bool ask_for_tiles(unsigned feature_bit) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> kAmxTileBit) & 1u) || !((d >> feature_bit) & 1u)) return false;
  constexpr long kReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
  constexpr long kXfeatureTileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
}

// C tiles 0..NT-1 (+)= A tiles of NT row tiles @ `subs` B tiles, B tile s at wb + s * 1 KiB.
// A tile (t, s) of the row tiles at xa + t * tile_stride + s * 1 KiB. Every tile row is 64 bytes:
// 32 bf16 or 64 int8 for A, a pair (bf16) or a group of 4 (int8) of k for 16 columns for B.
// Tile numbers are immediates, hence the unrolled body: C in tmm0-2, B in tmm4, A in tmm5-7.
template <int NT>
void row_tiles(const uint8_t* xa, int64_t tile_stride, const uint8_t* wb, int64_t subs, void* acc,
               bool accumulate) {
  constexpr int64_t kCStride = kCols * 4;  // 16 float32 or int32 per C row
  uint8_t* c0 = static_cast<uint8_t*>(acc);
  uint8_t* c1 = c0 + kTileBytes;
  uint8_t* c2 = c0 + 2 * kTileBytes;
  if (accumulate) {
    _tile_loadd(0, c0, kCStride);
    if constexpr (NT > 1) _tile_loadd(1, c1, kCStride);
    if constexpr (NT > 2) _tile_loadd(2, c2, kCStride);
  } else {
    _tile_zero(0);
    if constexpr (NT > 1) _tile_zero(1);
    if constexpr (NT > 2) _tile_zero(2);
  }
  for (int64_t s = 0; s < subs; ++s) {
    _tile_loadd(4, wb + s * kTileBytes, kRowBytes);
    const uint8_t* a = xa + s * kTileBytes;
    _tile_loadd(5, a, kRowBytes);
    _tile_dpbf16ps(0, 5, 4);
    if constexpr (NT > 1) {
      _tile_loadd(6, a + tile_stride, kRowBytes);
      _tile_dpbf16ps(1, 6, 4);
    }
    if constexpr (NT > 2) {
      _tile_loadd(7, a + 2 * tile_stride, kRowBytes);
      _tile_dpbf16ps(2, 7, 4);
    }
  }
  _tile_stored(0, c0, kCStride);
  if constexpr (NT > 1) _tile_stored(1, c1, kCStride);
  if constexpr (NT > 2) _tile_stored(2, c2, kCStride);
}

// W8A8 sums, two row tiles by two panels: C(t, p) in tmm(2p + t), A tiles in tmm4-5, B tiles in
// tmm6-7, so four tile products share four tile loads. A tile load costs about what a tile
// product does (measured here: 1 KiB loads at ~64 bytes a cycle), and the three-row-tile shape
// above loads 4 tiles per 3 products: with x's tiles coming from L2 this shape ran ~2x faster.
// The B tiles (the packed weights, straight from memory the first time) are prefetched ahead.
template <int NT, int NP>
void block_int8(const uint8_t* xa, int64_t tile_stride, const uint8_t* w0, const uint8_t* w1,
                int64_t subs, int32_t* acc0, int32_t* acc1) {
  constexpr int64_t kCStride = kCols * 4;
  uint8_t* c0 = reinterpret_cast<uint8_t*>(acc0);
  uint8_t* c1 = reinterpret_cast<uint8_t*>(acc1);
  _tile_zero(0);
  if constexpr (NT > 1) _tile_zero(1);
  if constexpr (NP > 1) _tile_zero(2);
  if constexpr (NT > 1 && NP > 1) _tile_zero(3);
  for (int64_t s = 0; s < subs; ++s) {
    const int64_t ahead = (s + kPrefetchTiles) * kTileBytes;
    for (int64_t line = 0; line < kTileBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w0 + ahead + line), _MM_HINT_T0);
      if constexpr (NP > 1)
        _mm_prefetch(reinterpret_cast<const char*>(w1 + ahead + line), _MM_HINT_T0);
    }
    const uint8_t* a = xa + s * kTileBytes;
    _tile_loadd(4, a, kRowBytes);
    _tile_loadd(6, w0 + s * kTileBytes, kRowBytes);
    _tile_dpbssd(0, 4, 6);
    if constexpr (NT > 1) {
      _tile_loadd(5, a + tile_stride, kRowBytes);
      _tile_dpbssd(1, 5, 6);
    }
    if constexpr (NP > 1) {
      _tile_loadd(7, w1 + s * kTileBytes, kRowBytes);
      _tile_dpbssd(2, 4, 7);
      if constexpr (NT > 1) _tile_dpbssd(3, 5, 7);
    }
  }
  _tile_stored(0, c0, kCStride);
  if constexpr (NT > 1) _tile_stored(1, c0 + kTileBytes, kCStride);
  if constexpr (NP > 1) _tile_stored(2, c1, kCStride);
  if constexpr (NT > 1 && NP > 1) _tile_stored(3, c1 + kTileBytes, kCStride);
}

// All row tiles of xa (m_tiles of them, subs_total A tiles per row tile) against B tiles
// wb[0:subs] that cover A tiles s0..s0+subs of every row tile; C rows at acc (16 per tile).
void all_rows(const uint8_t* xa, int64_t m_tiles, int64_t subs_total, int64_t s0,
              const uint8_t* wb, int64_t subs, uint8_t* acc, bool accumulate) {
  const int64_t tile_stride = subs_total * kTileBytes;
  for (int64_t t0 = 0; t0 < m_tiles; t0 += kMaxRowTiles) {
    const uint8_t* a = xa + t0 * tile_stride + s0 * kTileBytes;
    uint8_t* c = acc + t0 * kTileBytes;
    switch (std::min<int64_t>(kMaxRowTiles, m_tiles - t0)) {
      case 1:
        row_tiles<1>(a, tile_stride, wb, subs, c, accumulate);
        break;
      case 2:
        row_tiles<2>(a, tile_stride, wb, subs, c, accumulate);
        break;
      default:
        row_tiles<3>(a, tile_stride, wb, subs, c, accumulate);
    }
  }
}

// acc[m_tiles * 16][16] float32 = xa (A-tile order) @ one panel [K][16] of bf16 or int8
// weights, converted block by block into B-tile pair order in scratch.
template <typename Tag>
void panel_bf16(const uint8_t* xa, int64_t m_tiles, int64_t k, const typename Tag::T* wp,
                float* acc, uint16_t* scratch) {
  const int64_t pairs = k / 2, subs_total = pairs / kTile;
  for (int64_t p0 = 0; p0 < pairs; p0 += kBlockPairs) {
    const int64_t pc = std::min(kBlockPairs, pairs - p0);
    for (int64_t i = 0; i < pc; ++i)
      _mm512_storeu_si512(scratch + i * kPairWords,
                          dp::pair_row(Tag{}, wp + 2 * (p0 + i) * kCols));
    all_rows(xa, m_tiles, subs_total, p0 / kTile,
                    reinterpret_cast<const uint8_t*>(scratch), pc / kTile,
                    reinterpret_cast<uint8_t*>(acc), p0 > 0);
  }
}

// x [M, row_bytes] -> [ceil(M/16)][row_bytes/64][16][64 bytes]: every A tile 1 KiB contiguous
// (rows past M zero). Read in place, a tile's 16 rows sit a row apart: for K = 2048 bf16 that
// is 4 KiB, so all of them fall in one L1 set and evict each other.
std::vector<uint8_t> pack_rows(const uint8_t* x, int64_t m, int64_t row_bytes) {
  const int64_t m_tiles = (m + kTile - 1) / kTile, subs = row_bytes / kRowBytes;
  std::vector<uint8_t> xa(static_cast<size_t>(m_tiles * subs * kTileBytes), 0);
  at::parallel_for(0, m_tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rows = std::min(kTile, m - t * kTile);
      for (int64_t s = 0; s < subs; ++s) {
        uint8_t* dst = xa.data() + (t * subs + s) * kTileBytes;
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(dst + r * kRowBytes, x + (t * kTile + r) * row_bytes + s * kRowBytes,
                      kRowBytes);
      }
    }
  });
  return xa;
}

// y rows of one panel: sums * scale + bias, rounded to bf16 (round to nearest even).
void store_panel(const float* acc, int64_t m, int64_t n, int64_t n0, const float* scale,
                 const float* bias, uint16_t* y) {
  const int64_t cols = std::min(kCols, n - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 sc = scale ? _mm512_maskz_loadu_ps(mask, scale + n0) : _mm512_set1_ps(1.0f);
  const __m512 bi = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < m; ++r) {
    __m512 v = _mm512_loadu_ps(acc + r * kCols);
    if (scale) v = _mm512_mul_ps(v, sc);
    if (bias) v = _mm512_add_ps(v, bi);
    const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    _mm256_mask_storeu_epi16(y + r * n + n0, mask, h);
  }
}

template <typename Tag>
void run(const uint16_t* x, int64_t m, int64_t k, const typename Tag::T* w, int64_t n,
         const float* scale, const float* bias, uint16_t* y) {
  const std::vector<uint8_t> xa =
      pack_rows(reinterpret_cast<const uint8_t*>(x), m, k * static_cast<int64_t>(sizeof(*x)));
  const int64_t m_tiles = (m + kTile - 1) / kTile;
  const int64_t panels = (n + kCols - 1) / kCols;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();  // tile configuration is per thread
    std::vector<float> acc(static_cast<size_t>(m_tiles * kTile * kCols));
    std::vector<uint16_t> scratch(static_cast<size_t>(kBlockPairs * kPairWords));
    for (int64_t p = begin; p < end; ++p) {
      panel_bf16<Tag>(xa.data(), m_tiles, k, w + p * k * kCols, acc.data(), scratch.data());
      store_panel(acc.data(), m, n, p * kCols, scale, bias, y);
    }
    _tile_release();
  });
}

// One group's tile product(s) into out: C in tile TC, B in TB, A in TA. GCC's tile intrinsics
// paste their tile numbers into the assembly text, so the numbers are literals, not template
// arguments: one function per set of tiles.
#define PAGEDLLM_GROUP_PRODUCT(NAME, TC, TB, TA)                                 \
  template <int Parts>                                                           \
  inline void NAME(const uint8_t* a, const uint8_t* b, float* out) {             \
    for (int h = 0; h < Parts; ++h) {                                            \
      _tile_zero(TC);                                                            \
      _tile_loadd(TB, b + h * (kTileBytes / 2), kRowBytes);                      \
      _tile_loadd(TA, a + h * (kRowBytes / 2), kRowBytes);                       \
      _tile_dpbf16ps(TC, TA, TB);                                                \
      _tile_stored(TC, out + h * kTile * kCols, kCols * 4);                      \
    }                                                                            \
  }
// A half tile starts 32 bytes into each 64-byte row; a B half tile is 8 of the 16 rows.
PAGEDLLM_GROUP_PRODUCT(group_product_even, 0, 3, 4)
PAGEDLLM_GROUP_PRODUCT(group_product_odd, 1, 2, 5)
#undef PAGEDLLM_GROUP_PRODUCT

// One row tile through groups [g0, g0 + gc): each group's tile product (two half products for
// two-scale groups) stored to a small buffer and added, scaled, to float32 accumulators held in
// registers. Rows: the rows of the tile configuration (group_row_kind), the only ones scaled.
// Consecutive groups alternate between two sets of tiles and buffers, and group g + 1's product
// is issued before group g's vector pass, so no product waits for the previous one's store.
// Timed on a Xeon (Q4_0 gate/up, weights from memory): 1.5-1.9 ms at 4-16 rows with one set of
// 16-row tiles, ~1.0 ms without any tile work, the same without the vector pass; with two sets
// and 4- or 8-row tiles 1.1-1.4x faster at 4-8 rows.
template <bool Halves, int Rows>
void tile_groups(const uint8_t* a, const uint8_t* b, const float* so, int64_t gc, bool offsets,
                 const float* xs, int64_t ldxs, float* acc) {
  constexpr int kParts = Halves ? 2 : 1;
  alignas(64) float sums[2][kParts][kTile * kCols];
  __m512 c[Rows];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) c[r] = _mm512_loadu_ps(acc + r * kCols);
  const auto product = [&](int64_t g) {
    if (g & 1)
      group_product_odd<kParts>(a + g * kTileBytes, b + g * kTileBytes, sums[1][0]);
    else
      group_product_even<kParts>(a + g * kTileBytes, b + g * kTileBytes, sums[0][0]);
  };
  if (gc > 0) product(0);
  for (int64_t g = 0; g < gc; ++g) {
    if (g + 1 < gc) product(g + 1);
    const float* out = sums[g & 1][0];
    const float* sg = so + g * 2 * kCols;
    const __m512 s0 = _mm512_loadu_ps(sg), s1 = _mm512_loadu_ps(sg + kCols);
    if (Halves) {
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r)
        c[r] = _mm512_fmadd_ps(_mm512_load_ps(out + (kTile + r) * kCols), s1,
                               _mm512_fmadd_ps(_mm512_load_ps(out + r * kCols), s0, c[r]));
    } else if (offsets) {
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r)
        c[r] = _mm512_fmadd_ps(s1, _mm512_set1_ps(xs[r * ldxs + g]),
                               _mm512_fmadd_ps(_mm512_load_ps(out + r * kCols), s0, c[r]));
    } else {
#pragma GCC unroll 16
      for (int r = 0; r < Rows; ++r)
        c[r] = _mm512_fmadd_ps(_mm512_load_ps(out + r * kCols), s0, c[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) _mm512_storeu_ps(acc + r * kCols, c[r]);
}

}  // namespace

std::vector<uint8_t> pack_bf16_rows(const uint16_t* x, int64_t m, int64_t k) {
  return pack_rows(reinterpret_cast<const uint8_t*>(x), m, k * 2);
}

void begin_group_tiles(bool halves, int64_t m) {
  _tile_loadconfig(&kGroupConfigs[halves ? 1 : 0][group_row_kind(m)]);
}

void panel_groups(const uint8_t* xa, int64_t m, int64_t groups_total, int64_t g0,
                  const uint16_t* pairs, const float* so, int64_t gc, bool offsets, bool halves,
                  const float* xs, float* acc) {
  const int64_t m_tiles = (m + kTile - 1) / kTile, tile_stride = groups_total * kTileBytes;
  const auto* b = reinterpret_cast<const uint8_t*>(pairs);
  for (int64_t t = 0; t < m_tiles; ++t) {
    const uint8_t* a = xa + t * tile_stride + g0 * kTileBytes;
    const float* xr = xs + t * kTile * groups_total + g0;
    float* c = acc + t * kTile * kCols;
    const auto run = [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      if (halves)
        tile_groups<true, R>(a, b, so, gc, false, xr, groups_total, c);
      else
        tile_groups<false, R>(a, b, so, gc, offsets, xr, groups_total, c);
    };
    const int kind = group_row_kind(m);
    if (kind == 0)
      run(std::integral_constant<int, 4>{});
    else if (kind == 1)
      run(std::integral_constant<int, 8>{});
    else
      run(std::integral_constant<int, 16>{});
  }
}

bool available() {
  static const bool granted = ask_for_tiles(kAmxBf16Bit);  // once per process; thread-safe init
  return granted;
}

bool int8_available() {
  static const bool granted = ask_for_tiles(kAmxInt8Bit);
  return granted;
}

std::vector<uint8_t> pack_int8_rows(const int8_t* qx, int64_t m, int64_t row_bytes) {
  return pack_rows(reinterpret_cast<const uint8_t*>(qx), m, row_bytes);
}

void begin_tiles() { configure_tiles(); }

void end_tiles() { _tile_release(); }

void panels_int8(const uint8_t* xa, int64_t m_tiles, int64_t groups, const int8_t* panel0,
                 const int8_t* panel1, int32_t* acc0, int32_t* acc1) {
  const int64_t subs = groups / kTile;  // a B tile: 16 groups of 4 k, straight from the panel
  const int64_t tile_stride = subs * kTileBytes;
  const auto* w0 = reinterpret_cast<const uint8_t*>(panel0);
  const auto* w1 = reinterpret_cast<const uint8_t*>(panel1);
  for (int64_t t = 0; t < m_tiles; t += 2) {
    const uint8_t* a = xa + t * tile_stride;
    int32_t* c0 = acc0 + t * kTile * kCols;
    int32_t* c1 = panel1 ? acc1 + t * kTile * kCols : nullptr;
    const bool two_rows = m_tiles - t > 1;
    if (panel1 && two_rows)
      block_int8<2, 2>(a, tile_stride, w0, w1, subs, c0, c1);
    else if (panel1)
      block_int8<1, 2>(a, tile_stride, w0, w1, subs, c0, c1);
    else if (two_rows)
      block_int8<2, 1>(a, tile_stride, w0, nullptr, subs, c0, nullptr);
    else
      block_int8<1, 1>(a, tile_stride, w0, nullptr, subs, c0, nullptr);
  }
}

void gemm(const uint16_t* x, int64_t m, int64_t k, const void* panels, bool weight_is_int8,
          int64_t n, const float* scale, const float* bias, uint16_t* y) {
  if (weight_is_int8)
    run<Int8W>(x, m, k, static_cast<const int8_t*>(panels), n, scale, bias, y);
  else
    run<Bf16W>(x, m, k, static_cast<const uint16_t*>(panels), n, scale, bias, y);
}

}  // namespace pagedllm::gemm::amx

#pragma GCC pop_options

#else  // no AVX512-BF16 in this build: no AMX path

namespace pagedllm::gemm::amx {
bool available() { return false; }
bool int8_available() { return false; }
void gemm(const uint16_t*, int64_t, int64_t, const void*, bool, int64_t, const float*,
          const float*, uint16_t*) {}
std::vector<uint8_t> pack_int8_rows(const int8_t*, int64_t, int64_t) { return {}; }
void begin_tiles() {}
void end_tiles() {}
void panels_int8(const uint8_t*, int64_t, int64_t, const int8_t*, const int8_t*, int32_t*,
                 int32_t*) {}
std::vector<uint8_t> pack_bf16_rows(const uint16_t*, int64_t, int64_t) { return {}; }
void begin_group_tiles(bool, int64_t) {}
void panel_groups(const uint8_t*, int64_t, int64_t, int64_t, const uint16_t*, const float*, int64_t,
                  bool, bool, const float*, float*) {}
}  // namespace pagedllm::gemm::amx

#endif
