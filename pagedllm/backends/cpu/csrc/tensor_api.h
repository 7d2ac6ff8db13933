// The slice of ATen the kernel sources use: Tensor, its methods, the few factories they call and
// parallel_for. Not <torch/extension.h> (pybind11 and the C++ frontend: ~30 s of compiler time per
// source, ~3 s for this) nor <ATen/ATen.h> (every op, ~13 s): only the binding sources (bindings.cpp,
// gemm.cpp) pay for those, once each, and the ISA compile check compiles every source twice.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

// The kernels spell tensors torch::Tensor, as the bindings do; torch/types.h makes the same alias.
namespace torch {
using namespace at;  // NOLINT(google-build-using-namespace)
}  // namespace torch
