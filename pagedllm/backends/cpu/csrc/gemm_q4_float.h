// The float paths of the group-wise GEMM (gemm_q4.cpp): float activations times 4- or 8-bit
// group weights (gemm_q4_layout.h), float32 sums, no rounding of the activations.
//
// float32 activations (every ISA level): each weight is dequantised exactly as the definition
// does (q * scale + offset, float32) and multiplied in float32 FMAs, so results differ from
// dequantize_layer + F.linear only by summation order. Few rows (decode) dequantise in
// registers as the panel streams by; many rows dequantise a K-block of two panels once into
// a float32 scratch that every row tile reads (f32_block + f32_tile).
//
// bf16 activations (avx512bf16 builds): vdpbf16ps on q itself, exact in bf16, one float32 sum
// per group and row (two for Q6_K's two scales: one per 16 k), then y += scale * sum +
// offset * sum_k(x) per group. A 4-bit q becomes
// bf16 by a table look-up (vpermw over the 16 values), Q6_K's (int8 or six) by vpermi2w over
// its 64; a Q8_0 q through float32, as in gemm_dp.h. Only the rounding of float32 sums differs
// from the definition.
#pragma once

#include <algorithm>
#include <cstdint>

#include "gemm_dp.h"
#include "gemm_q4_layout.h"

namespace pagedllm::gemm::q4 {

// -- float32 activations ------------------------------------------------------------------------
#if defined(__AVX512F__)
constexpr int kF32Rows = 8;  // decode tile: 8 accumulators + 8 weight rows + scale, offset
constexpr int kTileRows = 8;  // prefill tile: 8 rows x 2 panels = 16 accumulators
constexpr int kTilePanels = 2;
#elif defined(__AVX2__)
constexpr int kF32Rows = 4;   // 2 ymm per row of 16 columns
constexpr int kTileRows = 6;  // as gemm.cpp: 12 ymm accumulators, one panel
constexpr int kTilePanels = 1;
#else
constexpr int kF32Rows = 4;
constexpr int kTileRows = 4;
constexpr int kTilePanels = 1;
#endif

// c[R][16] = x[R, 0:32 * groups] @ one panel, dequantised in registers. With few rows the
// FMAs of one row would wait on each other: C independent chains over k keep them busy.
template <int Bits, int R>
inline void f32_rows(const float* x, int64_t ldx, const uint8_t* panel, int64_t groups,
                     const Format& f, float* c) {
  constexpr int C = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  constexpr int kRowsPerChunk = Bits == 4 ? 8 : 4;
  V16 t[C][R];
  for (auto& chain : t)
    for (V16& v : chain) v = v_zero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + f.block_offset(g);
    prefetch_group(panel, g, f);
    V16 s, o;
    group_scales(panel, g, f, &s, &o);
    const float* xg = x + g * kGroup;
#if defined(PAGEDLLM_Q4_SIX)
    if (Bits == 8 && f.six()) {
      for (int h = 0; h < 2; ++h) {
        V16 w[16];
        six_rows(block + h * Format::kSixHalf, h == 0 ? s : o, w);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i)
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            t[i % C][r] = v_fma(t[i % C][r], w[i], xg[r * ldx + 16 * h + i]);
      }
      continue;
    }
#endif
    for (int ch = 0; ch < kGroup / kRowsPerChunk; ++ch) {
      V16 q[kRowsPerChunk];
      if constexpr (Bits == 4)
        int4_rows(block + ch * kChunk, q, f.levels);
      else
        int8_rows(block + ch * kChunk, q);
      const V16 sc = Bits == 8 && f.two_scales() && ch >= 4 ? o : s;  // Q6_K: k 16..31
#pragma GCC unroll 8
      for (int i = 0; i < kRowsPerChunk; ++i) {
        const V16 w = Bits == 4 || f.with_offset ? v_fmav(o, q[i], s) : v_mul(q[i], sc);
        const int64_t k = ch * kRowsPerChunk + i;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) t[i % C][r] = v_fma(t[i % C][r], w, xg[r * ldx + k]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    V16 sum = t[0][r];
    for (int i = 1; i < C; ++i) sum = v_add(sum, t[i][r]);
    v_store(c + r * kCols, sum);
  }
}

// Groups [g0, g0 + gc) of one panel, dequantised into out[32 * gc][16] float32.
inline void f32_block(const uint8_t* panel, int64_t g0, int64_t gc, const Format& f, float* out) {
  for (int64_t g = 0; g < gc; ++g) {
    V16 w[kGroup];
    dequantize_block(panel, g0 + g, f, w);
    for (int i = 0; i < kGroup; ++i) v_store(out + (g * kGroup + i) * kCols, w[i]);
  }
}

// c_p[R][16] (+)= x[R, 0:kc] @ w_p[kc][16] for the P dequantised panels w_p = w + p * ldw.
template <int R, int P>
inline void f32_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t kc,
                     float* c, int64_t ldc, bool accumulate) {
  V16 acc[P][R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      acc[p][r] = accumulate ? v_load(c + p * ldc + r * kCols) : v_zero();
  for (int64_t k = 0; k < kc; ++k) {
    V16 wv[P];
    for (int p = 0; p < P; ++p) wv[p] = v_load(w + p * ldw + k * kCols);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      for (int p = 0; p < P; ++p) acc[p][r] = v_fma(acc[p][r], wv[p], xv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) v_store(c + p * ldc + r * kCols, acc[p][r]);
}

#if defined(__AVX512BF16__)
// -- bf16 activations: vdpbf16ps on q ------------------------------------------------------------
constexpr int kBf16Rows = 8;      // decode tile: 8 group sums + 8 totals
constexpr int kBf16TileRows = 6;  // prefill tile: 6 rows x 2 panels x (group sum, total)

// bf16 bits of i & 15 (the look-up table of a 4-bit q; vpermw reads 5 index bits), of
// (i & 15) - 8: a layer whose offsets are all -8 * scale (Q4_0) multiplies q - 8, exact in
// bf16 too, and needs no offset term, and of the IQ4 levels (kIq4Levels, exact in bf16).
alignas(64) inline constexpr uint16_t kBf16OfNibble[3][32] = {
    {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
     0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
     0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
     0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170},
    {0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
     0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
     0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
     0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0},
    {0xC2FE, 0xC2D0, 0xC2A6, 0xC282, 0xC244, 0xC20C, 0xC1B0, 0xC120,
     0x3F80, 0x4150, 0x41C8, 0x4218, 0x4254, 0x428A, 0x42B2, 0x42E2,
     0xC2FE, 0xC2D0, 0xC2A6, 0xC282, 0xC244, 0xC20C, 0xC1B0, 0xC120,
     0x3F80, 0x4150, 0x41C8, 0x4218, 0x4254, 0x428A, 0x42B2, 0x42E2}};

// Whether bf16 x multiplies q - 8 (no offsets stored: Q4_0; or an IQ4 level) instead of q and
// the offsets.
inline bool centred(const Format& f) { return f.bits == 4 && !f.with_offset; }
// Which of kBf16OfNibble's tables a 4-bit layer's q read through.
inline int nibble_table(const Format& f) { return f.levels ? 2 : (centred(f) ? 1 : 0); }
// vpshufb controls: bytes (0, 1) / (2, 3) of every dword to its two words, zero-extended.
alignas(16) inline constexpr int8_t kPairCtl[2][16] = {
    {0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1},
    {2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1}};

// A 4-bit chunk as 4 pair rows of bf16 q (k = 8c + 2i and 8c + 2i + 1 per column, as
// vdpbf16ps pairs them): the low nibbles of bytes (0, 1), (2, 3), then the high ones.
inline void int4_pairs(const uint8_t* chunk, int which, __m512i out[4]) {
  const __m512i table = _mm512_load_si512(kBf16OfNibble[which]);
  const __m512i v = _mm512_loadu_si512(chunk);
  const auto ctl = [](int i) {
    return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kPairCtl[i])));
  };
  const __m512i a = _mm512_shuffle_epi8(v, ctl(0)), b = _mm512_shuffle_epi8(v, ctl(1));
  out[0] = _mm512_permutexvar_epi16(a, table);
  out[1] = _mm512_permutexvar_epi16(b, table);
  out[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(a, 4), table);
  out[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
}

// A Q6_K chunk (int8 q in -32..31) as its 2 pair rows: bytes (0, 1) and (2, 3) of every dword
// zero-extended to words, then looked up (vpermi2w over the 64 values). 4 instructions where
// the general int8 conversion (through float32) takes ~14: the 1-row decode of a 1B head was
// bound by them on 2 threads of a Zen 4 EPYC (slower than its bf16 weights).
inline void int6_pairs(const uint8_t* chunk, __m512i out[2]) {
  const __m512i lo = _mm512_load_si512(kBf16OfSix), hi = _mm512_load_si512(kBf16OfSix + 32);
  const __m512i v = _mm512_loadu_si512(chunk);
  for (int i = 0; i < 2; ++i) {
    const __m512i ctl =
        _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kPairCtl[i])));
    out[i] = _mm512_permutex2var_epi16(lo, _mm512_shuffle_epi8(v, ctl), hi);
  }
}

// bf16 bits of 16 * (i & 15) as a signed nibble (-128..112): the high part of an int8 q.
alignas(64) inline constexpr uint16_t kBf16OfHighNibble[32] = {
    0x0000, 0x4180, 0x4200, 0x4240, 0x4280, 0x42A0, 0x42C0, 0x42E0,
    0xC300, 0xC2E0, 0xC2C0, 0xC2A0, 0xC280, 0xC240, 0xC200, 0xC180,
    0x0000, 0x4180, 0x4200, 0x4240, 0x4280, 0x42A0, 0x42C0, 0x42E0,
    0xC300, 0xC2E0, 0xC2C0, 0xC2A0, 0xC280, 0xC240, 0xC200, 0xC180};

// An 8-bit chunk (two pair rows) as four, q = 16 * high + low: low (0..15) and 16 * high
// (signed) of pair row 0, then of pair row 1, each exact in bf16. Two vpshufb, a shift and four
// vpermw where the conversion through float32 takes ~12 shuffle-port instructions: at one row
// each converted weight is used once, and a Q8_0 gate/up layer from cache ran 1.415 -> 1.215 ms
// on a Xeon; the two halves cost a second vdpbf16ps per pair row instead.
inline void int8_split_pairs(const uint8_t* chunk, __m512i out[4]) {
  const __m512i low = _mm512_load_si512(kBf16OfNibble[0]);
  const __m512i high = _mm512_load_si512(kBf16OfHighNibble);
  const __m512i v = _mm512_loadu_si512(chunk);
  for (int i = 0; i < 2; ++i) {
    const __m512i ctl =
        _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kPairCtl[i])));
    const __m512i words = _mm512_shuffle_epi8(v, ctl);  // bytes zero-extended: index bits 0-7
    out[2 * i] = _mm512_permutexvar_epi16(words, low);   // vpermw reads bits 0-4; table repeats
    out[2 * i + 1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), high);
  }
}

// Pair rows of one chunk: 4 (4-bit) or 2 (8-bit, exact in bf16 through float32; Q6_K's 6-bit
// values by a look-up).
template <int Bits>
inline void chunk_pairs(const uint8_t* chunk, const Format& f, __m512i out[4]) {
  if constexpr (Bits == 4)
    int4_pairs(chunk, nibble_table(f), out);
  else if (f.two_scales())
    int6_pairs(chunk, out);
  else
    dp::group_pair_rows(reinterpret_cast<const int8_t*>(chunk), &out[0], &out[1]);
}

template <int Bits>
constexpr int kPairsPerChunk = Bits == 4 ? 4 : 2;

// acc + w . the pair (x[0], x[1]) broadcast by the instruction itself ({1to16}). GCC builds
// dp::x_pair's broadcast through a general register; from memory the decode tile ran 20-25%
// faster on a Zen 4 EPYC (38 against 48 cycles per block at one row, 150 against 186 at 8).
inline __m512 dot2(__m512 acc, __m512i w, const uint16_t* x) {
  const auto& pair = *reinterpret_cast<const int32_t*>(x);
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(pair));
  return acc;
}

// c[R][16] = x[R, 0:32 * groups] (bf16) @ one panel; xs[r * ldxs + g] = sum of row r's group g.
template <int Bits, int R>
inline void bf16_rows(const uint16_t* x, int64_t ldx, const float* xs, int64_t ldxs,
                      const uint8_t* panel, int64_t groups, const Format& f, float* c) {
  constexpr int C = R >= 4 ? 1 : (R >= 2 ? 2 : 4);
  constexpr int kP = kPairsPerChunk<Bits>;
  const bool offsets = f.with_offset;
  const bool two = Bits == 8 && f.two_scales();
  constexpr int kChunks = kGroup / (2 * kP);
  constexpr bool kSplit = Bits == 8 && R == 1;
  __m512 t[R];
  for (auto& v : t) v = _mm512_setzero_ps();
  __m512 a[C][R];
  // t += the chains' sums times `scale` (per group, or per 16 k with two scales), chains reset.
  const auto flush = [&](const V16& scale) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 sum = a[0][r];
      for (int i = 1; i < C; ++i) sum = _mm512_add_ps(sum, a[i][r]);
      t[r] = _mm512_fmadd_ps(sum, scale.v, t[r]);
      for (auto& chain : a) chain[r] = _mm512_setzero_ps();
    }
  };
  for (auto& chain : a)
    for (auto& v : chain) v = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + f.block_offset(g);
    const uint16_t* xg = x + g * kGroup;
    prefetch_group(panel, g, f);
    V16 s, o;
    group_scales(panel, g, f, &s, &o);
    if (Bits == 8 && f.six()) {  // two half groups of 8 pair rows, one scale each
      for (int h = 0; h < 2; ++h) {
        __m512i w[8];
        six_pairs(block + h * Format::kSixHalf, w);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i)
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            a[i % C][r] = dot2(a[i % C][r], w[i], xg + r * ldx + 16 * h + 2 * i);
        flush(h == 0 ? s : o);
      }
      continue;
    }
    for (int ch = 0; ch < kChunks; ++ch) {
      __m512i w[4];
      if (kSplit && !two) {  // one row of an 8-bit layer: q as its two nibbles
        int8_split_pairs(block + ch * kChunk, w);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
          a[i % C][0] = dot2(a[i % C][0], w[i], xg + 2 * (ch * kP + i / 2));
        continue;
      }
      chunk_pairs<Bits>(block + ch * kChunk, f, w);
#pragma GCC unroll 4
      for (int i = 0; i < kP; ++i) {
        const int64_t k = 2 * (ch * kP + i);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) a[i % C][r] = dot2(a[i % C][r], w[i], xg + r * ldx + k);
      }
      if (two && ch == kChunks / 2 - 1) flush(s);  // k 0..15 done: their scale
    }
    flush(two ? o : s);
    if (offsets)
      for (int r = 0; r < R; ++r)
        t[r] = _mm512_fmadd_ps(o.v, _mm512_set1_ps(xs[r * ldxs + g]), t[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + r * kCols, t[r]);
}

// acc + w * x[0] (x broadcast by the instruction itself, as dot2 does for its pairs).
inline __m512 fma_bcast(__m512 acc, __m512 w, const float* x) {
  __asm__("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

// bf16_rows for 4-bit layers on float32 FMAs: x (bf16 rows widened to float32, exact) times q
// itself (0..15 or an IQ4 level, exact), one float32 sum per group and row, then the same
// y += scale * sum + offset * sum_k(x) per group. Products are exact both ways, so this differs
// from bf16_rows only in the order of its float32 sums. Why a second kernel: on Intel's cores
// (measured on a Xeon with AMX, 2026-12-05) vdpbf16ps takes ~2.2 cycles of the vector ports
// (an FMA 0.5), and the one-row Q4_K kernel ran 93 cycles a group of 512 weights against 80
// here (2 rows 125 / 105, 4 rows 200 / 147, 8 rows 378 / 295); on a Zen 4 EPYC vdpbf16ps
// issues about once a cycle and bf16_rows was tuned there. bf16_rows_kernel() chooses.
template <int R>
inline void bf16_rows_fma(const float* x, int64_t ldx, const float* xs, int64_t ldxs,
                          const uint8_t* panel, int64_t groups, const Format& f, float* c) {
  constexpr int C = R >= 4 ? 1 : (R >= 2 ? 2 : 4);  // independent sums per row, as bf16_rows
  const bool offsets = f.with_offset || !f.levels;   // Q4_0's offset is -8 * scale
  __m512 t[R];
  for (auto& v : t) v = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + f.block_offset(g);
    prefetch_group(panel, g, f);
    const float* xg = x + g * kGroup;
    __m512 a[C][R];
    for (auto& chain : a)
      for (auto& v : chain) v = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int ch = 0; ch < kGroup / 8; ++ch) {
      V16 q[8];
      int4_rows(block + ch * kChunk, q, f.levels);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const int j = (ch * 8 + i) % C;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) a[j][r] = fma_bcast(a[j][r], q[i].v, xg + r * ldx + ch * 8 + i);
      }
    }
    V16 s, o;
    group_scales(panel, g, f, &s, &o);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 sum = a[0][r];
      for (int i = 1; i < C; ++i) sum = _mm512_add_ps(sum, a[i][r]);
      t[r] = _mm512_fmadd_ps(sum, s.v, t[r]);
      if (offsets) t[r] = _mm512_fmadd_ps(o.v, _mm512_set1_ps(xs[r * ldxs + g]), t[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + r * kCols, t[r]);
}

// Groups [g0, g0 + gc) of one panel as bf16 pair rows (pairs[g][16][32]) and float32 scales
// and offsets (so[g] = 16 scales then 16 offsets; two-scale: the scales of k 0..15, 16..31).
template <int Bits>
inline void bf16_block(const uint8_t* panel, int64_t g0, int64_t gc, const Format& f,
                       uint16_t* pairs, float* so) {
  constexpr int kP = kPairsPerChunk<Bits>;
  for (int64_t g = 0; g < gc; ++g) {
    const uint8_t* block = panel + f.block_offset(g0 + g);
    prefetch_group(panel, g0 + g, f);
    if (Bits == 8 && f.six()) {  // pair rows 0-7 of k 0..15, then 8-15 of k 16..31
      for (int h = 0; h < 2; ++h) {
        __m512i w[8];
        six_pairs(block + h * Format::kSixHalf, w);
        for (int i = 0; i < 8; ++i)
          _mm512_storeu_si512(pairs + (g * 16 + h * 8 + i) * dp::kPairWords, w[i]);
      }
    } else {
      for (int ch = 0; ch < kGroup / (2 * kP); ++ch) {
        __m512i w[4];
        chunk_pairs<Bits>(block + ch * kChunk, f, w);
        for (int i = 0; i < kP; ++i)
          _mm512_storeu_si512(pairs + (g * 16 + ch * kP + i) * dp::kPairWords, w[i]);
      }
    }
    V16 s, o;
    group_scales(panel, g0 + g, f, &s, &o);
    _mm512_storeu_ps(so + g * 2 * kCols, s.v);
    _mm512_storeu_ps(so + g * 2 * kCols + kCols, o.v);
  }
}

// c0, c1 [R][16] (+)= x[R, 0:32 * gc] @ two converted panels (bf16_block): per group and row
// a vdpbf16ps sum, then scale and (offsets) offset. 6 rows: 24 accumulators, 2 weights, 4
// scales. Measured from L1 on a Zen 4 EPYC: ~0.9 vdpbf16ps per cycle, conversion included.
// Two-scale panels (Q6_K) scale each half group's sums: bf16_tile_halves.
template <int R>
inline void bf16_tile(const uint16_t* x, int64_t ldx, const float* xs, int64_t ldxs,
                      const uint16_t* w0, const uint16_t* w1, const float* so0, const float* so1,
                      int64_t gc, bool offsets, float* c0, float* c1, bool accumulate) {
  __m512 t0[R], t1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    t0[r] = accumulate ? _mm512_loadu_ps(c0 + r * kCols) : _mm512_setzero_ps();
    t1[r] = accumulate ? _mm512_loadu_ps(c1 + r * kCols) : _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < gc; ++g) {
    __m512 a0[R], a1[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    const uint16_t* xg = x + g * kGroup;
    for (int i = 0; i < 16; ++i) {
      const __m512i v0 = _mm512_loadu_si512(w0 + (g * 16 + i) * dp::kPairWords);
      const __m512i v1 = _mm512_loadu_si512(w1 + (g * 16 + i) * dp::kPairWords);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        a0[r] = dot2(a0[r], v0, xg + r * ldx + 2 * i);
        a1[r] = dot2(a1[r], v1, xg + r * ldx + 2 * i);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(so0 + g * 2 * kCols);
    const __m512 o0 = _mm512_loadu_ps(so0 + g * 2 * kCols + kCols);
    const __m512 s1 = _mm512_loadu_ps(so1 + g * 2 * kCols);
    const __m512 o1 = _mm512_loadu_ps(so1 + g * 2 * kCols + kCols);
    if (offsets) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xsv = _mm512_set1_ps(xs[r * ldxs + g]);
        t0[r] = _mm512_fmadd_ps(o0, xsv, _mm512_fmadd_ps(a0[r], s0, t0[r]));
        t1[r] = _mm512_fmadd_ps(o1, xsv, _mm512_fmadd_ps(a1[r], s1, t1[r]));
      }
    } else {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        t0[r] = _mm512_fmadd_ps(a0[r], s0, t0[r]);
        t1[r] = _mm512_fmadd_ps(a1[r], s1, t1[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c0 + r * kCols, t0[r]);
    _mm512_storeu_ps(c1 + r * kCols, t1[r]);
  }
}
// bf16_tile for two-scale panels (no offsets): a sum per 16 k, scaled by so[g][0:16] for
// k 0..15 and so[g][16:32] for k 16..31.
template <int R>
inline void bf16_tile_halves(const uint16_t* x, int64_t ldx, const uint16_t* w0,
                             const uint16_t* w1, const float* so0, const float* so1, int64_t gc,
                             float* c0, float* c1, bool accumulate) {
  __m512 t0[R], t1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    t0[r] = accumulate ? _mm512_loadu_ps(c0 + r * kCols) : _mm512_setzero_ps();
    t1[r] = accumulate ? _mm512_loadu_ps(c1 + r * kCols) : _mm512_setzero_ps();
  }
  for (int64_t h = 0; h < 2 * gc; ++h) {  // half groups of 16 k: 8 pair rows each
    __m512 a0[R], a1[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    const uint16_t* xh = x + h * (kGroup / 2);
    for (int i = 0; i < 8; ++i) {
      const __m512i v0 = _mm512_loadu_si512(w0 + (h * 8 + i) * dp::kPairWords);
      const __m512i v1 = _mm512_loadu_si512(w1 + (h * 8 + i) * dp::kPairWords);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        a0[r] = dot2(a0[r], v0, xh + r * ldx + 2 * i);
        a1[r] = dot2(a1[r], v1, xh + r * ldx + 2 * i);
      }
    }
    const __m512 s0 = _mm512_loadu_ps(so0 + h * kCols), s1 = _mm512_loadu_ps(so1 + h * kCols);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      t0[r] = _mm512_fmadd_ps(a0[r], s0, t0[r]);
      t1[r] = _mm512_fmadd_ps(a1[r], s1, t1[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c0 + r * kCols, t0[r]);
    _mm512_storeu_ps(c1 + r * kCols, t1[r]);
  }
}
#endif  // __AVX512BF16__

}  // namespace pagedllm::gemm::q4
