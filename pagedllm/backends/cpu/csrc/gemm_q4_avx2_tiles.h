// Many rows of bf16 x on AVX2 without AVX-512 (decode of many sequences, prefill): the int16
// kernel of few rows (gemm_q4_avx2.h's avx2_i16_rows) as a register tile over a scratch of
// widened weights, so a row's result is the same whatever the batch it runs in.
//
// x: each row rounded by avx2_i16_x_rows (per group of 32, s = 2^(floor(log2 max|x|) - 14),
// xi = round_half_even(x / s): exact for every bf16 element within 2^7 of its group's
// largest). Weights: per K-block of a panel, each group's q widened once to int16 lanes
// (i16_lanes: two k per int32 lane, in the order of x's words) into a scratch every row tile
// reads, with the group's float32 scales and offsets beside them. Tile: R rows x 16 columns,
// per x word two vpmaddwd and two vpaddd a row into int32 sums (2R ymm), exact per group
// (4-bit |sum| <= 32 * 15 * 32767 < 2^24, 8-bit <= 32 * 128 * 32768 = 2^27), then per group
//   y += (scale * s) * sum + offset * (s * sum_k xi)
// in float32, the same operations in the same order as avx2_i16_rows: bit for bit its result
// for the same row (tested). Two-scale layers (Q6_K: a scale per 16 k, no offset) flush their
// sums after each half group, k 0..15 times the scale and k 16..31 times the second.
//
// Why: past 4 rows the float path dequantised every weight into a float32 scratch (f32_block)
// and ran 8 MACs per FMA; vpmaddwd does 16 per instruction, and a Zen 3 issues it on two pipes
// (FP0, FP3) with vpaddd on all four, as many multiply instructions a cycle as FMAs. The tile
// keeps its float32 totals in memory (L1): 2R int32 sums + 2 weight registers + a broadcast
// and a product leave no room for them at R = 6, and the flush is a few loads per group of 16
// words. Measured on the Zen 3 EPYC (one thread, best of 40 from L1, a busy 2-core VM): the
// tile 7.7-8.5 ns a row and group (4, 5 and 6 rows alike) against f32_tile's 10.8-11.6 (at
// the FMA peak), widening 14 ns a group and panel against f32_block's 68 (4-bit) and 137+
// (8-bit). The GEMM (linear_cpu.py --rows-kernels, one thread, from cache, 1B shapes), default
// over float: 8 rows 1.7-2.5x, 16 rows 1.33-1.76x, 64 rows 1.08-1.36x, 512 rows 1.09-1.25x;
// two threads alike where the host was quiet (docs/performance.md).
#pragma once

#include <algorithm>
#include <cstdint>

#include "gemm_q4_avx2.h"
#include "gemm_q4_layout.h"

#if defined(PAGEDLLM_Q4_AVX2_ROWS)
#define PAGEDLLM_Q4_AVX2_TILES 1

namespace pagedllm::gemm::q4 {

constexpr int kI16TileRows = 6;        // register tile: 12 int32 sums + 2 weights + 2 temps
constexpr int64_t kI16BlockGroups = 8;  // K-block: 8 KiB of widened q + 1 KiB of scales
// Rows of x per pass over a thread's panels: as many whole tiles as fit kI16ChunkBytes (x of
// 512 rows is 2 MiB at K = 2048: read again for every panel, from L3), at least
// kI16ChunkTiles of them (each pass widens every panel's q again).
constexpr int64_t kI16ChunkBytes = 256 * 1024;
constexpr int64_t kI16ChunkTiles = 4;
constexpr int64_t kI16GroupVecs = 2 * kI16Words;  // ymm of widened q per group and panel
constexpr int64_t kI16GroupInts = 8 * kI16GroupVecs;  // their int32 lanes

template <int Bits, bool Levels, int... J>
PAGEDLLM_Q4_INLINE void i16_widen_chunk(const uint8_t* chunk, __m256i* out,
                                        std::integer_sequence<int, J...>) {
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32));
  (_mm256_storeu_si256(out + 2 * J, i16_lanes<Bits, J, false, Levels>(v0)), ...);
  (_mm256_storeu_si256(out + 2 * J + 1, i16_lanes<Bits, J, false, Levels>(v1)), ...);
}

// One six half group's 8 pair rows (six_word) stored as out[2P + h] (h: column half).
template <int... P>
PAGEDLLM_Q4_INLINE void i16_widen_six(const uint8_t* half, __m256i* out,
                                      std::integer_sequence<int, P...>) {
  ((_mm256_storeu_si256(out + 2 * P, six_word<P>(half, 0)),
    _mm256_storeu_si256(out + 2 * P + 1, six_word<P>(half, 1))),
   ...);
}

// Groups [g0, g0 + gc) of one panel widened: w[g][word][half] the int16 lanes of x word `word`
// (avx2_i16_x_rows' order) for columns 8 * half.., so[g] its 16 scales then 16 offsets
// (group_scales: Q4_0's -8 * scale, zero for Q8_0, the second scale for two-scale layers;
// i16_offsets: IQ4 levels' -127 * scale, their q widened to u = level + 127).
// L: the layout f is read through (gemm_q4_layout.h's with_layout).
template <int Bits, typename L = RuntimeLayout>
inline void i16_block(const uint8_t* panel, int64_t g0, int64_t gc, const Format& format,
                      int32_t* scratch, float* so) {
  const Format& f = L::of(format);
  auto* w = reinterpret_cast<__m256i*>(scratch);
  constexpr int kPer = Bits == 4 ? 8 : 4;    // k per chunk
  constexpr int kWords = Bits == 4 ? 4 : 2;  // x words per chunk
  for (int64_t g = 0; g < gc; ++g) {
    const uint8_t* block = panel + f.block_offset(g0 + g);
    prefetch_group(panel, g0 + g, f);
    __m256i* out = w + g * kI16GroupVecs;  // (stored unaligned: loadu / storeu below)
    if constexpr (Bits == 6) {  // six blocks: x word j is pair row j % 8 of half group j / 8
      for (int h = 0; h < 2; ++h)
        i16_widen_six(block + h * Format::kSixHalf, out + h * kI16Words,
                      std::make_integer_sequence<int, 8>{});
    } else {
#pragma GCC unroll 8
      for (int ch = 0; ch < kGroup / kPer; ++ch)
        i16_widen_chunk<Bits, L::kLevels>(block + ch * kChunk, out + 2 * kWords * ch,
                                          std::make_integer_sequence<int, kWords>{});
    }
    V16 s, o;
    group_scales(panel, g0 + g, f, &s, &o);
    i16_offsets<L::kLevels>(s, &o);
    v_store(so + g * 2 * kCols, s);
    v_store(so + g * 2 * kCols + kCols, o);
  }
}

// c[R][16] (+)= R rows of x @ gc widened groups (i16_block): xw, xs, gsum from avx2_i16_x_rows
// at this K-block's first group (row r at r * ldx words, r * ldg groups). Offsets: add
// offset * gsum per group (4-bit layers, Q5_K's 8-bit ones); Two: a sum per 16 k, scaled by so's
// scales (k 0..15) and its offsets (k 16..31), no offset term.
template <int R, bool Two>
inline void i16_tile(const int32_t* xw, int64_t ldx, const float* xs, const float* gsum,
                     int64_t ldg, const int32_t* scratch, const float* so, int64_t gc,
                     bool offsets, float* c, bool accumulate) {
  const auto* w = reinterpret_cast<const __m256i*>(scratch);
  if (!accumulate)
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(c + r * kCols, _mm256_setzero_ps());
      _mm256_storeu_ps(c + r * kCols + 8, _mm256_setzero_ps());
    }
  // Each row's own pointer, advanced by a group per step: indexed as xg[r * ldx + j], GCC
  // kept the address of every row and word (96 in the 6-row tile) in stack slots and loaded
  // one before each broadcast.
  const int32_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = xw + r * ldx;
  for (int64_t g = 0; g < gc; ++g) {
    const __m256i* wg = w + g * kI16GroupVecs;
    const float* sg = so + g * 2 * kCols;
    __m256i a[R][2];
    // c[r] += the sums times `scale` (and s of row r), sums reset: avx2_i16_rows' arithmetic.
    const auto flush = [&](const float* scale, bool offset) {
      const __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xsr = _mm256_broadcast_ss(xs + r * ldg + g);
        float* cr = c + r * kCols;
        __m256 t0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][0]), _mm256_mul_ps(s0, xsr),
                                    _mm256_loadu_ps(cr));
        __m256 t1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][1]), _mm256_mul_ps(s1, xsr),
                                    _mm256_loadu_ps(cr + 8));
        if (offset) {
          const __m256 xsum = _mm256_broadcast_ss(gsum + r * ldg + g);
          t0 = _mm256_fmadd_ps(_mm256_loadu_ps(sg + kCols), xsum, t0);
          t1 = _mm256_fmadd_ps(_mm256_loadu_ps(sg + kCols + 8), xsum, t1);
        }
        _mm256_storeu_ps(cr, t0);
        _mm256_storeu_ps(cr + 8, t1);
      }
    };
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int j = 0; j < kI16Words; ++j) {
      const __m256i w0 = _mm256_loadu_si256(wg + 2 * j), w1 = _mm256_loadu_si256(wg + 2 * j + 1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i xb = _mm256_set1_epi32(xr[r][g * kI16Words + j]);
        a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(w0, xb));
        a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(w1, xb));
      }
      // The sums in registers at every word: unpinned, GCC loaded several words' weights
      // ahead and spilled sums to the stack (152 stack accesses in the 6-row tile, 32 with
      // the pin: the flush's; ~5% of the tile's time on the Zen 3).
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        in_register(a[r][0]);
        in_register(a[r][1]);
      }
      if (Two && j == kI16Words / 2 - 1) {  // k 0..15 done: their scale
        flush(sg, false);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_si256();
      }
    }
    flush(Two ? sg + kCols : sg, !Two && offsets);
  }
}

}  // namespace pagedllm::gemm::q4

#endif  // PAGEDLLM_Q4_AVX2_ROWS
