// Few rows of bf16 / fp16 x on AVX2 without AVX-512 (decode): float32 FMAs on q itself, one
// float32 sum per group, column and row, then y += scale * sum + offset * sum_k(x) per group,
// as bf16_rows_fma does on AVX-512 (gemm_q4_float.h). bf16 and fp16 x widen to float32
// exactly and q * x is exact (4 or 8 significant bits times 8 or 11), so results differ from
// the definition (dequantise, then multiply) only in the rounding of float32 sums.
//
// Why: f32_rows dequantises every weight (q * scale + offset: an FMA) before its FMA with x,
// and on a Zen 1 EPYC (4 x 128-bit pipes, vcvtdq2ps on one of them) both FMAs and the
// conversion bound it: 2 FMAs and a conversion per 8 weights. Here one FMA per 8 weights
// remains, and q leaves its nibble in place: the dword masked (q * 16^t, an integer that
// float32 holds exactly) meets x * 16^-t, scaled once per call (xn), so a nibble costs an AND
// and a conversion, no shift or shuffle. Two of the eight nibbles skip vcvtdq2ps: OR-ed into
// 2^23's mantissa and 2^23 subtracted (exact), on the adder pipes, which unloads the one that
// converts. Measured on the Zen 1 EPYC (2 GHz, one thread, 960 x 576 Q4_1 from L2): 192 ->
// 125 cycles a group of 16 columns at one row, 296 -> 187 at two, 383 -> 310 at four.
// 8-bit layers (Q8_0, Q5_K's plain form, Q6_K's two scales: a part's sums per scale): byte b
// shifted to the top of its dword and masked, q * 2^24 exactly, the 2^-24 folded into the
// group's scale.
//
// The int16 kernel (avx2_i16_rows, the default for bf16 x: gemm_q4.cpp's kSplit) rounds x
// instead, finely enough to leave bf16 x as it is: per row and group of 32,
// s = 2^(floor(log2(max|x|)) - 14) and xi = round_half_even(x / s), so |xi| < 2^15 and every
// bf16 element within 2^7 of the group's largest (8 significant bits) is exactly xi * s;
// smaller ones are off by at most s / 2 <= 2^-15 of the largest. Then, exactly in int32,
// sum_k q * xi per group, column and row (vpmaddwd: 16 products and 8 pair sums per
// instruction against 8 FMAs per FMA), and in float32 per group
//   y += (scale * s) * sum + offset * (s * sum_k xi)
// (scale * s exact: a power of two; Q4_0's offset -8 * scale). So y is the definition's
// dequantised W times the rounded x up to float32 sums: for bf16 x within far less than its
// own rounding. fp16 x (11 significant bits) keeps the float kernel: the grid would round
// elements below 2^-4 of the largest, which its outputs resolve. Nibbles become int16 lanes
// shifted down and masked ((v >> 4j) & 0x000F000F: nibbles j and j + 4 of each dword, never
// masked in place at bits 12-15, which would read as negative; nibble pair 3, 7 is one 16-bit
// shift), bytes by 16-bit shifts that sign-extend. Measured on a Zen 3 EPYC (one thread, 960 x
// 576 from L2, a loaded 2-core VM): one row of a 4-bit layer 1.7x the float kernel, two 1.4x,
// 8-bit 1.3x and 1.25x; at three and four rows the two are within 10% (vpmaddwd's rate bounds
// it there).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "gemm_q4_layout.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
#define PAGEDLLM_Q4_AVX2_ROWS 1

namespace pagedllm::gemm::q4 {

constexpr int64_t kAvx2Rows = 4;  // up to this many rows per kernel call
// Up to this many rows a GEMM runs the kernels below on each panel in chunks of kAvx2Rows
// (the panel's later chunks read it from L1), past them the int16 tiles
// (gemm_q4_avx2_tiles.h). Measured on a Zen 3 EPYC (two threads, 1B Q4_0 and Q4_K q/k/v,
// gate/up and down from memory, interleaved): chunks over tiles 1.16-1.64x at 5-16 rows,
// 0.96-1.14x at 24-64, 0.89-1.09x at 256 (the tiles' one widening of q per K-block pays off
// only there).
constexpr int64_t kAvx2ChunkedRows = 16;

// Whether the float kernel below (avx2_rows: fp16 x, kDp / kFma, x with an inf or a NaN) runs a
// layer of format f (IQ4 levels: no, its nibbles are read in place; such calls take run_f32).
// The int16 kernel and the int16 tiles of many rows (gemm_q4_avx2_tiles.h) run every format.
inline bool avx2_rows_format(const Format& f) { return !f.levels; }

// The q width a kernel is instantiated for: 4, 8, or 6 for Q6_K's six blocks (8-bit layers
// that f.six() marks: the 8-bit entry points' Bits).
template <int Bits>
PAGEDLLM_Q4_INLINE int kernel_bits(const Format& f) {
  return Bits == 8 && f.six() ? 6 : Bits;
}

// A group's sums in parts of its chunks: Q6_K's two scales (k 0..15: chunks 0-3, k 16..31:
// chunks 4-7, group_scales' *scale and *offset) take two parts, every other format one.
template <bool Halves>
constexpr int kParts = Halves ? 2 : 1;

// Nibble t (0..7) of a 4-bit chunk's dword holds k = t / 2 + 4 * (t % 2) of the chunk's 8.
PAGEDLLM_Q4_INLINE int nibble_k(int t) { return t / 2 + 4 * (t % 2); }

// Nibbles read through 2^23 instead of vcvtdq2ps (bit t: nibble t; only t <= 4 fit 23 bits).
constexpr int kMagicNibbles = 0x5;

// One row of x [K] as the 4-bit kernel reads it: per chunk of 8 k, in nibble order, each
// times 16^-t (nibble 7 is shifted down: times 1), exact (a power of two; x bf16 or fp16);
// and per group the sum of its 32 x (for the offsets).
template <typename X>
inline void avx2_x_rows(const X* x, int64_t k, int bits, float* xn, float* gsum) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const X* xg = x + g * kGroup;
    float sum = 0.f;
    for (int i = 0; i < kGroup; ++i) sum += static_cast<float>(xg[i]);
    gsum[g] = sum;
    for (int ch = 0; bits == 4 && ch < 4; ++ch)
      for (int t = 0; t < 8; ++t) {
        const float scale = t == 7 ? 1.f : 1.f / static_cast<float>(1 << (4 * t));
        xn[g * kGroup + 8 * ch + t] = static_cast<float>(xg[8 * ch + nibble_k(t)]) * scale;
      }
    for (int i = 0; bits != 4 && i < kGroup; ++i) xn[g * kGroup + i] = static_cast<float>(xg[i]);
  }
}

// Nibble t of 8 columns' dwords as float32 q * 16^t (q for t = 7).
template <int T>
PAGEDLLM_Q4_INLINE __m256 nibble_floats(__m256i v) {
  if constexpr (T == 7) {
    return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 28));
  } else if constexpr ((kMagicNibbles >> T) & 1) {
    const __m256i q = _mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * T)));
    const __m256 big = _mm256_castsi256_ps(_mm256_or_si256(q, _mm256_set1_epi32(0x4B000000)));
    return _mm256_sub_ps(big, _mm256_set1_ps(8388608.f));  // 2^23 + q * 16^t, exact, minus 2^23
  } else {
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * T))));
  }
}

// Byte b of 8 columns' dwords as float32 q * 2^24 (signed q; lower bytes shifted out or
// masked off).
template <int B>
PAGEDLLM_Q4_INLINE __m256 byte_floats(__m256i v) {
  if constexpr (B == 0) return _mm256_cvtepi32_ps(_mm256_slli_epi32(v, 24));
  const __m256i top = B == 3 ? v : _mm256_slli_epi32(v, 24 - 8 * B);
  return _mm256_cvtepi32_ps(_mm256_and_si256(top, _mm256_set1_epi32(-16777216)));
}

// a[r] += one six half group's q times row r's x of it (xc: its 16 k), in float32: each pair
// row's int16 lanes (six_word) split into its even and odd k, on alternate chains.
template <int R, int C, int... P>
PAGEDLLM_Q4_INLINE void avx2_six_half(const uint8_t* half, const float* xc, int64_t ldx,
                                      __m256 a[C][R][2], std::integer_sequence<int, P...>) {
  const auto step = [&](auto p) {
    constexpr int kP = decltype(p)::value;
    const __m256i v0 = six_word<kP>(half, 0), v1 = six_word<kP>(half, 1);
    const __m256 e0 = six_even(v0), e1 = six_even(v1), o0 = six_odd(v0), o1 = six_odd(v1);
    __m256(*ae)[2] = a[(2 * kP) % C];
    __m256(*ao)[2] = a[(2 * kP + 1) % C];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 xe = _mm256_broadcast_ss(xc + r * ldx + 2 * kP);
      const __m256 xo = _mm256_broadcast_ss(xc + r * ldx + 2 * kP + 1);
      ae[r][0] = _mm256_fmadd_ps(e0, xe, ae[r][0]);
      ae[r][1] = _mm256_fmadd_ps(e1, xe, ae[r][1]);
      ao[r][0] = _mm256_fmadd_ps(o0, xo, ao[r][0]);
      ao[r][1] = _mm256_fmadd_ps(o1, xo, ao[r][1]);
    }
  };
  (step(std::integral_constant<int, P>{}), ...);
}

// a[r] += one chunk's q (8 columns per half, two halves) times row r's x of the chunk.
template <int Bits, int R, int I>
PAGEDLLM_Q4_INLINE void avx2_chunk_step(__m256i v0, __m256i v1, const float* xc, int64_t ldx,
                                        __m256 a[R][2]) {
  __m256 w0, w1;
  if constexpr (Bits == 4) {
    w0 = nibble_floats<I>(v0);
    w1 = nibble_floats<I>(v1);
  } else {
    w0 = byte_floats<I>(v0);
    w1 = byte_floats<I>(v1);
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 xb = _mm256_broadcast_ss(xc + r * ldx + I);
    a[r][0] = _mm256_fmadd_ps(w0, xb, a[r][0]);
    a[r][1] = _mm256_fmadd_ps(w1, xb, a[r][1]);
  }
}

template <int Bits, int R, int... I>
PAGEDLLM_Q4_INLINE void avx2_chunk(const uint8_t* chunk, const float* xc, int64_t ldx,
                                   __m256 a[R][2], std::integer_sequence<int, I...>) {
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32));
  (avx2_chunk_step<Bits, R, I>(v0, v1, xc, ldx, a), ...);
}

// c[R][16] = R rows of x @ one panel: xn, gsum from avx2_x_rows (row r at r * ldx, r * ldg).
// Halves: Q6_K's two scales, each part's sums scaled by its own (no offsets); Bits 6: its six
// blocks (gemm_q4_layout.h), a half group a part.
template <int Bits, int R, bool Halves>
PAGEDLLM_Q4_KERNEL void avx2_rows(const float* xn, int64_t ldx, const float* gsum, int64_t ldg,
                                  const uint8_t* panel, int64_t groups, const Format& f,
                                  float* c) {
  static_assert(!Halves || Bits != 4, "two scales: 8-bit layers only");
  static_assert(Bits != 6 || Halves, "six blocks: two scales");
  constexpr int kPer = Bits == 4 ? 8 : 4;  // k per chunk
  constexpr int kPartChunks = kGroup / kPer / kParts<Halves>;
  constexpr int C = R == 1 ? 2 : 1;        // independent sums per row: FMA latency
  // 8-bit q arrive times 2^24 (byte_floats): their scale takes the 2^-24 back, exactly.
  const __m256 unit = _mm256_set1_ps(Bits == 8 ? 1.f / 16777216.f : 1.f);
  __m256 t[R][2];
  for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + f.block_offset(g);
    prefetch_group(panel, g, f);
    const float* xg = xn + g * kGroup;
#pragma GCC unroll 2
    for (int part = 0; part < kParts<Halves>; ++part) {
      __m256 a[C][R][2];  // C chains: alternate chunks
      for (auto& chain : a)
        for (int r = 0; r < R; ++r) chain[r][0] = chain[r][1] = _mm256_setzero_ps();
      if constexpr (Bits == 6) {
        avx2_six_half<R, C>(block + part * Format::kSixHalf, xg + part * kGroup / 2, ldx, a,
                            std::make_integer_sequence<int, 8>{});
      } else {
#pragma GCC unroll 8
        for (int i = 0; i < kPartChunks; ++i) {
          const int ch = part * kPartChunks + i;
          avx2_chunk<Bits, R>(block + ch * kChunk, xg + ch * kPer, ldx, a[i % C],
                              std::make_integer_sequence<int, kPer>{});
        }
      }
      V16 s, o;  // loaded after the sums: live across them, they would spill at 4 rows
      group_scales(panel, g, f, &s, &o);
      const V16& sc = part == 0 ? s : o;
      const __m256 s0 = _mm256_mul_ps(sc.lo, unit), s1 = _mm256_mul_ps(sc.hi, unit);
      for (int r = 0; r < R; ++r) {
        __m256 sum0 = a[0][r][0], sum1 = a[0][r][1];
        for (int i = 1; i < C; ++i) {
          sum0 = _mm256_add_ps(sum0, a[i][r][0]);
          sum1 = _mm256_add_ps(sum1, a[i][r][1]);
        }
        t[r][0] = _mm256_fmadd_ps(sum0, s0, t[r][0]);
        t[r][1] = _mm256_fmadd_ps(sum1, s1, t[r][1]);
        if (!Halves && (Bits == 4 || f.with_offset)) {  // Q4_0's offset: -8 * scale
          const __m256 xs = _mm256_broadcast_ss(gsum + r * ldg + g);
          t[r][0] = _mm256_fmadd_ps(o.lo, xs, t[r][0]);
          t[r][1] = _mm256_fmadd_ps(o.hi, xs, t[r][1]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * kCols, t[r][0]);
    _mm256_storeu_ps(c + r * kCols + 8, t[r][1]);
  }
}

// -- int16 x: integer products (the default for bf16 / fp16 x) ---------------------------------
// Words of x per group of one row (int32 pairs of int16): 16 for either width.
constexpr int64_t kI16Words = kGroup / 2;

PAGEDLLM_Q4_INLINE float bf16_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One group of 32 bf16 (their bits) of avx2_i16_x_rows, element by element: where the group's
// scale 2^up is no normal float32 (max|x| below ~2^-112), and the definition the vectors below
// keep (the same values).
inline bool i16_x_group(const uint16_t* xg, int bits, int32_t* w, float* xs, float* gsum) {
  float v[kGroup], amax = 0.f;
  for (int i = 0; i < kGroup; ++i) {
    v[i] = bf16_float(xg[i]);
    if (!std::isfinite(v[i])) return false;  // (std::max would pass a NaN over)
    amax = std::max(amax, std::fabs(v[i]));
  }
  int e = 0;
  if (amax > 0.f) std::frexp(amax, &e);  // amax = f * 2^e, f in [0.5, 1): floor(log2) = e - 1
  const int up = amax > 0.f ? 15 - e : 0;  // x / s = x * 2^up
  int32_t q[kGroup];
  if (up >= -126 && up <= 127) {  // 2^up a normal float32: x * 2^up exact but for underflow
    const __m256 scale = _mm256_castsi256_ps(_mm256_set1_epi32((127 + up) << 23));
    for (int i = 0; i < kGroup; i += 8)  // vcvtps2dq rounds half to even (MXCSR's default)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                          _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), scale)));
  } else {
    for (int i = 0; i < kGroup; ++i)
      q[i] = static_cast<int32_t>(std::nearbyint(std::ldexp(v[i], up)));
  }
  int32_t sum = 0;
  for (int i = 0; i < kGroup; ++i) sum += q[i];
  const float s = std::ldexp(1.f, -up);
  *xs = s;
  *gsum = static_cast<float>(sum) * s;
  const auto pair = [&q](int lo, int hi) {
    return static_cast<int32_t>((static_cast<uint32_t>(q[lo]) & 0xFFFFu) |
                                static_cast<uint32_t>(q[hi]) << 16);
  };
  if (bits == 4) {
    // Word j of chunk ch: the int16 lanes of (dword >> 4j) & 0x000F000F hold nibbles j
    // and j + 4, k = nibble_k(j) and nibble_k(j + 4) of the chunk.
    for (int ch = 0; ch < 4; ++ch)
      for (int j = 0; j < 4; ++j)
        w[4 * ch + j] = pair(8 * ch + nibble_k(j), 8 * ch + nibble_k(j + 4));
  } else if (bits == 6) {
    // Six blocks: word j is pair row j % 8 of half group j / 8, k = 2j and 2j + 1.
    for (int j = 0; j < kI16Words; ++j) w[j] = pair(2 * j, 2 * j + 1);
  } else {
    // Chunk ch's dword holds k = 4ch + b in byte b: the even bytes (0, 2) sign-extended to
    // int16 lanes, then the odd ones (1, 3).
    for (int ch = 0; ch < 8; ++ch) {
      w[2 * ch] = pair(4 * ch, 4 * ch + 2);
      w[2 * ch + 1] = pair(4 * ch + 1, 4 * ch + 3);
    }
  }
  return true;
}

// i16_x_group's word order as vpshufb's byte indices within each 128-bit lane (8 k: a 4-bit
// chunk, or two 8-bit ones): 4-bit words (k0, k2), (k4, k6), (k1, k3), (k5, k7), that is
// nibbles j and j + 4; 8-bit (k0, k2), (k1, k3) per 4 k. Six blocks keep k's order.
PAGEDLLM_Q4_INLINE __m256i i16_word_order(int bits) {
  if (bits == 4)
    return _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8,
                            9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  return _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15, 0, 1, 4, 5, 2,
                          3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
}

PAGEDLLM_Q4_INLINE uint32_t hmax_u32(__m256i v) {
  __m128i t = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_max_epu32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_max_epu32(t, _mm_shuffle_epi32(t, 0xb1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(t));
}

PAGEDLLM_Q4_INLINE int32_t hsum_i32(__m256i v) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
  return _mm_cvtsi128_si32(t);
}

// One row of bf16 x [K] (their bits) as avx2_i16_rows reads it. Per group of 32:
// e = floor(log2(max|x|)), s = 2^(e - 14), xi = round_half_even(x / s) (|xi| <= 2^15 - 1:
// max|x| / s < 2^15, and the largest is an integer itself: 8 significant bits scaled by 2^7),
// stored as int16 pairs in the order the weights' words meet them; s and s * sum(xi) (exact
// in float32: |sum| < 2^20) per group. An all-zero group has s = 1. Returns false where x
// holds an inf or a NaN (the caller then runs the float kernel, which carries them as the
// definition does). In vectors (element by element it was ~0.6% of a 1B file's one-sequence
// step and 1.5% of a 64-sequence one): the largest |x| as an integer maximum of the bits (an
// inf or a NaN shows as 0x7f800000 or more), the sum in integer adds, the words packed to
// int16 and put in order by one vpshufb: i16_x_group's values.
inline bool avx2_i16_x_rows(const uint16_t* x, int64_t k, int bits, int32_t* xw, float* xs,
                            float* gsum) {
  const __m256i order = i16_word_order(bits), magnitude = _mm256_set1_epi32(0x7fffffff);
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const auto* p = reinterpret_cast<const __m128i*>(x + g * kGroup);
    __m256 v[4];
    __m256i top = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {  // bf16 is float32's top half: exact
      const __m256i b = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + i)), 16);
      v[i] = _mm256_castsi256_ps(b);
      top = _mm256_max_epu32(top, _mm256_and_si256(b, magnitude));
    }
    const uint32_t bits_max = hmax_u32(top);
    if (bits_max >= 0x7f800000u) return false;
    float amax;
    std::memcpy(&amax, &bits_max, sizeof amax);
    int e = 0;
    if (amax > 0.f) std::frexp(amax, &e);
    const int up = amax > 0.f ? 15 - e : 0;
    int32_t* w = xw + g * kI16Words;
    if (up < -126 || up > 127) {
      i16_x_group(x + g * kGroup, bits, w, xs + g, gsum + g);
      continue;
    }
    const __m256 scale = _mm256_castsi256_ps(_mm256_set1_epi32((127 + up) << 23));
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale));
    const int32_t sum =
        hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    const float s = std::ldexp(1.f, -up);
    xs[g] = s;
    gsum[g] = static_cast<float>(sum) * s;
    // vpackssdw interleaves the lanes (k 0-3, 8-11 | 4-7, 12-15): vpermq puts k in order;
    // |xi| < 2^15, so nothing saturates.
    __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8);
    __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
    if (bits != 6) {
      lo = _mm256_shuffle_epi8(lo, order);
      hi = _mm256_shuffle_epi8(hi, order);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + 8), hi);
  }
  return true;
}

// Whether a 4-bit kernel of R rows reads nibbles 1 and 5 in place (times 16) into sums of their
// own (b below), which saves their shift where the registers hold twice the sums (not IQ4
// levels: vpshufb looks up the low four bits).
template <int Bits, int R, bool Levels = false>
constexpr bool kInPlace16 = Bits == 4 && R <= 2 && !Levels;

// IQ4 levels as the int16 kernels read them: u = level + 127 (0..240, so level 0's -127 is 0),
// looked up by vpshufb in each 128-bit lane. A nibble lane's high byte is 0 and looks up u = 0
// too: the int16 lane is u itself, zero-extended, with no shift to sign-extend it. The sums are
// then sum_k u * xi, and the group's offset -127 * scale (gemm_q4_layout.h's group_scales gives
// the float kernels 0: their table holds the levels) takes the 127 back with the row's sum of
// x, as Q4_0's -8 * scale takes back its 8: |sum| <= 32 * 240 * 32767 < 2^28, exact in int32,
// rounded once to float32 (a relative 2^-24 of sum_k u * |xi|, float32 summation's own size).
PAGEDLLM_Q4_INLINE __m256i iq4_u_table() {
  return _mm256_setr_epi8(0, 23, 44, 62, 78, 92, 105, 117, -128, -116, -104, -91, -76, -60, -40,
                          -16, 0, 23, 44, 62, 78, 92, 105, 117, -128, -116, -104, -91, -76, -60,
                          -40, -16);
}
static_assert(kIq4Levels[0] == -127 && kIq4Levels[8] == 1 && kIq4Levels[15] == 113,
              "iq4_u_table: the levels plus 127");

// The offsets the int16 kernels add per group for scales `s` (group_scales' o otherwise).
template <bool Levels>
PAGEDLLM_Q4_INLINE void i16_offsets(const V16& s, V16* o) {
  if constexpr (Levels) *o = v_mul(s, v_set(-127.f));
}

// The int16 lanes of 8 columns' weight dword for x word J (avx2_i16_x_rows' order): 4-bit:
// nibbles J and J + 4, never masked in place at bits 12-15 (they would read as negative int16):
// word 3 is one 16-bit shift (each lane's top nibble), words 0 and 2 a mask (after a shift by
// 8), word 1 a shift and a mask or, kInPlace16, a mask alone (q * 16); 8-bit: bytes 0, 2
// (J = 0) or 1, 3 (J = 1), sign-extended by 16-bit shifts. Levels: the nibbles' u
// (iq4_u_table).
template <int Bits, int J, bool InPlace16, bool Levels = false>
PAGEDLLM_Q4_INLINE __m256i i16_lanes(__m256i v) {
  const __m256i low = _mm256_set1_epi32(0x000F000F);
  if constexpr (Levels) {
    static_assert(Bits == 4 && !InPlace16, "IQ4 levels: 4-bit nibbles in the low bits");
    return _mm256_shuffle_epi8(iq4_u_table(), i16_lanes<4, J, false>(v));
  } else if constexpr (Bits == 4) {
    if constexpr (J == 0) return _mm256_and_si256(v, low);
    if constexpr (J == 1 && InPlace16) return _mm256_and_si256(v, _mm256_slli_epi32(low, 4));
    if constexpr (J == 1) return _mm256_and_si256(_mm256_srli_epi32(v, 4), low);
    if constexpr (J == 2) return _mm256_and_si256(_mm256_srli_epi32(v, 8), low);
    return _mm256_srli_epi16(v, 12);
  } else if constexpr (J == 0) {
    return _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);
  } else {
    return _mm256_srai_epi16(v, 8);
  }
}

// An empty asm that "changes" v in its register: integer adds are associative, and GCC
// reassociated the sums below into all of a group's products first, then a tree of adds,
// holding the products on the stack (66 spills and reloads a group at one row, 83 in the
// previous build): the barrier keeps each product added to its sum as it comes.
PAGEDLLM_Q4_INLINE void in_register(__m256i& v) { asm("" : "+x"(v)); }

// a[r] (or b[r]: kInPlace16's word 1) += one chunk's q (8 columns per half, two halves) times
// row r's x word J of the chunk: vpmaddwd, two products per int32 lane, added straight to the
// sums (sums built as trees first were scheduled by GCC as all of a group's products at once,
// spilled to the stack).
template <int Bits, int R, int J, bool Levels>
PAGEDLLM_Q4_INLINE void i16_word(__m256i v0, __m256i v1, const int32_t* xc, int64_t ldx,
                                 __m256i a[R][2], __m256i b[R][2]) {
  constexpr bool kOwn = kInPlace16<Bits, R, Levels> && J == 1;
  const __m256i w0 = i16_lanes<Bits, J, kOwn, Levels>(v0);
  const __m256i w1 = i16_lanes<Bits, J, kOwn, Levels>(v1);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256i xb = _mm256_set1_epi32(xc[r * ldx + J]);
    __m256i* s = kOwn ? b[r] : a[r];
    s[0] = _mm256_add_epi32(s[0], _mm256_madd_epi16(w0, xb));
    s[1] = _mm256_add_epi32(s[1], _mm256_madd_epi16(w1, xb));
    in_register(s[0]);
    in_register(s[1]);
  }
}

// a[r] += one six half group's q (six_word: int16 lanes, two k per int32 lane) times row r's
// x words of it (xc: its 8), vpmaddwd as i16_word.
template <int R, int... P>
PAGEDLLM_Q4_INLINE void i16_six_half(const uint8_t* half, const int32_t* xc, int64_t ldx,
                                     __m256i a[R][2], std::integer_sequence<int, P...>) {
  const auto step = [&](auto p) {
    constexpr int kP = decltype(p)::value;
    const __m256i w0 = six_word<kP>(half, 0), w1 = six_word<kP>(half, 1);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i xb = _mm256_set1_epi32(xc[r * ldx + kP]);
      a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(w0, xb));
      a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(w1, xb));
      in_register(a[r][0]);
      in_register(a[r][1]);
    }
  };
  (step(std::integral_constant<int, P>{}), ...);
}

template <int Bits, int R, bool Levels, int... J>
PAGEDLLM_Q4_INLINE void i16_chunk(const uint8_t* chunk, const int32_t* xc, int64_t ldx,
                                  __m256i a[R][2], __m256i b[R][2],
                                  std::integer_sequence<int, J...>) {
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32));
  (i16_word<Bits, R, J, Levels>(v0, v1, xc, ldx, a, b), ...);
}

// c[R][16] = R rows of x @ one panel on integer products: xw, xs, gsum from avx2_i16_x_rows
// (row r at r * ldx words, r * ldg groups). Per group (Halves: per half group) and row the
// int32 sums are exact (4-bit: |sum| <= 32 * 15 * 32767 < 2^24, so their float32 conversion is
// exact too; 8-bit: <= 32 * 128 * 32768 = 2^27), then y += (scale * s) * sum + offset * gsum in
// float32, s a power of two: the definition's dequantised W times the int16-rounded x, up to
// float32 sums. IQ4 levels: sums of u = level + 127 (iq4_u_table), offset -127 * scale.
// L: the layout f is read through (gemm_q4_layout.h's with_layout; L::kLevels: IQ4 levels).
template <int Bits, int R, bool Halves, typename L = RuntimeLayout>
PAGEDLLM_Q4_KERNEL void avx2_i16_rows(const int32_t* xw, int64_t ldx, const float* xs,
                                      const float* gsum, int64_t ldg, const uint8_t* panel,
                                      int64_t groups, const Format& format, float* c) {
  static_assert(!Halves || Bits != 4, "two scales: 8-bit layers only");
  static_assert(Bits != 6 || Halves, "six blocks: two scales");
  const Format& f = L::of(format);
  constexpr bool kLevels = L::kLevels;
  constexpr int kPer = Bits == 4 ? 8 : 4;            // k per chunk
  constexpr int kWords = Bits == 4 ? 4 : 2;          // x words per chunk
  constexpr int kPartChunks = kGroup / kPer / kParts<Halves>;
  __m256 t[R][2];
  for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + f.block_offset(g);
    prefetch_group(panel, g, f);
    const int32_t* xg = xw + g * kI16Words;
#pragma GCC unroll 2
    for (int part = 0; part < kParts<Halves>; ++part) {
      __m256i a[R][2], b[R][2];  // b: kInPlace16's nibbles 1 and 5, times 16
      for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = b[r][0] = b[r][1] = _mm256_setzero_si256();
      if constexpr (Bits == 6) {
        i16_six_half<R>(block + part * Format::kSixHalf, xg + part * kI16Words / 2, ldx, a,
                        std::make_integer_sequence<int, 8>{});
      } else {
#pragma GCC unroll 8
        for (int i = 0; i < kPartChunks; ++i) {
          const int ch = part * kPartChunks + i;
          i16_chunk<Bits, R, kLevels>(block + ch * kChunk, xg + ch * kWords, ldx, a, b,
                                      std::make_integer_sequence<int, kWords>{});
        }
      }
      if constexpr (kInPlace16<Bits, R, kLevels>)  // 16 * sum, exactly: the shift is exact
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h)
            a[r][h] = _mm256_add_epi32(a[r][h], _mm256_srai_epi32(b[r][h], 4));
      V16 s, o;  // loaded after the sums: live across them, they would spill at 4 rows
      group_scales(panel, g, f, &s, &o);
      i16_offsets<kLevels>(s, &o);
      const V16& sc = part == 0 ? s : o;
      for (int r = 0; r < R; ++r) {
        const __m256 xsr = _mm256_broadcast_ss(xs + r * ldg + g);
        t[r][0] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][0]), _mm256_mul_ps(sc.lo, xsr), t[r][0]);
        t[r][1] =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[r][1]), _mm256_mul_ps(sc.hi, xsr), t[r][1]);
        if (!Halves && (Bits == 4 || f.with_offset)) {  // Q4_0's offset: -8 * scale
          const __m256 xsum = _mm256_broadcast_ss(gsum + r * ldg + g);
          t[r][0] = _mm256_fmadd_ps(o.lo, xsum, t[r][0]);
          t[r][1] = _mm256_fmadd_ps(o.hi, xsum, t[r][1]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * kCols, t[r][0]);
    _mm256_storeu_ps(c + r * kCols + 8, t[r][1]);
  }
}

}  // namespace pagedllm::gemm::q4

#endif  // AVX2 without AVX-512
