// Weight GEMM of the CPU backend: y[M, N] = x[M, K] @ W[N, K]^T (* scale[N]) (+ bias[N]) with W
// stored in 16 or 8 bits (bf16, fp16, int8 with per-output-channel scales) and float32 sums.
//
// Why our own kernel: on processors without bf16 arithmetic (AVX2-only, plain AVX-512) PyTorch's
// bf16 GEMM is slower than float32, and oneDNN refuses to pack bf16 weights. Decode steps are
// bound by streaming the weights, so reading 2 or 1 bytes per weight and converting in registers
// is the win; prefill is bound by arithmetic, so there the conversion is done once per K-chunk of
// a panel into a small float32 buffer and amortised over all rows.
//
// Layout: W is packed once at load as panels [ceil(N/16)][K][16] (columns padded with zeros),
// so one panel's weights for consecutive k are contiguous 16-wide rows. Threads split the panels;
// each panel keeps a [M][16] float32 accumulator, and the epilogue applies scale and bias once
// per output and converts to the activations' dtype.
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <string>
#include <vector>

#include "bindings.h"
#include "decode_stack.h"
#include "gemm_amx.h"
#include "gemm_dp.h"
#include "gemm_i8.h"
#include "gemm_q4.h"
#include "gemm_vec.h"
#include "tensor_api.h"

namespace pagedllm::gemm {

#if !defined(__AVX2__) && !defined(__AVX512F__)
float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
#endif

constexpr int64_t kPanel = 16;
// K-chunk converted to float32 at a time when there are many rows (64 KiB of scratch).
constexpr int64_t kBlockK = 1024;

// c[R][16] (+)= x[R, 0:kc] @ w[0:kc][16]; x rows are ldx apart.
template <int R, typename Tag>
inline void micro(const float* x, int64_t ldx, const typename Tag::T* w, int64_t kc, float* c,
                  bool accumulate) {
  V16 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = accumulate ? v_load(c + r * kPanel) : v_zero();
  for (int64_t k = 0; k < kc; ++k) {
    const V16 wv = w_load(Tag{}, w + k * kPanel);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[r] = v_fma(acc[r], wv, x[r * ldx + k]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) v_store(c + r * kPanel, acc[r]);
}

// One row (a decode step of one sequence): four accumulators over k % 4, so that consecutive
// FMAs do not wait for each other's latency; the loop is then bound by streaming the weights.
template <typename Tag>
inline void micro_one(const float* x, const typename Tag::T* w, int64_t kc, float* c,
                      bool accumulate) {
  V16 a0 = accumulate ? v_load(c) : v_zero(), a1 = v_zero(), a2 = v_zero(), a3 = v_zero();
  int64_t k = 0;
  for (; k + 4 <= kc; k += 4) {
    a0 = v_fma(a0, w_load(Tag{}, w + k * kPanel), x[k]);
    a1 = v_fma(a1, w_load(Tag{}, w + (k + 1) * kPanel), x[k + 1]);
    a2 = v_fma(a2, w_load(Tag{}, w + (k + 2) * kPanel), x[k + 2]);
    a3 = v_fma(a3, w_load(Tag{}, w + (k + 3) * kPanel), x[k + 3]);
  }
  for (; k < kc; ++k) a0 = v_fma(a0, w_load(Tag{}, w + k * kPanel), x[k]);
  v_store(c, v_add(v_add(a0, a1), v_add(a2, a3)));
}

// micro<rows> for a run-time row count 1..kRows.
template <typename Tag, int R = kRows>
inline void micro_rows(int rows, const float* x, int64_t ldx, const typename Tag::T* w, int64_t kc,
                       float* c, bool accumulate) {
  if constexpr (R > 1) {
    if (rows < R) return micro_rows<Tag, R - 1>(rows, x, ldx, w, kc, c, accumulate);
    micro<R, Tag>(x, ldx, w, kc, c, accumulate);
  } else {
    micro_one<Tag>(x, w, kc, c, accumulate);
  }
}

// acc[M][16] = x[M, K] @ panel[K][16].
template <typename Tag>
void panel_gemm(const float* x, int64_t m, int64_t k, const typename Tag::T* wp, float* acc,
                float* scratch) {
  if (m <= kRows) {
    // Few rows (decode): every weight is converted once, in registers.
    micro_rows<Tag>(static_cast<int>(m), x, k, wp, k, acc, false);
    return;
  }
  for (int64_t k0 = 0; k0 < k; k0 += kBlockK) {
    const int64_t kc = std::min(kBlockK, k - k0);
    const float* wf;
    if constexpr (std::is_same_v<Tag, F32W>) {
      wf = wp + k0 * kPanel;
    } else {
      for (int64_t i = 0; i < kc; ++i)
        v_store(scratch + i * kPanel, w_load(Tag{}, wp + (k0 + i) * kPanel));
      wf = scratch;
    }
    for (int64_t m0 = 0; m0 < m; m0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, m - m0));
      micro_rows<F32W>(rows, x + m0 * k + k0, k, wf, kc, acc + m0 * kPanel, k0 > 0);
    }
  }
}

template <typename Out>
void epilogue(const float* acc, int64_t m, int64_t n, int64_t n0, int64_t cols, const float* scale,
              const float* bias, Out* y) {
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      float v = acc[r * kPanel + j];
      if (scale != nullptr) v *= scale[n0 + j];
      if (bias != nullptr) v += bias[n0 + j];
      y[r * n + n0 + j] = static_cast<Out>(v);
    }
  }
}

// Threads split the panels; panel_fn(p, acc, scratch) fills one panel's [M][16] float32 sums,
// which the epilogue scales, biases and stores.
template <typename Out, typename PanelFn>
void run_panels(int64_t m, int64_t n, size_t scratch_floats, const float* scale, const float* bias,
                Out* y, const PanelFn& panel_fn) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(m * kPanel));
    std::vector<float> scratch(scratch_floats);
    for (int64_t p = begin; p < end; ++p) {
      panel_fn(p, acc.data(), scratch.data());
      const int64_t n0 = p * kPanel;
      epilogue(acc.data(), m, n, n0, std::min(kPanel, n - n0), scale, bias, y);
    }
  });
}

// As run_panels, with threads splitting pairs of panels: pair_fn(p, acc0, acc1, scratch) fills
// panels p and p + 1, one_fn(p, acc, scratch) an odd last panel alone.
template <typename Out, typename PairFn, typename OneFn>
void run_panel_pairs(int64_t m, int64_t n, size_t scratch_floats, const float* scale,
                     const float* bias, Out* y, const PairFn& pair_fn, const OneFn& one_fn) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(static_cast<size_t>(2 * m * kPanel));
    std::vector<float> scratch(scratch_floats);
    float* acc1 = acc.data() + m * kPanel;
    for (int64_t q = begin; q < end; ++q) {
      const int64_t p = 2 * q;
      const bool pair = p + 1 < panels;
      if (pair)
        pair_fn(p, acc.data(), acc1, scratch.data());
      else
        one_fn(p, acc.data(), scratch.data());
      for (int64_t j = p; j < p + (pair ? 2 : 1); ++j) {
        const int64_t n0 = j * kPanel;
        epilogue(j == p ? acc.data() : acc1, m, n, n0, std::min(kPanel, n - n0), scale, bias, y);
      }
    }
  });
}

#if defined(__AVX512F__)
// Two panels per tile on AVX-512 (one zmm per panel row): each broadcast of x feeds two FMAs, as
// in gemm_dp.h's panel_pair. A 12-row one-panel tile needs a broadcast per FMA; measured
// stand-alone from L1 on a Zen 4 EPYC (fp16 weights): 2.4-2.9 G FMAs/s per core against 3.1-3.2
// for 8 rows x 2 panels. The weights are converted in registers by every row tile.
constexpr int kPairRows = 8;  // 16 zmm accumulators

template <int R, typename Tag>
inline void micro_pair(const float* x, int64_t ldx, const typename Tag::T* w0,
                       const typename Tag::T* w1, int64_t kc, float* c0, float* c1) {
  V16 a0[R], a1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = v_zero();
  for (int64_t k = 0; k < kc; ++k) {
    const V16 v0 = w_load(Tag{}, w0 + k * kPanel), v1 = w_load(Tag{}, w1 + k * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      a0[r] = v_fma(a0[r], v0, xv);
      a1[r] = v_fma(a1[r], v1, xv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    v_store(c0 + r * kPanel, a0[r]);
    v_store(c1 + r * kPanel, a1[r]);
  }
}

#endif

template <typename Tag, typename Out>
void run(const float* x, const typename Tag::T* w, const float* scale, const float* bias, Out* y,
         int64_t m, int64_t k, int64_t n) {
  const size_t scratch = m > kRows ? static_cast<size_t>(kBlockK * kPanel) : 0;
  const auto one = [&](int64_t p, float* acc, float* buf) {
    panel_gemm<Tag>(x, m, k, w + p * k * kPanel, acc, buf);
  };
#if defined(__AVX512F__)
  if (m > 1) {
    const auto pair = [&](int64_t p, float* acc0, float* acc1, float*) {
      for (int64_t m0 = 0; m0 < m; m0 += kPairRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kPairRows, m - m0));
        with_rows<kPairRows>(rows, [&](auto r) {
          micro_pair<decltype(r)::value, Tag>(x + m0 * k, k, w + p * k * kPanel,
                                              w + (p + 1) * k * kPanel, k, acc0 + m0 * kPanel,
                                              acc1 + m0 * kPanel);
        });
      }
    };
    return run_panel_pairs(m, n, scratch, scale, bias, y, pair, one);
  }
#endif
  run_panels(m, n, scratch, scale, bias, y, one);
}

#if defined(PAGEDLLM_GEMM_DP)
// bf16 x [M, K] (K even) @ bf16 or int8 panels with vdpbf16ps (gemm_dp.h), bf16 y. Threads split
// pairs of panels (dp::panel_pair); an odd last panel goes alone.
template <typename Tag>
void run_dp(const torch::Tensor& x, const torch::Tensor& w, const float* scale, const float* bias,
            torch::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const typename Tag::T*>(w.data_ptr());
  // The scratch of an odd last panel: kBlockPairs rows of 32 bf16, 16 floats' worth each.
  const size_t scratch = m > dp::kRows ? static_cast<size_t>(dp::kBlockPairs * kPanel) : 0;
  run_panel_pairs(
      m, n, scratch, scale, bias, y.data_ptr<at::BFloat16>(),
      [&](int64_t p, float* acc0, float* acc1, float* buf) {
        dp::panel_pair<Tag>(xp, m, k, wp + p * k * kPanel, wp + (p + 1) * k * kPanel, acc0, acc1,
                            reinterpret_cast<uint16_t*>(buf));
      },
      [&](int64_t p, float* acc, float* buf) {
        dp::panel<Tag>(xp, m, k, wp + p * k * kPanel, acc, reinterpret_cast<uint16_t*>(buf));
      });
}
#endif

#if defined(PAGEDLLM_GEMM_DP)
torch::Tensor int8_groups_dp_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                  const float* w_scale, const float* bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) % 2 == 0,
              "int8_groups_dp_gemm: x must be a bf16 [M, K] with K even");
  const torch::Tensor xb = x.contiguous();
  const int64_t m = xb.size(0), k = xb.size(1), panel_bytes = packed.size(1) * dp::kGroupBytes;
  torch::Tensor y = torch::empty({m, n}, xb.options());
  if (m == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
  const int8_t* wp = packed.data_ptr<int8_t>();
  // The scratch: two panels' blocks of pair rows (32 bf16 each), counted in floats.
  const size_t scratch = static_cast<size_t>(dp::kGroupBlockPairs * dp::kPairWords);
  run_panel_pairs(
      m, n, scratch, w_scale, bias, y.data_ptr<at::BFloat16>(),
      [&](int64_t p, float* acc0, float* acc1, float* buf) {
        dp::panel_pair_groups(xp, m, k, wp + p * panel_bytes, wp + (p + 1) * panel_bytes, acc0,
                              acc1, reinterpret_cast<uint16_t*>(buf));
      },
      [&](int64_t p, float* acc, float* buf) {
        dp::panel_pair_groups(xp, m, k, wp + p * panel_bytes, nullptr, acc, nullptr,
                              reinterpret_cast<uint16_t*>(buf));
      });
  return y;
}
#endif

template <typename Tag>
void run_out(const torch::Tensor& x, const torch::Tensor& w, const float* scale, const float* bias,
             torch::Tensor& y) {
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1);
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const typename Tag::T*>(w.data_ptr());
  switch (y.scalar_type()) {
    case at::kFloat:
      return run<Tag>(xp, wp, scale, bias, y.data_ptr<float>(), m, k, n);
    case at::kBFloat16:
      return run<Tag>(xp, wp, scale, bias, y.data_ptr<at::BFloat16>(), m, k, n);
    case at::kHalf:
      return run<Tag>(xp, wp, scale, bias, y.data_ptr<at::Half>(), m, k, n);
    default:
      TORCH_CHECK(false, "weight_gemm: unsupported activation dtype ", y.scalar_type());
  }
}

// Public launcher: checks everything the loops assume.
torch::Tensor weight_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                          const c10::optional<torch::Tensor>& scale,
                          const c10::optional<torch::Tensor>& bias, bool allow_amx) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "weight_gemm: CPU tensors only");
  TORCH_CHECK(x.dim() == 2, "weight_gemm: x must be [M, K], got ", x.sizes());
  const auto xdt = x.scalar_type();
  TORCH_CHECK(xdt == at::kFloat || xdt == at::kBFloat16 || xdt == at::kHalf,
              "weight_gemm: x must be float32, bfloat16 or float16, got ", xdt);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "weight_gemm: packed weight must be a contiguous [N/16, K, 16], got ",
              packed.sizes());
  const int64_t k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "weight_gemm: x has K=", k, ", weight has K=", packed.size(1));
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "weight_gemm: N=", n,
              " does not fit ", panels, " panels of 16");
  const auto wdt = packed.scalar_type();
  const float* sp = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                    scale->numel() == n,
                "weight_gemm: scale must be a contiguous float32 [N]");
    sp = scale->data_ptr<float>();
  }
  TORCH_CHECK(wdt != at::kChar || sp != nullptr, "weight_gemm: int8 weights need a scale");
  torch::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, "weight_gemm: bias must have N=", n, " elements");
    b = bias->to(at::kFloat).contiguous();
  }
#if defined(PAGEDLLM_GEMM_DP)
  if (xdt == at::kBFloat16 && k % 2 == 0 && (wdt == at::kBFloat16 || wdt == at::kChar) &&
      x.size(0) > 0) {
    const torch::Tensor xb = x.contiguous();
    torch::Tensor y = torch::empty({x.size(0), n}, x.options());
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    if (allow_amx && x.size(0) >= amx::kMinRows && k % 32 == 0 && amx::available()) {
      amx::gemm(reinterpret_cast<const uint16_t*>(xb.data_ptr()), x.size(0), k, packed.data_ptr(),
                wdt == at::kChar, n, sp, bp, reinterpret_cast<uint16_t*>(y.data_ptr()));
      return y;
    }
    if (wdt == at::kBFloat16)
      run_dp<Bf16W>(xb, packed, sp, bp, y);
    else
      run_dp<Int8W>(xb, packed, sp, bp, y);
    return y;
  }
#endif
  const torch::Tensor xf = x.to(at::kFloat).contiguous();
  torch::Tensor y = torch::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  switch (wdt) {
    case at::kBFloat16:
      run_out<Bf16W>(xf, packed, sp, bp, y);
      break;
    case at::kHalf:
      run_out<Fp16W>(xf, packed, sp, bp, y);
      break;
    case at::kChar:
      run_out<Int8W>(xf, packed, sp, bp, y);
      break;
    case at::kFloat:
      run_out<F32W>(xf, packed, sp, bp, y);
      break;
    default:
      TORCH_CHECK(false, "weight_gemm: unsupported weight dtype ", wdt);
  }
  return y;
}

// [N, K] -> [ceil(N/16), K, 16], columns past N zero. A transposing copy: done by blocks of
// kPackK columns so each block's 16 source rows and its destination stay in L1, and split over
// panels across threads. At load it replaces a strided PyTorch copy that cost seconds on 1B models.
constexpr int64_t kPackK = 128;

template <typename E>
void pack_rows(const E* w, int64_t n, int64_t k, E* out) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      E* dst = out + p * k * kPanel;
      const int64_t rows = std::min<int64_t>(kPanel, n - p * kPanel);
      for (int64_t k0 = 0; k0 < k; k0 += kPackK) {
        const int64_t kc = std::min<int64_t>(kPackK, k - k0);
        for (int64_t j = 0; j < rows; ++j) {
          const E* src = w + (p * kPanel + j) * k + k0;
          for (int64_t kk = 0; kk < kc; ++kk) dst[(k0 + kk) * kPanel + j] = src[kk];
        }
      }
    }
  });
}

torch::Tensor pack_panels(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2,
              "pack_panels: weight must be a CPU [N, K], got ", weight.sizes());
  const torch::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  // Zeros only where the last panel has no rows: the rest is overwritten.
  torch::Tensor out = n % kPanel ? torch::zeros({panels, k, kPanel}, w.options())
                                 : torch::empty({panels, k, kPanel}, w.options());
  switch (w.element_size()) {
    case 1:
      pack_rows(static_cast<const uint8_t*>(w.data_ptr()), n, k,
                static_cast<uint8_t*>(out.data_ptr()));
      break;
    case 2:
      pack_rows(static_cast<const uint16_t*>(w.data_ptr()), n, k,
                static_cast<uint16_t*>(out.data_ptr()));
      break;
    case 4:
      pack_rows(static_cast<const uint32_t*>(w.data_ptr()), n, k,
                static_cast<uint32_t*>(out.data_ptr()));
      break;
    default:
      TORCH_CHECK(false, "pack_panels: unsupported element size ", w.element_size());
  }
  return out;
}

std::string built_isa() {
#if defined(__AVX512BF16__)
  return "avx512bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

namespace {

// The group-wise GEMMs (gemm_q4.cpp) in the module.
void bind_groupwise(pybind11::module& m) {
  namespace py = pybind11;
  using NoGil = py::call_guard<py::gil_scoped_release>;
  m.def("pack_groupwise", &q4::pack_groupwise,
        "group-wise weights (uint8 nibbles [N, K/2] or int8 [N, K], float32 scale/offset "
        "[N, K/32]; factored: d, dm [N, K/256, 2] and sc, m uint8 [N, K/32, 2]; levels: int8 "
        "IQ4 levels [N, K], kept 4-bit as their indices) -> uint8 [N/16, panel bytes] (into=: "
        "written there, and returned)",
        NoGil(), py::arg("weight"), py::arg("scale"), py::arg("offset"), py::arg("bits"),
        py::arg("half_scales"), py::arg("with_offset"), py::arg("factors") = py::none(),
        py::arg("index") = py::none(), py::arg("levels") = false, py::arg("into") = py::none());
  m.def("groupwise_panel_bytes", &q4::panel_bytes,
        "bytes of one panel (16 rows of W) of a K-wide layer in the format the arguments name",
        py::arg("k"), py::arg("bits"), py::arg("half_scales"), py::arg("with_offset"),
        py::arg("factored"), py::arg("levels") = false);
  m.def("huge_page_empty", &q4::huge_page_empty,
        "uint8 [nbytes], 2 MiB-aligned and advised for transparent huge pages (Linux)",
        py::arg("nbytes"));
  m.def("groupwise_gemm", &q4::groupwise_gemm,
        "y = x @ W^T (+ bias) on pack_groupwise panels; dot=True rounds x to int8 per group of "
        "32 and uses integer dot products; allow_amx=False keeps bf16 batches off AMX tiles",
        NoGil(), py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bits"),
        py::arg("half_scales"), py::arg("with_offset"), py::arg("factored"),
        py::arg("bias") = py::none(), py::arg("dot") = false, py::arg("levels") = false,
        py::arg("allow_amx") = true, py::arg("rows_kernel") = "split");
  m.def("groupwise_gemm_grouped", &q4::groupwise_gemm_grouped,
        "y [P, N]: rows starts[i]..starts[i + 1] of x [P, K] times packed[i]'s layer (one "
        "format and shape for all; an MoE layer's experts), as groupwise_gemm on each group's "
        "rows computes them, in one call",
        NoGil(), py::arg("x"), py::arg("packed"), py::arg("starts"), py::arg("n"), py::arg("bits"),
        py::arg("half_scales"), py::arg("with_offset"), py::arg("factored"),
        py::arg("dot") = false, py::arg("levels") = false, py::arg("rows_kernel") = "split");
  m.def("quantize_groups", &q4::quantize_groups,
        "x [M, K] -> (int8 [M, K], float32 [M, K/32]): the dot path's rounding of x per group; "
        "split=True: [2M, K], [2M, K/32], each row then the rounding of what it left (the split "
        "kernel's rows)",
        NoGil(), py::arg("x"), py::arg("split") = false);
  m.def("groupwise_bf16_rows_kernels", &q4::bf16_rows_kernels,
        "the kernels of few bf16 rows on 4-bit layers this build runs (rows_kernel): 'split' (x "
        "as two int8 rows on the dot kernel, the default), 'dp' (vdpbf16ps on q), 'fma' (float32 "
        "FMAs on q); none without vdpbf16ps");
  m.def("groupwise_int16_rows", &q4::int16_rows,
        "rows of bf16 x up to which the default kernel of few rows (rows_kernel='split') rounds "
        "them to int16 per group of 32 against a power of two, integer products (AVX2 without "
        "AVX-512; 0: none in this build)");
  m.def("groupwise_int16_tiles_from", &q4::int16_tiles_from,
        "rows of bf16 x from which the default kernel (rows_kernel='split') runs them, rounded "
        "to int16 as groupwise_int16_rows' kernel rounds them, on register tiles over widened "
        "weights: with it every batch size takes the int16 path (AVX2 without AVX-512; every "
        "layer but IQ4 levels; 0: none in this build)");
  m.def(
      "groupwise_amx_rows",
      &q4::amx_rows_from,
      "rows of bf16 x from which the float path runs on AMX tiles (0: never here); "
      "four_bit_split=True: on a 4-bit layer (not IQ4 levels) under the split kernel, the "
      "default, which keeps more rows off them",
      py::arg("four_bit_split") = false);
  m.def(
      "groupwise_six_bits",
      [] {
#if defined(PAGEDLLM_Q4_SIX)
        return true;
#else
        return false;
#endif
      },
      "whether this build packs Q6_K's q at 6 bits (bits=6: never the dot path)");
  m.def("groupwise_weight_rows", &q4::groupwise_weight_rows,
        "rows of W (float32 [R, K]) from pack_groupwise's panels, as the definition "
        "dequantises them",
        NoGil(), py::arg("packed"), py::arg("n"), py::arg("k"), py::arg("bits"),
        py::arg("half_scales"), py::arg("with_offset"), py::arg("factored"), py::arg("rows"),
        py::arg("levels") = false);
  m.def("read_bytes", &q4::read_bytes,
        "reads every byte of a tensor once on all threads (a read-bandwidth probe); a checksum",
        NoGil(), py::arg("t"));
  m.def("decode_gguf_blocks", &q4::decode_gguf_blocks,
        "GGUF blocks uint8 [N, row bytes] -> Q4_0/Q4_1/Q4_K: (nibbles uint8 [N, K/2], scale, "
        "offset float32 [N, K/32]); Q6_K/Q3_K: (int8 q [N, K], d * sc [N, K/16], d [N, K/256]);"
        " Q5_0/IQ4_NL/IQ4_XS: (int8 q [N, K], scale [N, K/32])",
        NoGil(), py::arg("blocks"), py::arg("kind"));
  m.def(
      "groupwise_rows", &q4::register_tile_rows,
      "(rows up to which float32 x dequantises in registers, rows per dot-path tile)");
}

}  // namespace
}  // namespace pagedllm::gemm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "pagedllm CPU kernels: paged attention, cache ops, row-wise layer kernels, sampling, "
      "16/8/4-bit weight GEMMs and the decode stack (one ISA level per build)";
  pagedllm::bind_layer_ops(m);
  m.def("weight_gemm", &pagedllm::gemm::weight_gemm,
        "y = x @ W^T (* scale) (+ bias), W packed as [N/16, K, 16]",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("packed"), py::arg("n"),
        py::arg("scale") = py::none(), py::arg("bias") = py::none(),
        py::arg("allow_amx") = true);
  m.def("pack_panels", &pagedllm::gemm::pack_panels,
        "[N, K] -> [ceil(N/16), K, 16], the layout weight_gemm reads",
        py::call_guard<py::gil_scoped_release>(), py::arg("weight"));
  m.def("pack_w8a8", &pagedllm::gemm::pack_w8a8,
        "int8 [N, K] -> int8 [N/16, K/4, 64] panels, the W8A8 layout",
        py::call_guard<py::gil_scoped_release>(), py::arg("weight"));
  m.def("quantize_rows", &pagedllm::gemm::quantize_rows,
        "x [M, K] -> (int8 [M, K], float32 [M]): per-row symmetric, round(x / (max|x| / 127)), "
        "or each row scaled by the given absmax [M] / 127",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("absmax") = py::none());
  m.def("w8a8_gemm_s32", &pagedllm::gemm::w8a8_gemm_s32, "the exact int32 sums qx @ W^T",
        py::call_guard<py::gil_scoped_release>(), py::arg("qx"), py::arg("packed"), py::arg("n"),
        py::arg("allow_amx") = true);
  m.def("w8a8_gemm", &pagedllm::gemm::w8a8_gemm,
        "y = quantize_rows(x) @ W^T * sx * w_scale (+ bias), integer dot products",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("packed"), py::arg("n"),
        py::arg("w_scale"), py::arg("bias") = py::none(), py::arg("allow_amx") = true);
  m.def("split_rows", &pagedllm::gemm::split_rows,
        "x [M, K] -> (int8 [2M, K]: hi rows then lo rows, float32 [2M]): x = hi*s_hi + lo*s_lo",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"));
  m.def("int8_split_gemm", &pagedllm::gemm::int8_split_gemm,
        "y = (hi @ W^T * s_hi + lo @ W^T * s_lo) * w_scale (+ bias): x in two int8 planes; "
        "bf16 batches of dp_min_rows or more (-1: the build's default, 0: never) convert the "
        "weights to bf16 per K-block instead",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("packed"), py::arg("n"),
        py::arg("w_scale"), py::arg("bias") = py::none(), py::arg("allow_amx") = true,
        py::arg("dp_min_rows") = -1);
  m.def("int8_dp_min_rows", &pagedllm::gemm::int8_dp_min_rows,
        "from how many bf16 rows int8_split_gemm converts the weights (0: never, in this build)");
  m.def("int8_dot_isa", &pagedllm::gemm::int8_dot_isa,
        "the integer dot product this build uses (W8A8, split planes, group-wise dot path)");
  m.def("has_amx_int8", &pagedllm::gemm::amx::int8_available,
        "whether W8A8 sums run on AMX-INT8 tiles here (processor and OS; K in whole 64s)");
  m.def("built_isa", &pagedllm::gemm::built_isa, "the ISA level this library was compiled for");
  m.def(
      "has_bf16_dot",
      [] {
#if defined(PAGEDLLM_GEMM_DP)
        return true;
#else
        return false;
#endif
      },
      "whether bf16 activations use vdpbf16ps (bf16 and int8 weights)");
  m.def("has_amx", &pagedllm::gemm::amx::available,
        "whether bf16 activations of 13 rows or more use AMX tiles here (processor and OS)");
  m.def("rows_per_tile", [] { return pagedllm::gemm::kRows; }, "rows of the micro-kernel");
  pagedllm::gemm::bind_groupwise(m);
  pagedllm::decode::bind_decode_stack(m);
}
