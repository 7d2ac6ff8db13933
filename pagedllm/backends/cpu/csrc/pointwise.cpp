// Row-wise layer kernels of the CPU backend: RMSNorm with the residual add fused, the gated SiLU
// and GELU (tanh) of the MLP, and the rotary embedding (in place on q and k).
//
// Why they exist: in PyTorch each is a chain of five to ten small ATen ops, every one a pass over
// memory and a dispatch, and at decode sizes the chain costs far more than the arithmetic (in a
// 16-sequence decode step of a 1B int8 model: 5.6 ms of norms, 3.0 ms of rotary, 2.2 ms of
// SiLU, of 90 ms). Here each is one pass per row.
//
// Rounding follows the PyTorch layers (and so transformers) step by step: statistics and
// products in float32, and a rounding to the activations' dtype exactly where the layer rounds
// (the residual sum, the normalised value before the weight multiply, the SiLU before the gate
// multiply, each product of the rotation before their sum). So a 16-bit model's outputs are the
// PyTorch layer's bit for bit but for the last bit of a float32 reduction (a sum's order, exp's
// polynomial) landing on a rounding boundary. Contraction into FMA is switched off below, because
// a fused multiply-add skips one of those roundings.
#pragma GCC optimize("fp-contract=off")

#include "pointwise.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <type_traits>

#include "convert.h"
#include "vec.h"

namespace pagedllm {
namespace {

// One float vector of the widest path this build has, and the few operations the kernels need.
#if PAGEDLLM_AVX512
constexpr int kLanes = 16;
using vf = __m512;
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline vf vexp(vf a) { return exp16(a); }
// Lanes where a < b take x, the others keep y.
inline vf vselect_lt(vf a, vf b, vf x, vf y) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x);
}
#elif PAGEDLLM_AVX2
constexpr int kLanes = 8;
using vf = __m256;
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline float vsum(vf a) { return hsum8(a); }
inline vf vexp(vf a) { return exp8(a); }
inline vf vselect_lt(vf a, vf b, vf x, vf y) {
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ));
}
#else
constexpr int kLanes = 0;  // no vector body: the scalar loops do everything
#endif

#if PAGEDLLM_AVX512
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const bf16_t* p) { return widen_bf16x16(p); }
inline vf vload(const fp16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// Round to nearest even at bit 16, as c10::BFloat16 does (NaN lanes stay NaN): the float whose
// low 16 bits are zero, i.e. the bfloat16 value widened back.
inline __m512i bf16_rounded_bits(vf x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r,
                                 _mm512_set1_epi32(0x7FC00000));
}
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
#if PAGEDLLM_AVX512BF16
// vcvtneps2bf16 rounds to nearest even in one instruction; unlike c10 it flushes float32
// denormals (below 1.2e-38) to zero, a difference no activation of a real model shows.
inline __m256i bf16_bits(vf x) {
  const __m256bh h = _mm512_cvtneps_pbh(x);
  return reinterpret_cast<const __m256i&>(h);
}
#else
inline __m256i bf16_bits(vf x) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(x), 16));
}
#endif
inline void vstore(bf16_t* p, vf x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x));
}
inline void vstore(fp16_t* p, vf x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// x rounded to T and back: where the PyTorch layer materialises a T tensor mid-formula.
template <typename T>
inline vf vround(vf x) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(x)), 16));
  } else if constexpr (std::is_same_v<T, fp16_t>) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    return x;
  }
}
#elif PAGEDLLM_AVX2
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const bf16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf vload(const fp16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i bf16_rounded_bits(vf x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan);
}
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline void vstore(bf16_t* p, vf x) {
  const __m256i hi = _mm256_srli_epi32(bf16_rounded_bits(x), 16);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void vstore(fp16_t* p, vf x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename T>
inline vf vround(vf x) {
  if constexpr (std::is_same_v<T, bf16_t>) {
    return _mm256_castsi256_ps(bf16_rounded_bits(x));
  } else if constexpr (std::is_same_v<T, fp16_t>) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    return x;
  }
}
#endif

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// Rows of one 2-D operand: base pointer and row stride in elements.
template <typename T>
struct Rows {
  T* p;
  int64_t stride;
  T* row(int64_t r) const { return p + r * stride; }
};

template <typename T>
Rows<T> rows_of(const at::Tensor& t) {
  return {static_cast<T*>(t.data_ptr()), t.stride(0)};
}

// Elements per parallel chunk: a decode batch splits over a few threads (the workers spin between
// regions, so a fork costs ~1-2 us), a single row stays on the calling thread.
constexpr int64_t kGrainElements = 8192;
int64_t grain_for(int64_t per_row) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, per_row));
}

// RMSNorm of one row. h = x (+ residual, rounded to T and stored when given); y = h * rsqrt(
// mean(h^2) + eps) in float32; out = T(w * T(y)) or, with an offset (Gemma's weight - 1),
// T(y * (offset + w)).
template <typename T>
void rms_row(const T* x, const T* res, T* h_out, const T* w, T* out, int64_t n, float eps,
             float offset) {
  float sq = 0.f;
  int64_t c = 0;
  const T* h = x;
  if (res != nullptr) h = h_out;
#if PAGEDLLM_AVX512 || PAGEDLLM_AVX2
  {
    vf acc = vset(0.f);
    for (; c + kLanes <= n; c += kLanes) {
      vf v = vload(x + c);
      if (res != nullptr) {
        v = vround<T>(vadd(v, vload(res + c)));
        vstore(h_out + c, v);
      }
      acc = vadd(acc, vmul(v, v));
    }
    sq = vsum(acc);
  }
#endif
  // The tail (all of a row in the scalar build) sums in double: one float accumulator over
  // thousands of squares drifts further from ATen's blocked sum than the vector lanes do.
  double tail = 0.0;
  for (; c < n; ++c) {
    float v = static_cast<float>(x[c]);
    if (res != nullptr) {
      h_out[c] = static_cast<T>(v + static_cast<float>(res[c]));
      v = static_cast<float>(h_out[c]);
    }
    tail += static_cast<double>(v * v);
  }
  const float mean = static_cast<float>(sq + tail) / static_cast<float>(n);
  const float inv = 1.f / std::sqrt(mean + eps);
  c = 0;
#if PAGEDLLM_AVX512 || PAGEDLLM_AVX2
  {
    const vf vinv = vset(inv), voff = vset(offset);
    for (; c + kLanes <= n; c += kLanes) {
      const vf y = vmul(vload(h + c), vinv);
      const vf wv = vload(w + c);
      vstore(out + c, offset != 0.f ? vmul(y, vadd(voff, wv)) : vmul(wv, vround<T>(y)));
    }
  }
#endif
  for (; c < n; ++c) {
    const float y = static_cast<float>(h[c]) * inv;
    const float wv = static_cast<float>(w[c]);
    out[c] = static_cast<T>(offset != 0.f ? y * (offset + wv) : wv * round_to<T>(y));
  }
}

// out = T(T(silu(g)) * u) for one row of [gate | up]; silu(g) = g / (1 + exp(-g)), -0 where
// exp(-g) overflows (as PyTorch's, whose exp returns inf there).
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t d) {
  int64_t c = 0;
#if PAGEDLLM_AVX512 || PAGEDLLM_AVX2
  {
    const vf one = vset(1.f), zero = vset(0.f), neg_zero = vset(-0.f), lo = vset(-88.3f);
    for (; c + kLanes <= d; c += kLanes) {
      const vf g = vload(gate + c);
      vf s = vdiv(g, vadd(one, vexp(vsub(zero, g))));
      s = vselect_lt(g, lo, neg_zero, s);
      vstore(out + c, vmul(vround<T>(s), vload(up + c)));
    }
  }
#endif
  for (; c < d; ++c) {
    const float g = static_cast<float>(gate[c]);
    const float s = g / (1.f + std::exp(-g));
    out[c] = static_cast<T>(round_to<T>(s) * static_cast<float>(up[c]));
  }
}

// out = T(T(gelu_tanh(g)) * u) for one row of [gate | up]: gelu_tanh(g) = 0.5 g (1 + tanh(z)),
// z = sqrt(2/pi) (g + 0.044715 g^3), evaluated as g / (1 + exp(-2z)), the same function without
// the cancellation of 1 + tanh(z) where tanh nears -1 (g below about -3). PyTorch evaluates the
// first form, whose 1 + tanh(z) keeps only float32's absolute accuracy there (6e-8): those tiny
// outputs agree with it to that, not to the last bit; -0 where exp(-2z) overflows, as PyTorch's.
template <typename T>
void gelu_tanh_mul_row(const T* gate, const T* up, T* out, int64_t d) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;
  int64_t c = 0;
#if PAGEDLLM_AVX512 || PAGEDLLM_AVX2
  {
    const vf one = vset(1.f), neg_zero = vset(-0.f), lo = vset(-88.3f);
    const vf beta2 = vset(2.f * kBeta), kappa = vset(kKappa), zero = vset(0.f);
    for (; c + kLanes <= d; c += kLanes) {
      const vf g = vload(gate + c);
      const vf z2 = vmul(beta2, vadd(g, vmul(kappa, vmul(vmul(g, g), g))));  // 2z
      vf s = vdiv(g, vadd(one, vexp(vsub(zero, z2))));
      s = vselect_lt(z2, lo, neg_zero, s);
      vstore(out + c, vmul(vround<T>(s), vload(up + c)));
    }
  }
#endif
  for (; c < d; ++c) {
    const float g = static_cast<float>(gate[c]);
    const float z = kBeta * (g + kKappa * (g * g * g));
    const float s = g / (1.f + std::exp(-2.f * z));
    out[c] = static_cast<T>(round_to<T>(s) * static_cast<float>(up[c]));
  }
}

// Neox-style rotation of one head's first rot dims in place: with half = rot / 2,
// x1' = T(T(x1 c1) - T(x2 s1)), x2' = T(T(x2 c2) + T(x1 s2)), the tables rounded to T first.
template <typename T>
void rotate_head(T* x, const float* cs, const float* sn, int64_t rot) {
  const int64_t half = rot / 2;
  int64_t i = 0;
#if PAGEDLLM_AVX512 || PAGEDLLM_AVX2
  for (; i + kLanes <= half; i += kLanes) {
    const vf x1 = vload(x + i), x2 = vload(x + half + i);
    const vf c1 = vround<T>(vload(cs + i)), c2 = vround<T>(vload(cs + half + i));
    const vf s1 = vround<T>(vload(sn + i)), s2 = vround<T>(vload(sn + half + i));
    vstore(x + i, vsub(vround<T>(vmul(x1, c1)), vround<T>(vmul(x2, s1))));
    vstore(x + half + i, vadd(vround<T>(vmul(x2, c2)), vround<T>(vmul(x1, s2))));
  }
#endif
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
    const float c1 = round_to<T>(cs[i]), c2 = round_to<T>(cs[half + i]);
    const float s1 = round_to<T>(sn[i]), s2 = round_to<T>(sn[half + i]);
    x[i] = static_cast<T>(round_to<T>(x1 * c1) - round_to<T>(x2 * s1));
    x[half + i] = static_cast<T>(round_to<T>(x2 * c2) + round_to<T>(x1 * s2));
  }
}

void check_rows(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, op, ": ", name,
              " must be a 2-D CPU tensor with unit inner stride");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, double offset,
                                            const std::optional<at::Tensor>& residual) {
  check_rows(x, "rms_norm", "x");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  at::Tensor h = residual.has_value() ? at::empty({x.size(0), x.size(1)}, x.options()) : x;
  rms_norm_into(x, weight, eps, offset, residual, out, h);
  return {out, h};
}

void rms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, double offset,
                   const std::optional<at::Tensor>& residual, const at::Tensor& out,
                   const at::Tensor& h) {
  check_rows(x, "rms_norm", "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0, "rms_norm: rows must not be empty");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 1 && weight.size(0) == n &&
                  weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [", n, "] tensor of x's dtype");
  if (residual.has_value()) {
    check_rows(*residual, "rms_norm", "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual must have x's shape and dtype");
  }
  for (const at::Tensor* t : {&out, &h}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == n && t->stride(1) == 1 &&
                    t->scalar_type() == x.scalar_type() && t->device().is_cpu(),
                "rms_norm: outputs must be [rows, n] tensors of x's dtype with unit inner stride");
  }
  TORCH_CHECK(residual.has_value() || h.data_ptr() == x.data_ptr(),
              "rms_norm: without a residual h is x itself");
  dispatch_compute(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const Rows<T> xr = rows_of<T>(x), orow = rows_of<T>(out), hr = rows_of<T>(h);
    const Rows<T> rr = residual.has_value() ? rows_of<T>(*residual) : Rows<T>{nullptr, 0};
    const T* w = static_cast<const T*>(weight.data_ptr());
    at::parallel_for(0, rows, grain_for(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        rms_row<T>(xr.row(r), rr.p ? rr.row(r) : nullptr, hr.row(r), w, orow.row(r), n,
                   static_cast<float>(eps), static_cast<float>(offset));
      }
    });
  });
}

namespace {

// [rows, 2d] -> [rows, d] through one of the gated row kernels.
template <template <typename> class Row>
void gated_into(const at::Tensor& x, const at::Tensor& out, const char* op) {
  check_rows(x, op, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, op, ": the last dim must be even ([gate | up])");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == d && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type() && out.device().is_cpu(),
              op, ": out must be a [rows, d] tensor of x's dtype with unit inner stride");
  dispatch_compute(x.scalar_type(), op, [&](auto tag) {
    using T = decltype(tag);
    const Rows<T> xr = rows_of<T>(x), orow = rows_of<T>(out);
    at::parallel_for(0, rows, grain_for(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) Row<T>::run(xr.row(r), xr.row(r) + d, orow.row(r), d);
    });
  });
}

template <template <typename> class Row>
at::Tensor gated(const at::Tensor& x, const char* op) {
  check_rows(x, op, "x");
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  gated_into<Row>(x, out, op);
  return out;
}

template <typename T>
struct SiluRow {
  static void run(const T* g, const T* u, T* o, int64_t d) { silu_mul_row<T>(g, u, o, d); }
};
template <typename T>
struct GeluTanhRow {
  static void run(const T* g, const T* u, T* o, int64_t d) { gelu_tanh_mul_row<T>(g, u, o, d); }
};

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x) { return gated<SiluRow>(x, "silu_and_mul"); }

void silu_and_mul_into(const at::Tensor& x, const at::Tensor& out) {
  gated_into<SiluRow>(x, out, "silu_and_mul");
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& x) {
  return gated<GeluTanhRow>(x, "gelu_tanh_and_mul");
}

void rotary_embedding(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim) {
  TORCH_CHECK(positions.device().is_cpu() && positions.dim() == 1 &&
                  positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "rotary_embedding: positions must be a contiguous 1-D int64 CPU tensor");
  const int64_t tokens = positions.size(0);
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->size(0) == tokens &&
                    t->stride(2) == 1 && t->scalar_type() == q.scalar_type(),
                "rotary_embedding: q and k must be [tokens, heads, head_size] CPU tensors of "
                "one dtype with unit inner stride");
    TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= t->size(2),
                "rotary_embedding: rotary_dim ", rotary_dim, " must be even and <= head_size");
  }
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->size(1) == rotary_dim &&
                    t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->sizes() == cos.sizes(),
                "rotary_embedding: cos and sin must be contiguous [max_position, rotary_dim] "
                "float32 CPU tensors");
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_embedding: position ", pos[t],
                " is outside the table [0, ", max_pos, ")");
  }
  const float* ct = cos.data_ptr<float>();
  const float* st = sin.data_ptr<float>();
  const int64_t hq = q.size(1), hk = k.size(1);
  dispatch_compute(q.scalar_type(), "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    T* qp = static_cast<T*>(q.data_ptr());
    T* kp = static_cast<T*>(k.data_ptr());
    const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
    at::parallel_for(0, tokens, grain_for((hq + hk) * rotary_dim), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* cs = ct + pos[t] * rotary_dim;
        const float* sn = st + pos[t] * rotary_dim;
        for (int64_t h = 0; h < hq; ++h) {
          rotate_head<T>(qp + t * qs0 + h * qs1, cs, sn, rotary_dim);
        }
        for (int64_t h = 0; h < hk; ++h) {
          rotate_head<T>(kp + t * ks0 + h * ks1, cs, sn, rotary_dim);
        }
      }
    });
  });
}

}  // namespace pagedllm
