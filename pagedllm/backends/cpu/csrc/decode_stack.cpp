// The decode stack: the layers of a Llama-shaped decoder (RMSNorm, fused q/k/v with an optional
// bias, neox rotary, paged GQA attention, o_proj, fused gate/up, SiLU-and-mul, down_proj), all
// group-wise packed, run in one call per decode step with the GIL released.
//
// Why: at one sequence a small model's step spent ~2.2 of 7.8 ms in the Python around its
// kernels (30 layers x a dozen calls, each a few microseconds of interpreter, argument parsing
// and checks). Here each layer calls the very functions the Python layers reach through their
// bindings (pointwise.cpp, cache_ops.cpp, attention.cpp, gemm_q4.cpp) with the arguments the
// backend bound at prepare time, in the same order and rounding, so a step's outputs equal the
// Python path's bit for bit. Every kernel's output goes into scratch allocated once per step
// and reused by every layer (GEMM rows, norms, residual, attention, activation): a layer
// allocates nothing, where it allocated five tensors and built four views before.
#include "decode_stack.h"

#include <c10/util/Exception.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention.h"
#include "gemm_q4.h"
#include "pointwise.h"

namespace pagedllm::decode {
namespace {

// One packed layer as groupwise_gemm takes it (PackedGroupwise's fields; bias float32).
struct StackLinear {
  at::Tensor packed;
  int64_t n = 0;
  int64_t bits = 4;
  bool half_scales = false;
  bool with_offset = false;
  bool factored = false;
  bool levels = false;
  c10::optional<at::Tensor> bias;

  void run(const at::Tensor& x, bool dot, at::Tensor& y) const {
    gemm::q4::groupwise_gemm_into(x, packed, n, bits, half_scales, with_offset, factored, bias,
                                  dot, levels, true, "split", y);
  }
};

struct StackLayer {
  at::Tensor input_norm, post_norm;  // [hidden] in the activations' dtype
  double input_eps = 1e-6, post_eps = 1e-6;
  StackLinear qkv, o, gate_up, down;
  at::Tensor cos, sin;  // [max_position, rotary_dim] float32
  int64_t rotary_dim = 0;
  double scale = 1.0;
  int64_t sliding_window = 0;
  double k_scale = 1.0, v_scale = 1.0;  // used with fp8 caches only
};

bool is_fp8(const at::Tensor& cache) {
  const auto t = cache.scalar_type();
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_size, double norm_offset)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_size_(head_size), offset_(norm_offset) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
                    head_size > 0,
                "DecodeStack: num_heads must be a positive multiple of num_kv_heads");
  }

  void add_layer(const StackLayer& layer) {
    const int64_t qkv_n = (heads_ + 2 * kv_heads_) * head_size_;
    TORCH_CHECK(layer.qkv.n == qkv_n, "DecodeStack: q/k/v projection has N=", layer.qkv.n,
                ", expected ", qkv_n);
    TORCH_CHECK(layer.gate_up.n % 2 == 0 && layer.down.n == layer.o.n,
                "DecodeStack: gate/up must be [gate | up] and down_proj as wide as o_proj");
    TORCH_CHECK(layers_.empty() || (layer.o.n == layers_[0].o.n &&
                                    layer.gate_up.n == layers_[0].gate_up.n),
                "DecodeStack: every layer must have the first layer's widths");
    layers_.push_back(layer);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // (hidden, residual) after the last layer: what the model's final norm takes.
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& hidden, const at::Tensor& positions,
                                         const std::vector<at::Tensor>& kv_caches,
                                         const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens,
                                         const at::Tensor& query_start_loc,
                                         const at::Tensor& slot_mapping, bool dot) const {
    TORCH_CHECK(!layers_.empty(), "DecodeStack: no layers");
    TORCH_CHECK(kv_caches.size() == layers_.size(), "DecodeStack: ", layers_.size(),
                " layers but ", kv_caches.size(), " caches");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() &&
                    hidden.size(1) == layers_[0].o.n,
                "DecodeStack: hidden must be a contiguous [tokens, ", layers_[0].o.n, "] tensor");
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
                "DecodeStack: positions must be contiguous int64");
    const int64_t t = hidden.size(0);
    const int64_t width = layers_[0].o.n;
    const auto opts = hidden.options();
    // Scratch allocated once per step and shared by every layer: each is read before the next
    // layer writes it (q/k/v by the cache write and attention, gate/up by the activation, the
    // normed rows by the GEMM after the norm). The residual stream alternates two rows: each
    // norm reads one and writes the other (its kernel takes no aliasing), and the layer's
    // output alternates likewise (it is the next layer's input, x). The views are built once.
    at::Tensor qkv = at::empty({t, layers_[0].qkv.n}, opts);
    at::Tensor gate_up = at::empty({t, layers_[0].gate_up.n}, opts);
    at::Tensor act = at::empty({t, layers_[0].gate_up.n / 2}, opts);
    at::Tensor attn = at::empty({t, heads_, head_size_}, opts);
    const at::Tensor attn_rows = attn.view({t, heads_ * head_size_});
    at::Tensor normed = at::empty({t, width}, opts);
    at::Tensor attn_out = at::empty({t, width}, opts);
    at::Tensor res_in = at::empty({t, width}, opts), res_mid = at::empty({t, width}, opts);
    at::Tensor mlp_out[2] = {at::empty({t, width}, opts), at::empty({t, width}, opts)};
    const auto parts = qkv.view({t, heads_ + 2 * kv_heads_, head_size_})
                           .split_with_sizes({heads_, kv_heads_, kv_heads_}, 1);
    at::Tensor x = hidden;
    bool first = true;  // layer 0's input norm has no residual: its h is x itself
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      const at::Tensor& cache = kv_caches[i];
      const at::Tensor& h = first ? x : res_in;
      rms_norm_into(x, l.input_norm, l.input_eps, offset_,
                    first ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(res_mid),
                    normed, h);
      first = false;
      l.qkv.run(normed, dot, qkv);
      rotary_embedding(positions, parts[0], parts[1], l.cos, l.sin, l.rotary_dim);
      const bool fp8 = is_fp8(cache);
      const double ks = fp8 ? l.k_scale : 1.0, vs = fp8 ? l.v_scale : 1.0;
      reshape_and_cache(parts[1], parts[2], cache, slot_mapping, ks, vs);
      paged_attention_into(parts[0], cache, block_tables, seq_lens, query_start_loc, l.scale,
                           l.sliding_window, ks, vs, 0.0, attn);
      l.o.run(attn_rows, dot, attn_out);
      rms_norm_into(attn_out, l.post_norm, l.post_eps, offset_, h, normed, res_mid);
      l.gate_up.run(normed, dot, gate_up);
      silu_and_mul_into(gate_up, act);
      at::Tensor& out = mlp_out[i % 2];
      l.down.run(act, dot, out);
      x = out;
    }
    // Fresh tensors per step, so handing out the residual row is safe.
    return {x, res_mid};
  }

 private:
  int64_t heads_, kv_heads_, head_size_;
  double offset_;
  std::vector<StackLayer> layers_;
};

}  // namespace

void bind_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<StackLinear>(m, "StackLinear",
                          "one group-wise packed layer as groupwise_gemm takes it")
      .def(py::init([](at::Tensor packed, int64_t n, int64_t bits, bool half_scales,
                       bool with_offset, bool factored, bool levels,
                       c10::optional<at::Tensor> bias) {
             return StackLinear{std::move(packed), n,      bits, half_scales,
                                with_offset,       factored, levels, std::move(bias)};
           }),
           py::arg("packed"), py::arg("n"), py::arg("bits"), py::arg("half_scales"),
           py::arg("with_offset"), py::arg("factored"), py::arg("levels"),
           py::arg("bias") = py::none());
  py::class_<StackLayer>(m, "StackLayer", "one decoder layer's tensors and parameters")
      .def(py::init([](at::Tensor input_norm, double input_eps, at::Tensor post_norm,
                       double post_eps, const StackLinear& qkv, const StackLinear& o,
                       const StackLinear& gate_up, const StackLinear& down, at::Tensor cos,
                       at::Tensor sin, int64_t rotary_dim, double scale, int64_t sliding_window,
                       double k_scale, double v_scale) {
             StackLayer l;
             l.input_norm = std::move(input_norm);
             l.input_eps = input_eps;
             l.post_norm = std::move(post_norm);
             l.post_eps = post_eps;
             l.qkv = qkv;
             l.o = o;
             l.gate_up = gate_up;
             l.down = down;
             l.cos = std::move(cos);
             l.sin = std::move(sin);
             l.rotary_dim = rotary_dim;
             l.scale = scale;
             l.sliding_window = sliding_window;
             l.k_scale = k_scale;
             l.v_scale = v_scale;
             return l;
           }),
           py::arg("input_norm"), py::arg("input_eps"), py::arg("post_norm"),
           py::arg("post_eps"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("cos"), py::arg("sin"), py::arg("rotary_dim"),
           py::arg("scale"), py::arg("sliding_window"), py::arg("k_scale"), py::arg("v_scale"));
  py::class_<DecodeStack>(m, "DecodeStack",
                          "a Llama-shaped decoder's layers, run in one call per decode step")
      .def(py::init<int64_t, int64_t, int64_t, double>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_size"), py::arg("norm_offset") = 0.0)
      .def("add_layer", &DecodeStack::add_layer, py::arg("layer"))
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("run", &DecodeStack::run,
           "(hidden, residual) after every layer; one token per sequence or any flat batch",
           py::call_guard<py::gil_scoped_release>(), py::arg("hidden"), py::arg("positions"),
           py::arg("kv_caches"), py::arg("block_tables"), py::arg("seq_lens"),
           py::arg("query_start_loc"), py::arg("slot_mapping"), py::arg("dot") = false);
}

}  // namespace pagedllm::decode
