// The group-wise GEMMs' binder, apart from gemm_q4.h: only the sources that bind (gemm_q4.cpp,
// gemm.cpp) pay for pybind11 and torch's type casters; the kernel sources include gemm_q4.h.
#pragma once

#include <torch/extension.h>

namespace pagedllm::gemm {

// Adds pack_groupwise, groupwise_gemm, quantize_groups and the build's facts to the module.
void bind_groupwise(pybind11::module& m);

}  // namespace pagedllm::gemm
