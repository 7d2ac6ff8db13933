// The integer dot-product path of the group-wise GEMM (gemm_q4.cpp), for decode rows: each row of
// x is rounded to int8 per group of 32 (quantize_group), the weights' q meet it in exact int32
// sums per group (AVX-512 VNNI vpdpbusd: u8 x s8 straight into int32; AVX2 vpmaddubsw +
// vpmaddwd; scalar), and each group's sum is scaled in float32:
//   y[r, n] = sum_g scale[n, g] * dx[r, g] * sum_k q[n, k] xq[r, k] + offset[n, g] * xsum[r, g]
// with xsum[r, g] = dx[r, g] * sum_k xq[r, k]. That is dequantize_layer(W) times the
// dequantised int8 x (xq * dx), up to the rounding of float32 sums: the PyTorch definition is
// pagedllm/backends/cpu/groupwise_linear.py's dot_linear_reference.
//
// Why: a decode row is bound by streaming the weights, but at 4 bits the float path's
// conversions and FMAs per weight cost as much as the bytes; one vpdpbusd does 64
// multiply-adds of bytes, so the arithmetic falls far below the stream (llama.cpp does the same
// with its q8_0 activations).
//
// 4-bit q (0..15) are the unsigned operand as they are. 8-bit q are signed: VNNI offsets them by
// 128 (one xor per chunk, shared by the rows) and takes 128 * sum_k xq off each group's sum;
// AVX2 moves x's sign onto them (vpsignb) and uses |x| as the unsigned side, as gemm_i8.cpp does.
// Two-scale layers (Q6_K: a scale per 16 k) keep two int32 sums per group, each scaled by its
// own scale times dx (VNNI's correction is then per 16 k: corr[group][2]).
// Nothing saturates: a vpmaddubsw pair is at most 2 * 15 * 127 (4-bit) or 2 * 127 * 127.
// On AVX2 a 4-bit layer's batches past kDotRows run the same arithmetic on register tiles
// (gemm_q4_dot_tiles.h); dot_rows runs the rest.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gemm_q4_layout.h"

namespace pagedllm::gemm::q4 {

// One group of x: dx = max|x| / 127 (1 for an all-zero group), xq = round_half_even(x / dx)
// clamped to [-127, 127] (a true division, as PyTorch's `(x / dx).round()`); returns sum xq.
inline int32_t quantize_group(const float* x, int8_t* q, float* dx) {
  float amax = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 a = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x)),
                                 _mm512_abs_ps(_mm512_loadu_ps(x + 16)));
  amax = _mm512_reduce_max_ps(a);
  i = kGroup;
#elif defined(__AVX2__)
  {  // m = max(|x|, m) from 0: a NaN is passed over, as std::max(amax, NaN) passes it below
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (int h = 0; h < 4; ++h)
      m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * h)), m);
    __m128 v = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    v = _mm_max_ss(v, _mm_shuffle_ps(v, v, 1));
    amax = _mm_cvtss_f32(v);
    i = kGroup;
  }
#endif
  for (int64_t j = i; j < kGroup; ++j) amax = std::max(amax, std::fabs(x[j]));
  float d = amax / 127.f;
  if (!(d > 0.f)) d = 1.f;
  *dx = d;
  int32_t sum = 0;
#if defined(__AVX512F__)
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 vd = _mm512_set1_ps(d), lim = _mm512_set1_ps(127.f), nlim = _mm512_set1_ps(-127.f);
  for (int h = 0; h < 2; ++h) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + 16 * h), vd), kRound);
    const __m512i qi = _mm512_cvtps_epi32(_mm512_min_ps(lim, _mm512_max_ps(nlim, v)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * h), _mm512_cvtepi32_epi8(qi));
    sum += _mm512_reduce_add_epi32(qi);
  }
#elif defined(__AVX2__)
  // The scalar loop's operations lane by lane: a true division, rounding half to even, then
  // std::max(-127, v) and std::min(127, v) (a NaN quotient becomes -127 there and here).
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 vd = _mm256_set1_ps(d), lim = _mm256_set1_ps(127.f), nlim = _mm256_set1_ps(-127.f);
  __m256i qi[4];
  for (int h = 0; h < 4; ++h) {
    const __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + 8 * h), vd), kRound);
    qi[h] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, nlim), lim));
  }
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                           _mm256_packs_epi32(qi[2], qi[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs works per lane
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  const __m256i s =
      _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  sum = _mm_cvtsi128_si32(t);
#else
  for (int64_t j = 0; j < kGroup; ++j) {
    const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[j] / d)));
    q[j] = static_cast<int8_t>(v);
    sum += static_cast<int32_t>(v);
  }
#endif
  return sum;
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

#if defined(__AVX512VNNI__)
constexpr int kDotRows = 8;

// acc + the 16 columns' u8 x 4 (k) dot products with the 4 int8 of x at p, broadcast by the
// instruction itself ({1to16}): GCC otherwise emits a separate vpbroadcastd per row and chunk.
inline __m512i dot4(__m512i acc, __m512i u, const int8_t* p) {
  const auto& x4 = *reinterpret_cast<const int32_t*>(p);
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(x4));
  return acc;
}

// c[R][16] = the dot path's y for rows of xq (ldx apart) against one panel; dx, xsum, corr are
// [R][lda] per group, corr the integer correction of each group's sum (run_dot): -8 sum(xq)
// for 4-bit layers without offsets (Q4_0: q - 8 times xq, exactly), 128 sum(xq) for 8-bit
// ones on VNNI (the offset of the weights taken off).
template <int Bits, int R>
inline void dot_rows(const int8_t* xq, int64_t ldx, const float* dx, const float* xsum,
                     const int32_t* corr, int64_t lda, const uint8_t* panel, int64_t groups,
                     const Format& f, float* c) {
  constexpr int C = R <= 2 ? 2 : 1;  // independent chains while few rows
  const bool two = Bits == 8 && f.two_scales();
  __m512 t[R];
  for (auto& v : t) v = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + f.block_offset(g);
    prefetch_group(panel, g, f);
    const int8_t* xg = xq + g * kGroup;
    __m512i a[C][R];
    for (auto& chain : a)
      for (auto& v : chain) v = _mm512_setzero_si512();
    // Offsets of -8 * scale (Q4_0) are -8 * sum(xq) in the integer sum: the sums start there.
    if (Bits == 4 && !f.with_offset)
      for (int r = 0; r < R; ++r) a[0][r] = _mm512_set1_epi32(corr[r * lda + g]);
    if constexpr (Bits == 4) {
#pragma GCC unroll 4
      for (int ch = 0; ch < 4; ++ch) {
        const __m512i v = _mm512_loadu_si512(block + ch * kChunk);
        const __m512i lo = _mm512_and_si512(v, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xg + r * ldx + 8 * ch;
          a[0][r] = dot4(a[0][r], lo, xr);
          a[C - 1][r] = dot4(a[C - 1][r], hi, xr + 4);
        }
      }
    } else if (two) {  // a[0]: k 0..15, a[C - 1]: k 16..31 (one chain each while few rows)
      __m512i b[R];
      for (auto& v : b) v = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int ch = 0; ch < 8; ++ch) {
        const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(block + ch * kChunk), flip);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xg + r * ldx + 4 * ch;
          if (ch < 4)
            a[0][r] = dot4(a[0][r], u, xr);
          else
            b[r] = dot4(b[r], u, xr);
        }
      }
      V16 s, o;
      group_scales(panel, g, f, &s, &o);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int32_t* cr = corr + (r * lda + g) * 2;  // (q + 128) . xq - 128 * sum(xq)
        const __m512i s0 = _mm512_sub_epi32(a[0][r], _mm512_set1_epi32(cr[0]));
        const __m512i s1 = _mm512_sub_epi32(b[r], _mm512_set1_epi32(cr[1]));
        const __m512 vdx = _mm512_set1_ps(dx[r * lda + g]);
        t[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(s.v, vdx), t[r]);
        t[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(o.v, vdx), t[r]);
      }
      continue;
    } else {
#pragma GCC unroll 8
      for (int ch = 0; ch < 8; ++ch) {
        const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(block + ch * kChunk), flip);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xg + r * ldx + 4 * ch;
          a[ch % C][r] = dot4(a[ch % C][r], u, xr);
        }
      }
    }
    V16 s, o;
    group_scales(panel, g, f, &s, &o);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512i sum = C == 2 ? _mm512_add_epi32(a[0][r], a[C - 1][r]) : a[0][r];
      if constexpr (Bits == 8)  // (q + 128) . xq - 128 * sum(xq), exactly
        sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(corr[r * lda + g]));
      const __m512 sd = _mm512_mul_ps(s.v, _mm512_set1_ps(dx[r * lda + g]));
      t[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), sd, t[r]);
      if (f.with_offset)
        t[r] = _mm512_fmadd_ps(o.v, _mm512_set1_ps(xsum[r * lda + g]), t[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(c + r * kCols, t[r]);
}

#elif defined(__AVX2__)
constexpr int kDotRows = 4;  // 8 ymm of sums + the chunk's 4 + x: the 16 registers

// Two halves of 8 int32 sums as float32 (the avx512 level, without VNNI, runs this code too).
inline V16 to_v16(__m256i lo, __m256i hi) {
#if defined(__AVX512F__)
  return {_mm512_cvtepi32_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1))};
#else
  return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
#endif
}

template <int Bits, int R>
inline void dot_rows(const int8_t* xq, int64_t ldx, const float* dx, const float* xsum,
                     const int32_t* corr, int64_t lda, const uint8_t* panel, int64_t groups,
                     const Format& f, float* c) {
  const bool centred = Bits == 4 && !f.with_offset, two = Bits == 8 && f.two_scales();
  for (int r = 0; r < R; ++r) v_store(c + r * kCols, v_zero());
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + f.block_offset(g);
    prefetch_group(panel, g, f);
    const int8_t* xg = xq + g * kGroup;
    __m256i a[R][2];  // 4-bit: int16 sums of 16 products (<= 30480); 8-bit: int32 sums
    for (auto& row : a) row[0] = row[1] = _mm256_setzero_si256();
    if constexpr (Bits == 4) {
      for (int ch = 0; ch < 4; ++ch) {
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i v =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + ch * kChunk + 32 * h));
          lo[h] = _mm256_and_si256(v, low);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xg + r * ldx + 8 * ch;
          const __m256i xl = _mm256_set1_epi32(load4(xr)), xh = _mm256_set1_epi32(load4(xr + 4));
          for (int h = 0; h < 2; ++h) {
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                               _mm256_maddubs_epi16(hi[h], xh));
            a[r][h] = _mm256_add_epi16(a[r][h], p);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256i cr = _mm256_set1_epi32(centred ? corr[r * lda + g] : 0);
        for (auto& v : a[r]) v = _mm256_add_epi32(_mm256_madd_epi16(v, ones), cr);
      }
    } else {
      for (int ch = 0; ch < 8; ++ch) {
        if (two && ch == 4) {  // k 0..15 done: scaled by their own scale, then k 16..31
          V16 s, o;
          group_scales(panel, g, f, &s, &o);
          for (int r = 0; r < R; ++r) {
            const V16 sum = to_v16(a[r][0], a[r][1]);
            v_store(c + r * kCols,
                    v_fmav(v_load(c + r * kCols), sum, v_mul(s, v_set(dx[r * lda + g]))));
            a[r][0] = a[r][1] = _mm256_setzero_si256();
          }
        }
        const auto* w = reinterpret_cast<const __m256i*>(block + ch * kChunk);
        const __m256i w0 = _mm256_loadu_si256(w), w1 = _mm256_loadu_si256(w + 1);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i xs = _mm256_set1_epi32(load4(xg + r * ldx + 4 * ch));
          const __m256i xa = _mm256_abs_epi8(xs);  // |x| as u8; the sign moves onto w
          const __m256i p0 = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(w0, xs));
          const __m256i p1 = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(w1, xs));
          a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(p0, ones));
          a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(p1, ones));
        }
      }
    }
    V16 s, o;
    group_scales(panel, g, f, &s, &o);
    if (two) s = o;  // the sums left are k 16..31's
    for (int r = 0; r < R; ++r) {
      const V16 sum = to_v16(a[r][0], a[r][1]);
      V16 t = v_fmav(v_load(c + r * kCols), sum, v_mul(s, v_set(dx[r * lda + g])));
      if (f.with_offset) t = v_fma(t, o, xsum[r * lda + g]);
      v_store(c + r * kCols, t);
    }
  }
}

#else
constexpr int kDotRows = 4;

template <int Bits, int R>
inline void dot_rows(const int8_t* xq, int64_t ldx, const float* dx, const float* xsum,
                     const int32_t* corr, int64_t lda, const uint8_t* panel, int64_t groups,
                     const Format& f, float* c) {
  const bool centred = Bits == 4 && !f.with_offset, two = Bits == 8 && f.two_scales();
  for (int r = 0; r < R; ++r) v_store(c + r * kCols, v_zero());
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + f.block_offset(g);
    prefetch_group(panel, g, f);
    V16 s, o;
    group_scales(panel, g, f, &s, &o);
    for (int r = 0; r < R; ++r) {
      const int8_t* xg = xq + r * ldx + g * kGroup;
      for (int j = 0; j < kCols; ++j) {
        int32_t sum = centred ? corr[r * lda + g] : 0;
        for (int ch = 0; ch < (Bits == 4 ? 4 : 8); ++ch) {
          if (two && ch == 4) {  // k 0..15 by their own scale
            c[r * kCols + j] += static_cast<float>(sum) * (s.v[j] * dx[r * lda + g]);
            sum = 0;
          }
          for (int b = 0; b < 4; ++b) {
            const uint8_t byte = block[ch * kChunk + 4 * j + b];
            if constexpr (Bits == 4) {
              sum += (byte & 0x0F) * xg[8 * ch + b] + (byte >> 4) * xg[8 * ch + 4 + b];
            } else {
              sum += static_cast<int8_t>(byte) * xg[4 * ch + b];
            }
          }
        }
        const float sc = two ? o.v[j] : s.v[j];
        c[r * kCols + j] += static_cast<float>(sum) * (sc * dx[r * lda + g]);
        if (f.with_offset) c[r * kCols + j] += o.v[j] * xsum[r * lda + g];
      }
    }
  }
}
#endif

}  // namespace pagedllm::gemm::q4
