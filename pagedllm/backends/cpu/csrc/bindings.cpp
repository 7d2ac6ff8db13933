// Python bindings of the layer kernels: paged attention, cache ops, row-wise layer kernels and
// sampling, part of the one CPU extension (its module is defined in gemm.cpp; loaded by
// pagedllm/backends/cpu/_ops.py).
//
// Every kernel releases the GIL (arguments are converted before, results after), so another
// Python thread, e.g. the server's event loop, keeps running while attention computes.
#include "bindings.h"

#include "attention.h"
#include "pointwise.h"
#include "sampling.h"

namespace {
using NoGil = py::call_guard<py::gil_scoped_release>;
}  // namespace

namespace pagedllm {

void bind_layer_ops(pybind11::module& m) {
  m.def("paged_attention", &pagedllm::paged_attention, "causal paged attention, flat batch",
        NoGil(), py::arg("query"), py::arg("kv_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"),
        py::arg("sliding_window"), py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0,
        py::arg("soft_cap") = 0.0);
  m.def("reshape_and_cache", &pagedllm::reshape_and_cache, "write new K/V at their slots",
        NoGil(), py::arg("key"), py::arg("value"), py::arg("kv_cache"), py::arg("slot_mapping"),
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0);
  m.def("copy_blocks", &pagedllm::copy_blocks, "copy-on-write of blocks in every layer",
        NoGil(), py::arg("kv_caches"), py::arg("pairs"));
  m.def("swap_blocks", &pagedllm::swap_blocks, "move blocks between two pools of one layer",
        NoGil(), py::arg("src"), py::arg("dst"), py::arg("pairs"));
  m.def("rms_norm", &pagedllm::rms_norm, "RMSNorm with the residual add fused: (out, x + res)",
        NoGil(), py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("offset") = 0.0,
        py::arg("residual") = py::none());
  m.def("silu_and_mul", &pagedllm::silu_and_mul, "silu(gate) * up of a [gate | up] tensor",
        NoGil(), py::arg("x"));
  m.def("gelu_tanh_and_mul", &pagedllm::gelu_tanh_and_mul,
        "gelu(gate, approximate='tanh') * up of a [gate | up] tensor", NoGil(), py::arg("x"));
  m.def("rotary_embedding", &pagedllm::rotary_embedding, "neox rotary embedding, in place",
        NoGil(), py::arg("positions"), py::arg("q"), py::arg("k"), py::arg("cos"),
        py::arg("sin"), py::arg("rotary_dim"));
  m.def("sample_rows", &pagedllm::sample_rows,
        "one token per row (greedy / temperature, top-k, top-p, min-p) and its raw logprob",
        NoGil(), py::arg("logits"), py::arg("raw"), py::arg("temperature"), py::arg("top_k"),
        py::arg("top_p"), py::arg("min_p"), py::arg("u"));
  m.def("built_with_avx2", &pagedllm::built_with_avx2, "whether the AVX2/FMA path was compiled");
  // built_isa (the widest vector path compiled in) is gemm.cpp's: one answer per module.
}

}  // namespace pagedllm
