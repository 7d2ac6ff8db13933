// The dot path (gemm_q4_dot.h: x rounded to int8 per group of 32) on 4-bit layers as register
// tiles, on AVX2 without AVX-512: many rows of int8 x (prefill, decode of many sequences) under
// `int8_activations`.
//
// Per K-block of a panel, each group's q (0..15) are split from their nibbles once into a
// scratch (4 chunks x {low nibbles, high nibbles} x 2 column halves: 512 bytes a group) with the
// group's float32 scales and offsets beside them; every row tile of the pass reads them. Tile: R
// rows x 16 columns, per chunk and row two broadcasts of 4 int8 of x and four vpmaddubsw (q as
// the unsigned operand, x signed) added into int16 sums (2R ymm). No sum saturates: 16 products
// of at most 15 * 127 per int16 lane, 30,480 at most. Per group the sums widen to int32
// (vpmaddwd by ones), Q4_0's correction -8 sum(xq) is added, and
//   y += (scale * dx) * sum (+ offset * xsum)
// in float32, the operations of dot_rows in its order: a row's result is bit for bit what
// dot_rows gives it, whatever the batch (tested).
//
// Why: dot_rows (4 rows a pass over the panel) splits the nibbles again for every 4 rows and
// keeps its float32 totals in memory; on a Zen 3 it ran ~100 GMAC/s on two threads at 16-256
// rows, no faster than the int16 tiles of bf16 x (gemm_q4_avx2_tiles.h), though vpmaddubsw
// does 32 products an instruction against vpmaddwd's 16, at the same rate (two a cycle), and the
// int16 sums need one add per 32 products where the int16 tiles need one per 16.
#pragma once

#include <algorithm>
#include <cstdint>

#include "gemm_q4_avx2.h"
#include "gemm_q4_dot.h"
#include "gemm_q4_layout.h"

#if defined(PAGEDLLM_Q4_AVX2_ROWS)
#define PAGEDLLM_Q4_DOT_TILES 1

namespace pagedllm::gemm::q4 {

constexpr int kI8TileRows = 6;           // 12 int16 sums + 2 weights + a broadcast
constexpr int64_t kI8BlockGroups = 8;    // K-block: 4 KiB of split q + 1 KiB of scales
constexpr int64_t kI8GroupVecs = 16;     // ymm of split q per group and panel
// Rows of x per pass over a thread's panels: as many whole tiles as fit kI8ChunkBytes of int8
// x (read again for every panel), at least kI8ChunkTiles of them (each pass splits every
// panel's q again).
constexpr int64_t kI8ChunkBytes = 256 * 1024;
constexpr int64_t kI8ChunkTiles = 4;

// Groups [g0, g0 + gc) of one 4-bit panel split: w[16 g + 4 ch + {0, 1}] the low nibbles of
// chunk ch (k 8 ch .. 8 ch + 3) for columns 0..7 / 8..15, {2, 3} the high ones (k + 4), so[g]
// the group's 16 scales then 16 offsets (group_scales). L: the layout f is read through.
template <typename L = RuntimeLayout>
inline void i8_block(const uint8_t* panel, int64_t g0, int64_t gc, const Format& format,
                     __m256i* w, float* so) {
  const Format& f = L::of(format);
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < gc; ++g) {
    const uint8_t* block = panel + f.block_offset(g0 + g);
    prefetch_group(panel, g0 + g, f);
    __m256i* out = w + g * kI8GroupVecs;
#pragma GCC unroll 4
    for (int ch = 0; ch < 4; ++ch) {
      const auto* v = reinterpret_cast<const __m256i*>(block + ch * kChunk);
      const __m256i v0 = _mm256_loadu_si256(v), v1 = _mm256_loadu_si256(v + 1);
      _mm256_storeu_si256(out + 4 * ch, _mm256_and_si256(v0, low));
      _mm256_storeu_si256(out + 4 * ch + 1, _mm256_and_si256(v1, low));
      _mm256_storeu_si256(out + 4 * ch + 2, _mm256_and_si256(_mm256_srli_epi16(v0, 4), low));
      _mm256_storeu_si256(out + 4 * ch + 3, _mm256_and_si256(_mm256_srli_epi16(v1, 4), low));
    }
    V16 s, o;
    group_scales(panel, g0 + g, f, &s, &o);
    v_store(so + g * 2 * kCols, s);
    v_store(so + g * 2 * kCols + kCols, o);
  }
}

// c[R][16] (+)= R rows of int8 x @ gc split groups (i8_block): xq at this K-block's first k
// (row r at r * ldx), dx, xsum, corr at its first group (row r at r * ldg). Offsets: add
// offset * xsum per group (Q4_1, Q4_K); centred: add corr (Q4_0's -8 sum(xq)) to the sums.
template <int R>
inline void i8_tile(const int8_t* xq, int64_t ldx, const float* dx, const float* xsum,
                    const int32_t* corr, int64_t ldg, const __m256i* w, const float* so,
                    int64_t gc, bool offsets, bool centred, float* c, bool accumulate) {
  if (!accumulate)
    for (int r = 0; r < R; ++r) v_store(c + r * kCols, v_zero());
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xr[R];  // each row's own pointer (as i16_tile: no address per row and part)
  for (int r = 0; r < R; ++r) xr[r] = xq + r * ldx;
  for (int64_t g = 0; g < gc; ++g) {
    const __m256i* wg = w + g * kI8GroupVecs;
    __m256i a[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int part = 0; part < 8; ++part) {  // chunk part / 2, its low (even) or high nibbles
      const __m256i w0 = _mm256_loadu_si256(wg + 2 * part);
      const __m256i w1 = _mm256_loadu_si256(wg + 2 * part + 1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(load4(xr[r] + g * kGroup + 4 * part));
        a[r][0] = _mm256_add_epi16(a[r][0], _mm256_maddubs_epi16(w0, xb));
        a[r][1] = _mm256_add_epi16(a[r][1], _mm256_maddubs_epi16(w1, xb));
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        in_register(a[r][0]);
        in_register(a[r][1]);
      }
    }
    const float* sg = so + g * 2 * kCols;
    const V16 s = v_load(sg), o = v_load(sg + kCols);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i cr = _mm256_set1_epi32(centred ? corr[r * ldg + g] : 0);
      const V16 sum = to_v16(_mm256_add_epi32(_mm256_madd_epi16(a[r][0], ones), cr),
                             _mm256_add_epi32(_mm256_madd_epi16(a[r][1], ones), cr));
      V16 t = v_fmav(v_load(c + r * kCols), sum, v_mul(s, v_set(dx[r * ldg + g])));
      if (offsets) t = v_fma(t, o, xsum[r * ldg + g]);
      v_store(c + r * kCols, t);
    }
  }
}

}  // namespace pagedllm::gemm::q4

#endif  // PAGEDLLM_Q4_AVX2_ROWS
