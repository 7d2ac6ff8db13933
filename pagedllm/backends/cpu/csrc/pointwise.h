// Row-wise layer kernels of the CPU backend (pointwise.cpp); bindings.cpp exposes them.
#pragma once

#include "tensor_api.h"

#include <optional>
#include <tuple>

namespace pagedllm {

// (out, h): h = x + residual rounded to x's dtype (x itself without a residual), out = RMSNorm(h)
// rounded as the PyTorch layer does. x, residual [rows, n] with unit inner stride; weight [n] of
// x's dtype; offset != 0 multiplies by (offset + weight) in float32 (Gemma) instead.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, double offset,
                                            const std::optional<at::Tensor>& residual);

// [rows, 2d] ([gate | up]) -> [rows, d]: silu(gate) * up, rounded as F.silu(gate) * up.
// rms_norm into given outputs (out, and h = x + residual; h is x itself without a residual):
// the decode stack's per-step scratch. Neither may alias x or residual.
void rms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, double offset,
                   const std::optional<at::Tensor>& residual, const at::Tensor& out,
                   const at::Tensor& h);

at::Tensor silu_and_mul(const at::Tensor& x);

// silu_and_mul into a given [rows, d] output (not aliasing x).
void silu_and_mul_into(const at::Tensor& x, const at::Tensor& out);

// The same with gelu(gate, approximate="tanh") (Gemma).
at::Tensor gelu_tanh_and_mul(const at::Tensor& x);

// Neox-style rotary embedding of the first rotary_dim dims of every head of q and k, in place.
// positions [tokens] int64; q/k [tokens, heads, head_size] (any token/head strides); cos/sin
// [max_position, rotary_dim] float32 (the rounding to q's dtype happens here, as .to() would).
void rotary_embedding(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                      const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim);

}  // namespace pagedllm
