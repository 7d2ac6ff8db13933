// The group-wise (4-bit / 8-bit, groups of 32 along K) weight GEMM of the CPU backend
// (gemm_q4.cpp; packing in gemm_q4_pack.cpp; layout in gemm_q4_layout.h). Bound into the
// weight-GEMM extension by gemm.cpp's module (bind_groupwise), so that only gemm.cpp pays for
// pybind11 and torch's type casters.
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

// y [P, N]: rows starts[i]..starts[i + 1] of x [P, K] times packed[i]'s layer (one format and
// shape for all: an MoE layer's experts), as groupwise_gemm on each group's rows, in one call.
torch::Tensor groupwise_gemm_grouped(const torch::Tensor& x, const std::vector<torch::Tensor>& packed,
                                     const std::vector<int64_t>& starts, int64_t n, int64_t bits,
                                     bool half_scales, bool with_offset, bool factored, bool dot,
                                     bool levels, const std::string& rows_kernel);

// x [M, K] -> (int8 [M, K], float32 [M, K/32]): the dot path's rounding of x per group; split:
// [2M, K], [2M, K/32], each row then the rounding of what it left.
std::tuple<torch::Tensor, torch::Tensor> quantize_groups(const torch::Tensor& x, bool split);

// The kernels of few bf16 rows on 4-bit layers this build runs (none without vdpbf16ps).
std::vector<std::string> bf16_rows_kernels();

// Rows of bf16 x up to which this build's default kernel rounds them to int16 per group of 32
// (AVX2 without AVX-512: gemm_q4_avx2.h's avx2_i16_rows; 0: none here).
int64_t int16_rows();

// Rows of bf16 x from which this build's default kernel runs them, rounded to int16 as
// int16_rows' kernel rounds them, on register tiles over widened weights (AVX2 without
// AVX-512: gemm_q4_avx2_tiles.h; every layer, IQ4 levels too; 0: none here). With int16_rows
// it covers every batch size.
int64_t int16_tiles_from();

// Rows of bf16 x from which the float path runs on AMX tiles (0: never here); four_bit_split:
// on a 4-bit layer under the split kernel.
int64_t amx_rows_from(bool four_bit_split);

// (rows up to which float32 x dequantises in registers, rows per dot-path tile) of this build.
std::tuple<int64_t, int64_t> register_tile_rows();

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
