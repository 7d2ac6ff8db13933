// The group-wise (4-bit / 8-bit, groups of 32 along K) weight GEMM of the CPU backend
// (gemm_q4.cpp; layout in gemm_q4_layout.h). Bound into the weight-GEMM extension by gemm.cpp's
// module through bind_groupwise.
#pragma once

#include <torch/extension.h>

namespace pagedllm::gemm {

// Adds pack_groupwise, groupwise_gemm, quantize_groups and the build's facts to the module.
void bind_groupwise(pybind11::module& m);

}  // namespace pagedllm::gemm
