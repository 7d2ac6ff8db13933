// Token sampling of the CPU backend (sampling.cpp); bindings.cpp exposes it.
#pragma once

#include "tensor_api.h"

#include <optional>
#include <tuple>

namespace pagedllm {

// One token per row of logits [n, vocab] (float32, bfloat16 or float16, unit inner stride), and
// its log-probability under the raw distribution: log_softmax(raw)[token], where raw is the
// model's unmodified logits ([n, vocab], any of those dtypes) or, when absent, logits itself.
// temperature [n] float32: 0 takes the first maximum (greedy); otherwise the row is divided by
// it, filtered to the top_k [n] int64 largest (ties at the k-th value kept; >= vocab: off), to
// the nucleus top_p [n] float32 (a token stays when the probability mass strictly above it is at
// most top_p) and to min_p [n] float32 (probability at least min_p times the largest), all three
// judged on the distribution after top-k, and then drawn by inverse CDF in vocabulary order with
// the uniform u [n] float32 in [0, 1).
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits,
                                               const std::optional<at::Tensor>& raw,
                                               const at::Tensor& temperature,
                                               const at::Tensor& top_k, const at::Tensor& top_p,
                                               const at::Tensor& min_p, const at::Tensor& u);

}  // namespace pagedllm
