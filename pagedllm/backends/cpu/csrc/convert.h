// Conversions between the KV-cache storage types and float32, for the CPU kernels.
//
// The cache may hold float32, bfloat16, float16, fp8 e4m3 (the "fn" variant: no infinities,
// max 448) or fp8 e5m2. Kernels compute in float32: a block's K or V panel is widened into a
// per-thread float buffer once (load_floats) and then reused by every query row of the tile, so
// the micro-kernels stay the float ones; kernels that widen bf16 in registers instead (the
// attention's bf16 values, the row-wise layer kernels) share widen_bf16x16. Writes narrow with
// round-to-nearest-even (c10's scalar conversions, the same ones torch's .to() uses, so a cache
// written here is bit-identical to one written by the PyTorch reference). fp8 values are stored as x / scale, saturated to the
// format's largest finite value, and read back as q * scale; the kernels fold the scales into
// the query (K) and the output (V), never per element.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

namespace pagedllm {

using bf16_t = c10::BFloat16;
using fp16_t = c10::Half;
using e4m3_t = c10::Float8_e4m3fn;
using e5m2_t = c10::Float8_e5m2;

template <typename T>
constexpr bool is_fp8_v = std::is_same_v<T, e4m3_t> || std::is_same_v<T, e5m2_t>;

// Largest finite value of an fp8 format (writes saturate to it).
template <typename T>
constexpr float fp8_max() {
  return std::is_same_v<T, e4m3_t> ? 448.f : 57344.f;
}

// The one float -> storage conversion of a cache write: fp8 divides by the scale and saturates.
template <typename T>
inline T narrow(float x, float scale) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (is_fp8_v<T>) {
    const float m = fp8_max<T>();
    return T(std::min(std::max(x / scale, -m), m));
  } else {
    return T(x);
  }
}

#if PAGEDLLM_AVX512
// 16 bf16 -> 16 floats, exactly (a bf16 is a float's top half): shared by the panel widening
// below and the kernels that widen in registers.
inline __m512 widen_bf16x16(const bf16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// dst[i] = float(src[i]) for i < n.
template <typename T>
inline void load_floats(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
    return;
  } else {
    int64_t i = 0;
#if PAGEDLLM_AVX512
    for (; i + 16 <= n; i += 16) {
      __m512 f;
      if constexpr (std::is_same_v<T, bf16_t>) {
        f = widen_bf16x16(src + i);
      } else if constexpr (std::is_same_v<T, fp16_t>) {
        f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
      } else {
        const __m256i b = _mm256_cvtepu8_epi16(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
        if constexpr (std::is_same_v<T, e5m2_t>) {
          // e5m2 is the top byte of an IEEE half.
          f = _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
        } else {
          // e4m3 bits placed in a half's exponent/mantissa read as value * 2^-8 (normals and
          // subnormals alike), so one multiply restores the value.
          const __m256i h = _mm256_or_si256(
              _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
              _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
          f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
        }
      }
      _mm512_storeu_ps(dst + i, f);
    }
#endif
#if PAGEDLLM_AVX2 && defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
      __m256 f;
      if constexpr (std::is_same_v<T, bf16_t>) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      } else if constexpr (std::is_same_v<T, fp16_t>) {
        f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      } else {
        const __m128i b =
            _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
        if constexpr (std::is_same_v<T, e5m2_t>) {
          f = _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
        } else {
          const __m128i h =
              _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7),
                           _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
          f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
        }
      }
      _mm256_storeu_ps(dst + i, f);
    }
#endif
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// dst[i] = T(src[i] * mul) for i < n: output rows in the model's compute dtype.
template <typename T>
inline void store_floats(const float* src, float mul, T* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
#if PAGEDLLM_AVX2
    const __m256 m = _mm256_set1_ps(mul);
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_loadu_ps(src + i), m));
    }
#endif
  }
#if PAGEDLLM_AVX512BF16
  if constexpr (std::is_same_v<T, bf16_t>) {
    const __m512 m = _mm512_set1_ps(mul);
    for (; i + 16 <= n; i += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + i), m));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                          reinterpret_cast<const __m256i&>(h));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = T(src[i] * mul);
}

// f(T{}) for the compute type T named by t: float32, bfloat16 or float16.
template <typename F>
void dispatch_compute(c10::ScalarType t, const char* op, F&& f) {
  switch (t) {
    case c10::ScalarType::Float: f(float{}); break;
    case c10::ScalarType::BFloat16: f(bf16_t{}); break;
    case c10::ScalarType::Half: f(fp16_t{}); break;
    default:
      TORCH_CHECK(false, op, ": query/key/value must be float32, bfloat16 or float16, got ", t);
  }
}

// f(T{}) for the cache type T named by t: the compute types plus fp8 e4m3fn and e5m2.
template <typename F>
void dispatch_cache(c10::ScalarType t, const char* op, F&& f) {
  switch (t) {
    case c10::ScalarType::Float8_e4m3fn: f(e4m3_t{}); break;
    case c10::ScalarType::Float8_e5m2: f(e5m2_t{}); break;
    case c10::ScalarType::Float:
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::Half: dispatch_compute(t, op, f); break;
    default:
      TORCH_CHECK(false, op, ": the KV cache must be float32, bfloat16, float16, "
                  "float8_e4m3fn or float8_e5m2, got ", t);
  }
}

}  // namespace pagedllm
