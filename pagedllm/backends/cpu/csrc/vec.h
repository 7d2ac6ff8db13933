// Small float32 vector helpers for the CPU paged-attention kernels.
//
// Every helper has an AVX2/FMA body and a portable scalar body, chosen at compile time, so the
// extension still builds (and stays correct, only slower) on a machine without AVX2; the long
// loops (dot products, exp, value accumulation) also have a 16-wide AVX-512 body, compiled when
// the ISA level's flags define __AVX512F__. Lengths are arbitrary: the vector bodies run 16/32-
// then 8-float steps and finish with a scalar tail, so any head size works, not only multiples
// of 8.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
#else
#define PAGEDLLM_AVX2 0
#endif

// The AVX-512 bodies sit on top of the AVX2 ones (an AVX-512 level always has AVX2 too).
#if PAGEDLLM_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDLLM_AVX512 1
#else
#define PAGEDLLM_AVX512 0
#endif

#if PAGEDLLM_AVX512 && defined(__AVX512BF16__)
#define PAGEDLLM_AVX512BF16 1
#else
#define PAGEDLLM_AVX512BF16 0
#endif

namespace pagedllm {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#if PAGEDLLM_AVX2

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for 8 lanes: x = n*ln2 + r with |r| <= ln2/2, e^r by a degree-6 Taylor polynomial
// (relative error ~1e-7), 2^n built in the exponent bits. Lanes below -87.3 (including -inf)
// return exactly 0 so masked scores vanish.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 hi = _mm256_set1_ps(88.3f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 res = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(underflow, res);
}

#endif  // PAGEDLLM_AVX2

#if PAGEDLLM_AVX512
// exp8's algorithm on 16 lanes (same polynomial, same underflow-to-zero rule).
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __m512 hi = _mm512_set1_ps(88.3f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(bits));
}
#endif  // PAGEDLLM_AVX512

// sum_i a[i] * b[i]
inline float dot(const float* a, const float* b, int n) {
  int i = 0;
  float tail = 0.f;
#if PAGEDLLM_AVX512
  if (n >= 32) {
    __m512 w0 = _mm512_setzero_ps(), w1 = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
      w0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), w0);
      w1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), w1);
    }
    tail = _mm512_reduce_add_ps(_mm512_add_ps(w0, w1));
  }
#endif
#if PAGEDLLM_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
  }
  for (; i + 8 <= n; i += 8) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  }
  tail += hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
#endif
  for (; i < n; ++i) tail += a[i] * b[i];
  return tail;
}

inline float max_of(const float* x, int n) {
  int i = 0;
  float m = kNegInf;
#if PAGEDLLM_AVX2
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
    m = hmax8(v);
  }
#endif
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// x[i] = cap * tanh(x[i] / cap) in place (Gemma 2's soft cap on attention scores), vectorised
// as sign(y) * (1 - e) / (1 + e) with e = exp(-2|y|): e only underflows (to 0: tanh = +-1),
// never overflows, and the error stays ~1e-7 of the cap.
inline void soft_cap(float* x, int n, float cap) {
  int i = 0;
  const float inv = 1.f / cap;
#if PAGEDLLM_AVX512
  {
    const __m512 c = _mm512_set1_ps(cap), ic = _mm512_set1_ps(-2.f * inv);
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __m512 e = exp16(_mm512_mul_ps(_mm512_abs_ps(v), ic));
      const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
      const __m512i s = _mm512_and_si512(_mm512_castps_si512(v), sign);
      _mm512_storeu_ps(x + i, _mm512_mul_ps(c, _mm512_castsi512_ps(_mm512_or_si512(
                                                 _mm512_castps_si512(t), s))));
    }
  }
#endif
#if PAGEDLLM_AVX2
  {
    const __m256 c = _mm256_set1_ps(cap), ic = _mm256_set1_ps(-2.f * inv);
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 e = exp8(_mm256_mul_ps(_mm256_andnot_ps(sign, v), ic));
      const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
      _mm256_storeu_ps(x + i, _mm256_mul_ps(c, _mm256_or_ps(t, _mm256_and_ps(v, sign))));
    }
  }
#endif
  for (; i < n; ++i) x[i] = cap * std::tanh(x[i] * inv);
}

// x[i] = exp(x[i] - shift) in place; returns the sum of the new values.
inline float exp_shift_sum(float* x, int n, float shift) {
  int i = 0;
  float sum = 0.f;
#if PAGEDLLM_AVX512
  {
    const __m512 sh = _mm512_set1_ps(shift);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), sh));
      _mm512_storeu_ps(x + i, e);
      acc = _mm512_add_ps(acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
  }
#endif
#if PAGEDLLM_AVX2
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum += hsum8(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

// acc[c] = acc[c] * alpha + sum_t p[t] * v[t * v_stride + c] for c < n: the softmax-weighted
// value sum of one query row over one block, with the running accumulator rescaled first.
inline void scale_accumulate(float* acc, float alpha, const float* p, const float* v,
                             int num_tokens, int64_t v_stride, int n) {
  int c = 0;
#if PAGEDLLM_AVX512
  {
    const __m512 al = _mm512_set1_ps(alpha);
    for (; c + 32 <= n; c += 32) {
      __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + c), al);
      __m512 a1 = _mm512_mul_ps(_mm512_loadu_ps(acc + c + 16), al);
      for (int t = 0; t < num_tokens; ++t) {
        const __m512 pt = _mm512_set1_ps(p[t]);
        const float* vr = v + t * v_stride + c;
        a0 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vr), a0);
        a1 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vr + 16), a1);
      }
      _mm512_storeu_ps(acc + c, a0);
      _mm512_storeu_ps(acc + c + 16, a1);
    }
  }
#endif
#if PAGEDLLM_AVX2
  const __m256 al = _mm256_set1_ps(alpha);
  for (; c + 32 <= n; c += 32) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + c), al);
    __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(acc + c + 8), al);
    __m256 a2 = _mm256_mul_ps(_mm256_loadu_ps(acc + c + 16), al);
    __m256 a3 = _mm256_mul_ps(_mm256_loadu_ps(acc + c + 24), al);
    for (int t = 0; t < num_tokens; ++t) {
      const __m256 pt = _mm256_set1_ps(p[t]);
      const float* vr = v + t * v_stride + c;
      a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr), a0);
      a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + 8), a1);
      a2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + 16), a2);
      a3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + 24), a3);
    }
    _mm256_storeu_ps(acc + c, a0);
    _mm256_storeu_ps(acc + c + 8, a1);
    _mm256_storeu_ps(acc + c + 16, a2);
    _mm256_storeu_ps(acc + c + 24, a3);
  }
  for (; c + 8 <= n; c += 8) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc + c), al);
    for (int t = 0; t < num_tokens; ++t) {
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(v + t * v_stride + c), a0);
    }
    _mm256_storeu_ps(acc + c, a0);
  }
#endif
  for (; c < n; ++c) {
    float a = acc[c] * alpha;
    for (int t = 0; t < num_tokens; ++t) a += p[t] * v[t * v_stride + c];
    acc[c] = a;
  }
}

#if PAGEDLLM_AVX2
// [sum(a0), sum(a1), ..., sum(a7)]: eight horizontal sums with one hadd tree instead of eight.
inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                      __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// [sum(a0), sum(a1), sum(a2), sum(a3)]
inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}
#endif

// Scores of two query rows against four key rows (k + t * ks): s0[t] = q0.k_t, s1[t] = q1.k_t.
// Eight accumulators in registers, each key vector loaded once for both rows, each query vector
// once for all four keys: the QK^T micro-kernel of both prefill tiles and GQA decode groups.
inline void dot_2x4(const float* q0, const float* q1, const float* k, int64_t ks, int d,
                    float* s0, float* s1) {
  int c = 0;
#if PAGEDLLM_AVX2
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
  __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  for (; c + 8 <= d; c += 8) {
    const __m256 x0 = _mm256_loadu_ps(q0 + c), x1 = _mm256_loadu_ps(q1 + c);
    __m256 kv = _mm256_loadu_ps(k + c);
    a00 = _mm256_fmadd_ps(x0, kv, a00);
    a10 = _mm256_fmadd_ps(x1, kv, a10);
    kv = _mm256_loadu_ps(k + ks + c);
    a01 = _mm256_fmadd_ps(x0, kv, a01);
    a11 = _mm256_fmadd_ps(x1, kv, a11);
    kv = _mm256_loadu_ps(k + 2 * ks + c);
    a02 = _mm256_fmadd_ps(x0, kv, a02);
    a12 = _mm256_fmadd_ps(x1, kv, a12);
    kv = _mm256_loadu_ps(k + 3 * ks + c);
    a03 = _mm256_fmadd_ps(x0, kv, a03);
    a13 = _mm256_fmadd_ps(x1, kv, a13);
  }
  const __m256 sums = hsum8x8(a00, a01, a02, a03, a10, a11, a12, a13);
  _mm_storeu_ps(s0, _mm256_castps256_ps128(sums));
  _mm_storeu_ps(s1, _mm256_extractf128_ps(sums, 1));
#else
  for (int t = 0; t < 4; ++t) s0[t] = s1[t] = 0.f;
#endif
  for (; c < d; ++c) {
    for (int t = 0; t < 4; ++t) {
      s0[t] += q0[c] * k[t * ks + c];
      s1[t] += q1[c] * k[t * ks + c];
    }
  }
}

// One query row against four key rows (the odd row of a tile).
inline void dot_1x4(const float* q0, const float* k, int64_t ks, int d, float* s0) {
  int c = 0;
#if PAGEDLLM_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; c + 8 <= d; c += 8) {
    const __m256 x0 = _mm256_loadu_ps(q0 + c);
    a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(k + c), a0);
    a1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(k + ks + c), a1);
    a2 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(k + 2 * ks + c), a2);
    a3 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(k + 3 * ks + c), a3);
  }
  _mm_storeu_ps(s0, hsum4x8(a0, a1, a2, a3));
#else
  for (int t = 0; t < 4; ++t) s0[t] = 0.f;
#endif
  for (; c < d; ++c) {
    for (int t = 0; t < 4; ++t) s0[t] += q0[c] * k[t * ks + c];
  }
}

// Two rows at once: acc_r = acc_r * alpha_r + sum_t p_r[t] * v[t], sharing every value load.
inline void scale_accumulate2(float* acc0, float* acc1, float alpha0, float alpha1,
                              const float* p0, const float* p1, const float* v, int num_tokens,
                              int64_t v_stride, int n) {
  int c = 0;
#if PAGEDLLM_AVX512
  {
    const __m512 al0 = _mm512_set1_ps(alpha0), al1 = _mm512_set1_ps(alpha1);
    for (; c + 32 <= n; c += 32) {
      __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(acc0 + c), al0);
      __m512 x1 = _mm512_mul_ps(_mm512_loadu_ps(acc0 + c + 16), al0);
      __m512 y0 = _mm512_mul_ps(_mm512_loadu_ps(acc1 + c), al1);
      __m512 y1 = _mm512_mul_ps(_mm512_loadu_ps(acc1 + c + 16), al1);
      for (int t = 0; t < num_tokens; ++t) {
        const __m512 w0 = _mm512_set1_ps(p0[t]), w1 = _mm512_set1_ps(p1[t]);
        const __m512 v0 = _mm512_loadu_ps(v + t * v_stride + c);
        const __m512 v1 = _mm512_loadu_ps(v + t * v_stride + c + 16);
        x0 = _mm512_fmadd_ps(w0, v0, x0);
        x1 = _mm512_fmadd_ps(w0, v1, x1);
        y0 = _mm512_fmadd_ps(w1, v0, y0);
        y1 = _mm512_fmadd_ps(w1, v1, y1);
      }
      _mm512_storeu_ps(acc0 + c, x0);
      _mm512_storeu_ps(acc0 + c + 16, x1);
      _mm512_storeu_ps(acc1 + c, y0);
      _mm512_storeu_ps(acc1 + c + 16, y1);
    }
  }
#endif
#if PAGEDLLM_AVX2
  const __m256 al0 = _mm256_set1_ps(alpha0), al1 = _mm256_set1_ps(alpha1);
  for (; c + 16 <= n; c += 16) {
    __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(acc0 + c), al0);
    __m256 x1 = _mm256_mul_ps(_mm256_loadu_ps(acc0 + c + 8), al0);
    __m256 y0 = _mm256_mul_ps(_mm256_loadu_ps(acc1 + c), al1);
    __m256 y1 = _mm256_mul_ps(_mm256_loadu_ps(acc1 + c + 8), al1);
    for (int t = 0; t < num_tokens; ++t) {
      const __m256 w0 = _mm256_set1_ps(p0[t]), w1 = _mm256_set1_ps(p1[t]);
      const __m256 v0 = _mm256_loadu_ps(v + t * v_stride + c);
      const __m256 v1 = _mm256_loadu_ps(v + t * v_stride + c + 8);
      x0 = _mm256_fmadd_ps(w0, v0, x0);
      x1 = _mm256_fmadd_ps(w0, v1, x1);
      y0 = _mm256_fmadd_ps(w1, v0, y0);
      y1 = _mm256_fmadd_ps(w1, v1, y1);
    }
    _mm256_storeu_ps(acc0 + c, x0);
    _mm256_storeu_ps(acc0 + c + 8, x1);
    _mm256_storeu_ps(acc1 + c, y0);
    _mm256_storeu_ps(acc1 + c + 8, y1);
  }
#endif
  if (c < n) {
    scale_accumulate(acc0 + c, alpha0, p0, v + c, num_tokens, v_stride, n - c);
    scale_accumulate(acc1 + c, alpha1, p1, v + c, num_tokens, v_stride, n - c);
  }
}

// Pulls the next block's K and V panels into L2 a few cache lines at a time, spread over the
// current block's dot products. Blocks of a sequence are scattered, so the hardware prefetcher
// cannot guess the next address; issuing all lines in one burst stalls on the miss queue, and
// spreading them lets the loads overlap with compute (measured ~1.5x on long decodes).
class PanelPrefetcher {
 public:
  // k, v: the next panels (nullptr: nothing to fetch); calls: how many step() calls will follow.
  void reset(const void* k, const void* v, int64_t panel_bytes, int64_t calls) {
    k_ = static_cast<const char*>(k);
    v_ = static_cast<const char*>(v);
    lines_ = k ? panel_bytes / 64 : 0;
    done_ = 0;
    per_call_ = calls > 0 ? (2 * lines_ + calls - 1) / calls : 2 * lines_;
  }

  void step() {
#if PAGEDLLM_AVX2
    for (int64_t e = 0; e < per_call_ && done_ < 2 * lines_; ++e, ++done_) {
      const char* line = done_ < lines_ ? k_ + done_ * 64 : v_ + (done_ - lines_) * 64;
      _mm_prefetch(line, _MM_HINT_T1);
    }
#endif
  }

 private:
  const char* k_ = nullptr;
  const char* v_ = nullptr;
  int64_t lines_ = 0, done_ = 0, per_call_ = 0;
};

inline bool compiled_with_avx2() { return PAGEDLLM_AVX2 != 0; }

}  // namespace pagedllm
