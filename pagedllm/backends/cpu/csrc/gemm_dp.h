// The weight GEMM's bf16 dot-product path (AVX512-BF16 builds only): bf16 activations times bf16
// or int8 weights with vdpbf16ps, float32 sums.
//
// Why: widening each weight to float32 and using float32 FMAs (gemm.cpp's general path) does 16
// multiply-adds per instruction; vdpbf16ps does 32 (a pair of k per float32 lane). Where the
// processor has it, a batch of a few dozen tokens - bound by arithmetic, not by bytes - runs twice
// as fast, and int8 weights (exact in bf16) ride on the same instruction instead of trailing
// float32. Only bf16 activations take this path: rounding float32 activations to bf16 would
// change the model's numbers.
//
// The packed layout stays gemm.cpp's [ceil(N/16)][K][16]: rows k and k+1 of a panel are 32
// contiguous weights, interleaved per column in registers (one permute for bf16; for int8 the
// byte unpack comes before the conversion). With many rows, a K-block of the panel is converted
// once into pair order in a scratch buffer and read by every row tile.
//
// Two panels at a time (panel_pair): each broadcast pair of x feeds two dot products, one per
// panel. With one panel per tile every vdpbf16ps needs its own broadcast, and that, not the
// arithmetic, bounded the loop: on a Zen 4 EPYC a 12-row one-panel tile ran 1.8-2.3 G dot
// products per second per core from L1, an 8-row two-panel one 3.6 G (a stand-alone
// micro-benchmark of the two loops), about the rate oneDNN's bf16 GEMM reaches there.
#pragma once

#include "gemm_vec.h"

#if defined(__AVX512BF16__)
#define PAGEDLLM_GEMM_DP 1

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagedllm::gemm::dp {

constexpr int kRows = 12;          // 12 zmm accumulators; x pairs are broadcast from memory
constexpr int kPairRows = 8;       // rows of the two-panel tile: 16 zmm accumulators
constexpr int64_t kCols = 16;      // output columns per panel
constexpr int64_t kPairWords = 32;  // bf16 per pair row: 16 columns x (k, k+1)
// Pairs of k per scratch block: 256 x 64 bytes = 16 KiB, which stays in L1 across row tiles.
constexpr int64_t kBlockPairs = 256;

// Index of vpermw that turns [k: c0..c15 | k+1: c0..c15] into [c0k c0k1 c1k c1k1 ...].
alignas(64) inline constexpr uint16_t kInterleave[32] = {
    0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

inline __m512i pair_row(Bf16W, const uint16_t* w) {
  const __m512i idx = _mm512_load_si512(kInterleave);
  return _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(w));
}

// int8 is exact in bf16 (7 significant bits), so int8 -> float32 -> bf16 loses nothing.
inline __m512i pair_row(Int8W, const int8_t* w) {
  const __m128i k0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  const __m128i k1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kCols));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(k0, k1)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(k0, k1)));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // lo in the low half
}

// The pair (x[k], x[k+1]) of one bf16 row, as the 32-bit lane vdpbf16ps broadcasts.
inline __m512bh x_pair(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(v));
}

inline __m512 dot(__m512 acc, __m512i w, const uint16_t* x) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(w), x_pair(x));
}

// c[R][16] (+)= x[R, 0:2 * pairs] @ W, with row i of pair order given by load(i).
template <int R, typename Load>
inline void tile(const uint16_t* x, int64_t ldx, int64_t pairs, const Load& load, float* c,
                 bool accumulate) {
  __m512 acc[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    acc[r] = accumulate ? _mm512_loadu_ps(c + r * kCols) : _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512i wv = load(i);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) acc[r] = dot(acc[r], wv, x + r * ldx + 2 * i);
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + r * kCols, acc[r]);
}

// One row (decode of one sequence): four chains over i % 4, so that consecutive dot products do
// not wait on each other's latency; the loop is then bound by streaming the weights.
template <typename Load>
inline void tile_one(const uint16_t* x, int64_t pairs, const Load& load, float* c,
                     bool accumulate) {
  __m512 a0 = accumulate ? _mm512_loadu_ps(c) : _mm512_setzero_ps();
  __m512 a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 4 <= pairs; i += 4) {
    a0 = dot(a0, load(i), x + 2 * i);
    a1 = dot(a1, load(i + 1), x + 2 * i + 2);
    a2 = dot(a2, load(i + 2), x + 2 * i + 4);
    a3 = dot(a3, load(i + 3), x + 2 * i + 6);
  }
  for (; i < pairs; ++i) a0 = dot(a0, load(i), x + 2 * i);
  _mm512_storeu_ps(c, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

template <typename Load, int R = kRows>
inline void tile_rows(int rows, const uint16_t* x, int64_t ldx, int64_t pairs, const Load& load,
                      float* c, bool accumulate) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<Load, R - 1>(rows, x, ldx, pairs, load, c, accumulate);
    tile<R>(x, ldx, pairs, load, c, accumulate);
  } else {
    tile_one(x, pairs, load, c, accumulate);
  }
}

// acc[M][16] = x[M, K] (bf16, K even) @ panel[K][16]; scratch holds kBlockPairs pair rows.
template <typename Tag>
void panel(const uint16_t* x, int64_t m, int64_t k, const typename Tag::T* wp, float* acc,
           uint16_t* scratch) {
  const int64_t pairs = k / 2;
  if (m <= kRows) {
    // Few rows (decode): each weight is converted once, in registers.
    const auto load = [wp](int64_t i) { return pair_row(Tag{}, wp + 2 * i * kCols); };
    tile_rows(static_cast<int>(m), x, k, pairs, load, acc, false);
    return;
  }
  const auto load = [scratch](int64_t i) {
    return _mm512_loadu_si512(scratch + i * kPairWords);
  };
  for (int64_t p0 = 0; p0 < pairs; p0 += kBlockPairs) {
    const int64_t pc = std::min(kBlockPairs, pairs - p0);
    for (int64_t i = 0; i < pc; ++i)
      _mm512_storeu_si512(scratch + i * kPairWords, pair_row(Tag{}, wp + 2 * (p0 + i) * kCols));
    for (int64_t m0 = 0; m0 < m; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, m - m0));
      tile_rows(rows, x + m0 * k + 2 * p0, k, pc, load, acc + m0 * kCols, p0 > 0);
    }
  }
}

// c0[R][16], c1[R][16] (+)= x[R, 0:2 * pairs] @ the two panels given by load0(i), load1(i).
template <int R, typename Load0, typename Load1>
inline void tile_pair(const uint16_t* x, int64_t ldx, int64_t pairs, const Load0& load0,
                      const Load1& load1, float* c0, float* c1, bool accumulate) {
  __m512 a0[R], a1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    a0[r] = accumulate ? _mm512_loadu_ps(c0 + r * kCols) : _mm512_setzero_ps();
    a1[r] = accumulate ? _mm512_loadu_ps(c1 + r * kCols) : _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512bh w0 = reinterpret_cast<__m512bh>(load0(i));
    const __m512bh w1 = reinterpret_cast<__m512bh>(load1(i));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = x_pair(x + r * ldx + 2 * i);
      a0[r] = _mm512_dpbf16_ps(a0[r], w0, xv);
      a1[r] = _mm512_dpbf16_ps(a1[r], w1, xv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c0 + r * kCols, a0[r]);
    _mm512_storeu_ps(c1 + r * kCols, a1[r]);
  }
}

// acc0 and acc1 [M][16] = x[M, K] @ the panels wp0 and wp1 (see the header: two panels share
// each broadcast of x). One row streams the weights and keeps tile_one's four chains per panel.
// Every row tile converts the weights in registers as it reads them (after the first tile, from
// L2): converting a K-block once into a scratch copy for all row tiles, as panel() does, was
// slower on a Zen 4 EPYC at every batch from 16 to 1,024 rows (0.86-0.96x oneDNN's bf16 GEMM at
// 64-256 rows against 1.00-1.02x; the dot products, not the permutes, bound the loop).
template <typename Tag>
void panel_pair(const uint16_t* x, int64_t m, int64_t k, const typename Tag::T* wp0,
                const typename Tag::T* wp1, float* acc0, float* acc1, uint16_t* scratch) {
  if (m == 1) {
    panel<Tag>(x, m, k, wp0, acc0, scratch);
    panel<Tag>(x, m, k, wp1, acc1, scratch);
    return;
  }
  const int64_t pairs = k / 2;
  const auto load0 = [wp0](int64_t i) { return pair_row(Tag{}, wp0 + 2 * i * kCols); };
  const auto load1 = [wp1](int64_t i) { return pair_row(Tag{}, wp1 + 2 * i * kCols); };
  for (int64_t m0 = 0; m0 < m; m0 += kPairRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kPairRows, m - m0));
    with_rows<kPairRows>(rows, [&](auto r) {
      tile_pair<decltype(r)::value>(x + m0 * k, k, pairs, load0, load1, acc0 + m0 * kCols,
                                    acc1 + m0 * kCols, false);
    });
  }
}

// -- int8 weights in the W8A8 group layout, many rows ----------------------------------------
// Int8 weight-only layers keep one packed copy, in gemm_i8.cpp's group layout
// [ceil(N/16)][ceil(K/4)][16 columns][4 k] (64 bytes per group), which the split planes read.
// Those double the integer rows, so at a prefill's hundreds of rows they ran at about 0.8x of
// bf16's vdpbf16ps here (a Zen 4 EPYC without AMX). Converted once per K-block into bf16 pair
// rows (int8 is exact in bf16) and shared by every row tile, the same weights run at ~0.97x of
// the bf16 rate (benchmarks/linear_cpu.py). The conversion costs about what one row tile's dot
// products cost, so this pays from a few row tiles on; few rows stay on the split planes
// (gemm_i8.cpp decides).

// 32 int8 -> 32 bf16 in the same order.
inline __m512i bf16_of_int8(__m256i b) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // lo in the low half
}

// One group (16 columns x k..k+3, column-major in 4-byte lanes) as the pair rows (k, k+1) and
// (k+2, k+3): the low and the high 16 bits of every lane, narrowed in order.
inline void group_pair_rows(const int8_t* group, __m512i* first, __m512i* second) {
  const __m512i v = _mm512_loadu_si512(group);
  *first = bf16_of_int8(_mm512_cvtepi32_epi16(v));
  *second = bf16_of_int8(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
}

constexpr int64_t kGroupBytes = 64;
// Pairs of k per converted block: two panels x 128 pair rows x 64 bytes = 16 KiB, in L1 while
// every row tile reads it.
constexpr int64_t kGroupBlockPairs = 128;

// Pair rows [p0, p0 + pc) of one group-layout panel into scratch (p0 even: whole groups).
inline void groups_to_pairs(const int8_t* panel, int64_t p0, int64_t pc, uint16_t* scratch) {
  for (int64_t i = 0; i < pc; i += 2) {
    __m512i first, second;
    group_pair_rows(panel + (p0 + i) / 2 * kGroupBytes, &first, &second);
    _mm512_storeu_si512(scratch + i * kPairWords, first);
    if (i + 1 < pc) _mm512_storeu_si512(scratch + (i + 1) * kPairWords, second);
  }
}

// acc0 (and acc1) [M][16] = x[M, K] (bf16, K even) @ the group-layout panels wp0 (and wp1;
// nullptr for an odd last panel); scratch holds 2 * kGroupBlockPairs pair rows.
inline void panel_pair_groups(const uint16_t* x, int64_t m, int64_t k, const int8_t* wp0,
                              const int8_t* wp1, float* acc0, float* acc1, uint16_t* scratch) {
  const int64_t pairs = k / 2;
  uint16_t* s0 = scratch;
  uint16_t* s1 = scratch + kGroupBlockPairs * kPairWords;
  const auto load0 = [s0](int64_t i) { return _mm512_loadu_si512(s0 + i * kPairWords); };
  const auto load1 = [s1](int64_t i) { return _mm512_loadu_si512(s1 + i * kPairWords); };
  for (int64_t p0 = 0; p0 < pairs; p0 += kGroupBlockPairs) {
    const int64_t pc = std::min(kGroupBlockPairs, pairs - p0);
    const bool accumulate = p0 > 0;
    groups_to_pairs(wp0, p0, pc, s0);
    if (wp1 == nullptr) {
      for (int64_t m0 = 0; m0 < m; m0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, m - m0));
        tile_rows(rows, x + m0 * k + 2 * p0, k, pc, load0, acc0 + m0 * kCols, accumulate);
      }
      continue;
    }
    groups_to_pairs(wp1, p0, pc, s1);
    for (int64_t m0 = 0; m0 < m; m0 += kPairRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kPairRows, m - m0));
      with_rows<kPairRows>(rows, [&](auto r) {
        tile_pair<decltype(r)::value>(x + m0 * k + 2 * p0, k, pc, load0, load1,
                                      acc0 + m0 * kCols, acc1 + m0 * kCols, accumulate);
      });
    }
  }
}

}  // namespace pagedllm::gemm::dp
#endif  // __AVX512BF16__
