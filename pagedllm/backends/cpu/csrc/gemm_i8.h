// W8A8 GEMM of the CPU backend (gemm_i8.cpp): int8 activations (dynamic, per token) times int8
// weights (per output channel), integer dot products, int32 sums. Bound into the weight-GEMM
// extension by gemm.cpp's module.
#pragma once

#include "tensor_api.h"

#include <tuple>

namespace pagedllm::gemm {

// int8 [N, K] -> int8 [ceil(N/16), ceil(K/4), 64] (zero-padded).
torch::Tensor pack_w8a8(const torch::Tensor& weight);

// x [M, K] (float32/bf16/fp16) -> (int8 [M, K], float32 scales [M]): round(x / (max|x| / 127)),
// or with each row's maximum given (absmax [M]): the activations of W8A8 layers, and the
// per-output-channel int8 weights made at load (layers.quantization.int8.quantize_per_channel).
std::tuple<torch::Tensor, torch::Tensor> quantize_rows(const torch::Tensor& x,
                                                       const c10::optional<torch::Tensor>& absmax);

// int32 [M, N] = qx [M, K] int8 @ W^T: the exact sums, for tests.
// allow_amx=false keeps the AMX-INT8 tiles out (tests compare the paths).
torch::Tensor w8a8_gemm_s32(const torch::Tensor& qx, const torch::Tensor& packed, int64_t n,
                            bool allow_amx);

// y [M, N] = quantize_rows(x) . W^T * sx[M] * sw[N] (+ bias), in x's dtype.
torch::Tensor w8a8_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                        const torch::Tensor& w_scale,
                        const c10::optional<torch::Tensor>& bias, bool allow_amx);

// Int8 weight-only layers at near-16-bit activation precision: each row of x is split into two
// int8 planes, x = hi * s_hi + lo * s_lo (s_hi = max|x| / 127, s_lo = s_hi / 254), and both run
// through the W8A8 sums. split_rows gives (int8 [2M, K]: the M hi rows then the M lo rows,
// float32 [2M]: their scales), for tests.
std::tuple<torch::Tensor, torch::Tensor> split_rows(const torch::Tensor& x);

// y [M, N] = (hi . W^T * s_hi + lo . W^T * s_lo) * sw[N] (+ bias), in x's dtype. In builds
// with vdpbf16ps a bf16 x of dp_min_rows rows or more (-1: int8_dp_min_rows(); 0: never) takes
// int8_groups_dp_gemm instead, unless AMX-INT8 tiles run the planes.
torch::Tensor int8_split_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                              const torch::Tensor& w_scale,
                              const c10::optional<torch::Tensor>& bias, bool allow_amx,
                              int64_t dp_min_rows);

// This build's default for int8_split_gemm's dp_min_rows (0 where there is no vdpbf16ps).
int64_t int8_dp_min_rows();

#if defined(__AVX512BF16__)
// y [M, N] = x . dequantised(W)^T + bias for bf16 x [M, K] (K even) and the group-layout int8
// weights above: each K-block of a panel converted once to bf16 for vdpbf16ps (gemm_dp.h), float32
// sums, scaled by w_scale [N] (defined in gemm.cpp). int8_split_gemm hands it many-row batches.
torch::Tensor int8_groups_dp_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                  const float* w_scale, const float* bias);
#endif

// Which integer dot product this build uses ("avx512vnni", "avx2", "scalar"): W8A8, the int8
// split planes and the group-wise dot path all take the same one.
std::string int8_dot_isa();

}  // namespace pagedllm::gemm
