// The decode stack (decode_stack.cpp): every layer of a Llama-shaped decoder run in one call
// per decode step, through the same kernels the Python layers call one by one.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace pagedllm::decode {

// Adds the DecodeStack and StackLinear classes to the weight-GEMM extension's module.
void bind_decode_stack(pybind11::module& m);

}  // namespace pagedllm::decode
