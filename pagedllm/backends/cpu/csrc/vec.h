// Small float32 vector helpers for the CPU paged-attention kernels.
//
// Every helper has an AVX2/FMA body and a portable scalar body, chosen at compile time, so the
// extension still builds (and stays correct, only slower) on a machine without AVX2. Lengths are
// arbitrary: the AVX2 bodies run 32- then 8-float steps and finish with a scalar tail, which is
// why any head size works, not only multiples of 8.
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

// sum_i a[i] * b[i]
inline float dot(const float* a, const float* b, int n) {
  int i = 0;
  float tail = 0.f;
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
  tail = hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
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

// x[i] = exp(x[i] - shift) in place; returns the sum of the new values.
inline float exp_shift_sum(float* x, int n, float shift) {
  int i = 0;
  float sum = 0.f;
#if PAGEDLLM_AVX2
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), sh));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
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

// Hint the next block's rows into cache while the current one is being computed: blocks of a
// sequence are scattered, so the hardware prefetcher cannot guess the next address.
inline void prefetch_range(const float* p, int64_t num_floats) {
#if PAGEDLLM_AVX2
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = num_floats * static_cast<int64_t>(sizeof(float));
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
#else
  (void)p;
  (void)num_floats;
#endif
}

inline bool compiled_with_avx2() { return PAGEDLLM_AVX2 != 0; }

}  // namespace pagedllm
