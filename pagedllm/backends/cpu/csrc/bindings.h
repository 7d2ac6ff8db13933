// The layer kernels' Python bindings (bindings.cpp), added to the one CPU extension's module by
// gemm.cpp's module definition.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace pagedllm {

// Paged attention, cache ops, row-wise layer kernels and sampling.
void bind_layer_ops(pybind11::module& m);

}  // namespace pagedllm
