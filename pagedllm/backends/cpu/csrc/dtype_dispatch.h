// One dispatch on a float tensor's element type, shared by the weight GEMMs whose activations may
// be float32, bfloat16 or float16 (gemm_i8.cpp's W8A8 and int8 split paths, gemm_q4.cpp's
// group-wise paths), so each reports a wrong dtype in the same words.
#pragma once

#include "tensor_api.h"

namespace pagedllm {

// fn(typed pointer to t's elements) for a float32, bfloat16 or float16 t; any other dtype is an
// error that starts with `name` (the caller's op).
template <typename Fn>
void with_float_elements(const torch::Tensor& t, const char* name, const Fn& fn) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return fn(t.data_ptr<float>());
    case at::kBFloat16:
      return fn(t.data_ptr<at::BFloat16>());
    case at::kHalf:
      return fn(t.data_ptr<at::Half>());
    default:
      TORCH_CHECK(false, name, ": x must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

}  // namespace pagedllm
