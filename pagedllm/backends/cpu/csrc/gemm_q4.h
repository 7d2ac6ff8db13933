// The group-wise (4-bit / 8-bit, groups of 32 along K) weight GEMM of the CPU backend
// (gemm_q4.cpp; packing in gemm_q4_pack.cpp; layout in gemm_q4_layout.h). Bound into the
// weight-GEMM extension by gemm.cpp's module through bind_groupwise.
#pragma once

#include "tensor_api.h"

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "gemm_q4_layout.h"

namespace pagedllm::gemm {

namespace q4 {

// The Format the arguments name, checked (bits 4 or 8; only 4-bit with offsets is factored).
Format format_of(int64_t bits, bool half_scales, bool with_offset, bool factored,
                 bool levels = false);

// The layer's tensors -> uint8 [ceil(N/16), panel bytes] (gemm_q4_pack.cpp).
torch::Tensor pack_groupwise(const torch::Tensor& weight, const torch::Tensor& scale,
                             const c10::optional<torch::Tensor>& offset, int64_t bits,
                             bool half_scales, bool with_offset,
                             const c10::optional<torch::Tensor>& factors,
                             const c10::optional<torch::Tensor>& index, bool levels,
                             const c10::optional<torch::Tensor>& into);

// y [M, N] = x [M, K] @ W^T (+ bias) on pack_groupwise's panels (the binding's groupwise_gemm):
// dot rounds x to int8 per group of 32; rows_kernel "split" or "float" picks the kernel of few
// bf16 rows. The _into form writes a caller's contiguous y of x's dtype (the decode stack's
// scratch, reused by every layer of a step).
torch::Tensor groupwise_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                             int64_t bits, bool half_scales, bool with_offset, bool factored,
                             const c10::optional<torch::Tensor>& bias, bool dot, bool levels,
                             bool allow_amx, const std::string& rows_kernel);
void groupwise_gemm_into(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                         int64_t bits, bool half_scales, bool with_offset, bool factored,
                         const c10::optional<torch::Tensor>& bias, bool dot, bool levels,
                         bool allow_amx, const std::string& rows_kernel, torch::Tensor& y);

// Bytes of one panel (16 rows of W) of a K-wide layer in the format the arguments name.
int64_t panel_bytes(int64_t k, int64_t bits, bool half_scales, bool with_offset, bool factored,
                    bool levels);

// uint8 [nbytes] in memory aligned to 2 MiB and advised for transparent huge pages (Linux): the
// panels of a stack of small experts packed side by side into one run of memory (experts each
// in a ~2 MB allocation of its own, made between other temporaries, read 1.4x slower from
// memory in a micro-benchmark on a Xeon VM; fused_moe.StackStorage).
torch::Tensor huge_page_empty(int64_t nbytes);

// Rows ``rows`` of W, float32 [R, K], from pack_groupwise's panels (the inverse of the pack,
// rounded as the definition dequantises): an embedding table tied to a packed head is read
// from the head's panels instead of being held a second time.
torch::Tensor groupwise_weight_rows(const torch::Tensor& packed, int64_t n, int64_t k,
                                    int64_t bits, bool half_scales, bool with_offset,
                                    bool factored, const torch::Tensor& rows, bool levels);

// Reads every byte of t once on all threads (the benchmarks' read-bandwidth probe).
int64_t read_bytes(const torch::Tensor& t);

// GGUF blocks uint8 [N, row bytes] -> Q4_0 / Q4_1 / Q4_K: (nibbles uint8 [N, K/2], scale,
// offset float32 [N, K/32]); Q6_K / Q3_K: (int8 q [N, K], d * sc [N, K/16], d [N, K/256]);
// Q5_0 / IQ4_NL / IQ4_XS: (int8 q [N, K], scale [N, K/32]); Q5_K: (int8 q [N, K], scale,
// offset [N, K/32]) (gguf_decode.cpp).
std::vector<torch::Tensor> decode_gguf_blocks(const torch::Tensor& blocks,
                                              const std::string& kind);

}  // namespace q4
}  // namespace pagedllm::gemm
