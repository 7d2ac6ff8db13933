// Vector helpers of the weight GEMM (gemm.cpp): one "row of 16 output columns" of float32, loaded
// from packed bf16 / fp16 / int8 / float32 weights and converted in registers.
//
// The GEMM's own header so that it does not depend on the attention kernels' vec.h. Exactly one
// of the three implementations is compiled, chosen by the ISA level's compiler macros.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedllm::gemm {

// f(std::integral_constant<int, rows>) for a run-time row count 1..R: a tile's row count must be
// a compile-time constant so that its accumulators stay in registers.
template <int R, typename F>
inline void with_rows(int rows, const F& f) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, f);
  }
  f(std::integral_constant<int, R>{});
}

// Weight element tags (the packed tensor's storage type).
struct Bf16W { using T = uint16_t; };
struct Fp16W { using T = uint16_t; };
struct Int8W { using T = int8_t; };
struct F32W { using T = float; };

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#if defined(__AVX512F__)
// One zmm holds the 16 columns of a panel; 12 rows of accumulators fit the 32 registers.
constexpr int kRows = 12;
struct V16 {
  __m512 v;
};
inline V16 v_zero() { return {_mm512_setzero_ps()}; }
inline V16 v_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void v_store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 v_fma(V16 acc, V16 w, float x) {
  return {_mm512_fmadd_ps(w.v, _mm512_set1_ps(x), acc.v)};
}
inline V16 v_add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 w_load(Bf16W, const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline V16 w_load(Fp16W, const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline V16 w_load(Int8W, const int8_t* p) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))};
}
inline V16 w_load(F32W, const float* p) { return v_load(p); }

#elif defined(__AVX2__)
// Two ymm per panel row; 6 rows = 12 accumulators + 2 weight registers + 1 broadcast.
constexpr int kRows = 6;
struct V16 {
  __m256 lo, hi;
};
inline V16 v_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void v_store(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 v_fma(V16 acc, V16 w, float x) {
  __m256 b = _mm256_set1_ps(x);
  return {_mm256_fmadd_ps(w.lo, b, acc.lo), _mm256_fmadd_ps(w.hi, b, acc.hi)};
}
inline V16 v_add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline __m256 bf16x8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V16 w_load(Bf16W, const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline V16 w_load(Fp16W, const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline __m256 i8x8(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
inline V16 w_load(Int8W, const int8_t* p) { return {i8x8(p), i8x8(p + 8)}; }
inline V16 w_load(F32W, const float* p) { return v_load(p); }

#else
// Portable path: the compiler may still auto-vectorise these 16-wide loops.
constexpr int kRows = 4;
struct V16 {
  float v[16];
};
inline V16 v_zero() { return V16{}; }
inline V16 v_load(const float* p) {
  V16 r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline void v_store(float* p, V16 a) { std::memcpy(p, a.v, sizeof(a.v)); }
inline V16 v_fma(V16 acc, V16 w, float x) {
  for (int j = 0; j < 16; ++j) acc.v[j] += w.v[j] * x;
  return acc;
}
inline V16 v_add(V16 a, V16 b) {
  for (int j = 0; j < 16; ++j) a.v[j] += b.v[j];
  return a;
}
float half_to_float(uint16_t h);
inline V16 w_load(Bf16W, const uint16_t* p) {
  V16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = bf16_to_float(p[j]);
  return r;
}
inline V16 w_load(Fp16W, const uint16_t* p) {
  V16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = half_to_float(p[j]);
  return r;
}
inline V16 w_load(Int8W, const int8_t* p) {
  V16 r;
  for (int j = 0; j < 16; ++j) r.v[j] = static_cast<float>(p[j]);
  return r;
}
inline V16 w_load(F32W, const float* p) { return v_load(p); }
#endif

}  // namespace pagedllm::gemm
