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
// 8-bit layers (Q8_0, Q5_K's plain form; not Q6_K's two scales): byte b shifted to the top of
// its dword and masked, q * 2^24 exactly, the 2^-24 folded into the group's scale.
#pragma once

#include <cstdint>
#include <utility>

#include "gemm_q4_layout.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
#define PAGEDLLM_Q4_AVX2_ROWS 1

namespace pagedllm::gemm::q4 {

constexpr int kAvx2Rows = 4;  // up to this many rows per call

// Whether the kernels below run a layer of format f (IQ4 levels and Q6_K's two scales: no).
inline bool avx2_rows_format(const Format& f) { return !f.levels && !f.two_scales() && !f.six(); }

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
template <int Bits, int R>
inline void avx2_rows(const float* xn, int64_t ldx, const float* gsum, int64_t ldg,
                      const uint8_t* panel, int64_t groups, const Format& f, float* c) {
  constexpr int kPer = Bits == 4 ? 8 : 4;  // k per chunk
  constexpr int C = R == 1 ? 2 : 1;        // independent sums per row: FMA latency
  // 8-bit q arrive times 2^24 (byte_floats): their scale takes the 2^-24 back, exactly.
  const __m256 unit = _mm256_set1_ps(Bits == 4 ? 1.f : 1.f / 16777216.f);
  __m256 t[R][2];
  for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + f.block_offset(g);
    prefetch_group(panel, g, f);
    __m256 a[C][R][2];  // C chains: alternate chunks
    for (auto& chain : a)
      for (int r = 0; r < R; ++r) chain[r][0] = chain[r][1] = _mm256_setzero_ps();
    const float* xg = xn + g * kGroup;
#pragma GCC unroll 8
    for (int ch = 0; ch < kGroup / kPer; ++ch)
      avx2_chunk<Bits, R>(block + ch * kChunk, xg + ch * kPer, ldx, a[ch % C],
                          std::make_integer_sequence<int, kPer>{});
    V16 s, o;
    group_scales(panel, g, f, &s, &o);
    const __m256 s0 = _mm256_mul_ps(s.lo, unit), s1 = _mm256_mul_ps(s.hi, unit);
    for (int r = 0; r < R; ++r) {
      __m256 sum0 = a[0][r][0], sum1 = a[0][r][1];
      for (int i = 1; i < C; ++i) {
        sum0 = _mm256_add_ps(sum0, a[i][r][0]);
        sum1 = _mm256_add_ps(sum1, a[i][r][1]);
      }
      t[r][0] = _mm256_fmadd_ps(sum0, s0, t[r][0]);
      t[r][1] = _mm256_fmadd_ps(sum1, s1, t[r][1]);
      if (Bits == 4 || f.with_offset) {  // Q4_0's offset is -8 * scale (group_scales)
        const __m256 xs = _mm256_broadcast_ss(gsum + r * ldg + g);
        t[r][0] = _mm256_fmadd_ps(o.lo, xs, t[r][0]);
        t[r][1] = _mm256_fmadd_ps(o.hi, xs, t[r][1]);
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
