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
//
// With the model's ends bound (set_ends), run_decode goes from the scheduler's lists (token
// ids, positions, block tables) to logits in the same call: the step's index tensors (the
// fields build_attention_metadata gives), the embedding look-up, the layers, the final RMSNorm
// and the LM head, each the function the Python path calls (groupwise_weight_rows or
// index_select, rms_norm, groupwise_gemm) with the same arguments, and, for plain greedy rows,
// sample_rows as the sampler's greedy path calls it. After the layers stream the weights
// through the caches, each Python call between kernels ran cold (~0.1 ms for the final norm's
// few attribute reads and checks on the 30-layer demo model): the ends, the step's index
// tensors and the greedy row were two thirds of a one-sequence step's host time.
#include "decode_stack.h"

#include <optional>

// Factories the ends and the greedy rows call beyond tensor_api.h's (decode_stack.h brings
// pybind11 and torch's casters, not the ATen operators).
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention.h"
#include "gemm_q4.h"
#include "pointwise.h"
#include "sampling.h"

namespace pagedllm::decode {
namespace {

// A decode step's index tensors, built from the scheduler's lists (sequence i computes token
// ids[i] at positions[i]): what build_attention_metadata and the runner give for that step.
struct DecodeIndex {
  at::Tensor ids, positions, slots;             // [n] int64
  at::Tensor block_tables;                      // [n, width] int32, padded with 0
  at::Tensor seq_lens, query_start_loc;         // [n], [n + 1] int32
};

DecodeIndex decode_index(const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
                         const std::vector<std::vector<int64_t>>& tables, int64_t block_size,
                         int64_t num_blocks) {
  const int64_t n = static_cast<int64_t>(ids.size());
  TORCH_CHECK(n > 0 && positions.size() == ids.size() && tables.size() == ids.size(),
              "DecodeStack: token_ids, positions and block_tables must be as long, not empty");
  TORCH_CHECK(block_size > 0, "DecodeStack: block_size must be positive");
  size_t width = 1;
  for (const auto& t : tables) width = std::max(width, t.size());
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  DecodeIndex d{at::empty({n}, i64), at::empty({n}, i64), at::empty({n}, i64),
                at::zeros({n, static_cast<int64_t>(width)}, i32), at::empty({n}, i32),
                at::empty({n + 1}, i32)};
  int64_t* id = d.ids.data_ptr<int64_t>();
  int64_t* pos = d.positions.data_ptr<int64_t>();
  int64_t* slot = d.slots.data_ptr<int64_t>();
  int32_t* table = d.block_tables.data_ptr<int32_t>();
  int32_t* len = d.seq_lens.data_ptr<int32_t>();
  int32_t* qsl = d.query_start_loc.data_ptr<int32_t>();
  qsl[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = positions[i];
    const auto& t = tables[i];
    TORCH_CHECK(p >= 0 && p < std::numeric_limits<int32_t>::max() &&
                    p / block_size < static_cast<int64_t>(t.size()),
                "DecodeStack: position ", p, " of sequence ", i, " is outside its ", t.size(),
                " blocks");
    for (size_t j = 0; j < t.size(); ++j) {
      TORCH_CHECK(t[j] >= 0 && t[j] < num_blocks, "DecodeStack: block ", t[j], " of sequence ",
                  i, " is outside the cache's ", num_blocks, " blocks");
      table[i * static_cast<int64_t>(width) + j] = static_cast<int32_t>(t[j]);
    }
    id[i] = ids[i];
    pos[i] = p;
    slot[i] = t[p / block_size] * block_size + p % block_size;
    len[i] = static_cast<int32_t>(p + 1);
    qsl[i + 1] = static_cast<int32_t>(i + 1);
  }
  return d;
}

// One packed layer as groupwise_gemm takes it (PackedGroupwise's fields; bias float32), or a
// fused layer whose parts keep their own formats (a Q4_K_M file's Q4_K q/k beside a Q6_K v):
// `parts` side by side, each its own groupwise_gemm as the Python path's make_parts_linear
// calls them, whose outputs it concatenates.
struct StackLinear {
  at::Tensor packed;
  int64_t n = 0;
  int64_t bits = 4;
  bool half_scales = false;
  bool with_offset = false;
  bool factored = false;
  bool levels = false;
  c10::optional<at::Tensor> bias;
  // Whether the step's dot flag reaches this layer: its own GEMM's choice (groupwise_linear's
  // takes_dot: a Q6_K layer beside 4-bit ones keeps the int16 kernels on AVX2).
  bool takes_dot = true;
  std::vector<StackLinear> parts;  // empty: the layer is `packed` itself

  void run(const at::Tensor& x, bool dot, at::Tensor& y) const {
    if (parts.empty()) {
      gemm::q4::groupwise_gemm_into(x, packed, n, bits, half_scales, with_offset, factored,
                                    bias, dot && takes_dot, levels, true, "split", y);
      return;
    }
    // A part's columns of y: contiguous for one row (a single sequence's step), written in
    // place; for more rows the part runs into its own rows and is copied in.
    int64_t start = 0;
    for (const StackLinear& part : parts) {
      at::Tensor cols = y.narrow(1, start, part.n);
      if (cols.is_contiguous()) {
        part.run(x, dot, cols);
      } else {
        at::Tensor out = at::empty({y.size(0), part.n}, y.options());
        part.run(x, dot, out);
        cols.copy_(out);
      }
      start += part.n;
    }
  }

  // The parts as one layer: N their sum.
  static StackLinear of_parts(std::vector<StackLinear> parts) {
    TORCH_CHECK(parts.size() >= 2, "StackLinear.of_parts: a fused layer has two parts or more");
    StackLinear fused;
    for (const StackLinear& part : parts) {
      TORCH_CHECK(part.parts.empty(), "StackLinear.of_parts: a part cannot have parts");
      fused.n += part.n;
    }
    fused.parts = std::move(parts);
    return fused;
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

  // The model's ends for run_logits. rows: the group-wise panels the embedding's rows are read
  // back from (in float32, rounded to the activations' dtype: the Python path's fast_rows), the
  // tied head's own or an untied table's; else (None) embed_table is the dense [vocab, hidden]
  // table in that dtype.
  void set_ends(const at::Tensor& embed_table, const std::optional<StackLinear>& rows,
                const at::Tensor& final_norm, double final_eps, const StackLinear& head,
                int64_t vocab) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack: add the layers before the ends");
    const int64_t width = layers_[0].o.n;
    TORCH_CHECK(vocab > 0 && vocab <= head.n && !head.bias.has_value() && head.parts.empty(),
                "DecodeStack: the LM head must be one bias-free layer of at least vocab rows");
    TORCH_CHECK(final_norm.dim() == 1 && final_norm.size(0) == width,
                "DecodeStack: the final norm must have ", width, " weights");
    TORCH_CHECK(!rows.has_value() || (rows->n >= vocab && rows->parts.empty() &&
                                      !rows->bias.has_value()),
                "DecodeStack: the embedding's panels must be one bias-free layer of at least "
                "vocab rows");
    TORCH_CHECK(rows.has_value() || (embed_table.dim() == 2 && embed_table.size(1) == width &&
                                     embed_table.size(0) >= vocab && embed_table.is_contiguous() &&
                                     embed_table.scalar_type() == final_norm.scalar_type()),
                "DecodeStack: the embedding table must be a contiguous [vocab, ", width,
                "] tensor of the activations' dtype");
    ends_ = Ends{embed_table, rows, final_norm, final_eps, head, vocab};
  }

  // A decode step from the scheduler's lists: (logits [n, vocab], and where greedy, each row's
  // first maximum and its log-probability under the logits, as sample_rows computes them for
  // greedy rows; empty lists otherwise). dot / head_dot: the layers' and the head's own choice
  // of the dot path for n rows.
  std::tuple<at::Tensor, std::vector<int64_t>, std::vector<double>> run_decode(
      const std::vector<int64_t>& token_ids, const std::vector<int64_t>& positions,
      const std::vector<std::vector<int64_t>>& block_tables, int64_t block_size,
      const std::vector<at::Tensor>& kv_caches, bool dot, bool head_dot, bool greedy) const {
    // The runner calls this outside torch's inference mode (entering it from Python cost a
    // step ~20 us of cold Python): the guard is taken here, for the cache writes and the
    // tensors the step makes.
    c10::InferenceMode guard;
    TORCH_CHECK(!kv_caches.empty() && kv_caches[0].dim() == 5 &&
                    kv_caches[0].size(3) == block_size,
                "DecodeStack: caches must be [2, blocks, kv_heads, ", block_size, ", head] tensors");
    const DecodeIndex d =
        decode_index(token_ids, positions, block_tables, block_size, kv_caches[0].size(1));
    at::Tensor logits = run_logits(d.ids, d.positions, kv_caches, d.block_tables, d.seq_lens,
                                   d.query_start_loc, d.slots, dot, head_dot);
    std::vector<int64_t> tokens;
    std::vector<double> logprobs;
    if (greedy) {
      const int64_t n = logits.size(0);
      const auto f32 = at::TensorOptions().dtype(at::kFloat);
      const at::Tensor zeros = at::zeros({n}, f32);
      auto [tok, lp] = sample_rows(logits, std::nullopt, zeros, at::full({n}, logits.size(1),
                                   at::TensorOptions().dtype(at::kLong)),
                                   at::ones({n}, f32), zeros, zeros);
      const int64_t* t = tok.data_ptr<int64_t>();
      const float* l = lp.data_ptr<float>();
      tokens.assign(t, t + n);
      logprobs.assign(l, l + n);
    }
    return {logits, std::move(tokens), std::move(logprobs)};
  }

 private:
  // Logits [tokens, vocab] of a decode step from its token ids: embedding, every layer, the
  // final norm and the LM head (head_dot: the head's own choice of the dot path for this batch).
  at::Tensor run_logits(const at::Tensor& input_ids, const at::Tensor& positions,
                        const std::vector<at::Tensor>& kv_caches, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                        const at::Tensor& slot_mapping, bool dot, bool head_dot) const {
    TORCH_CHECK(ends_.has_value(), "DecodeStack: run_logits needs set_ends");
    TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong,
                "DecodeStack: input_ids must be a 1-D int64 tensor");
    const Ends& e = *ends_;
    const int64_t width = layers_[0].o.n;
    at::Tensor hidden;
    if (e.rows.has_value()) {
      const StackLinear& r = *e.rows;
      hidden = gemm::q4::groupwise_weight_rows(r.packed, r.n, width, r.bits, r.half_scales,
                                               r.with_offset, r.factored, input_ids, r.levels)
                   .to(e.final_norm.scalar_type());
    } else {
      hidden = e.table.index_select(0, input_ids);
    }
    at::Tensor scratch_h = at::empty_like(hidden), normed = at::empty_like(hidden);
    auto [x, residual] = layers(hidden, positions, kv_caches, block_tables, seq_lens,
                                query_start_loc, slot_mapping, dot);
    rms_norm_into(x, e.final_norm, e.final_eps, offset_, residual, normed, scratch_h);
    at::Tensor logits = at::empty({hidden.size(0), e.head.n}, hidden.options());
    e.head.run(normed, head_dot, logits);
    return e.head.n == e.vocab ? logits : logits.narrow(1, 0, e.vocab);
  }

 public:
  // (hidden, residual) after the last layer: what the model's final norm takes.
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& hidden, const at::Tensor& positions,
                                         const std::vector<at::Tensor>& kv_caches,
                                         const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens,
                                         const at::Tensor& query_start_loc,
                                         const at::Tensor& slot_mapping, bool dot) const {
    return layers(hidden, positions, kv_caches, block_tables, seq_lens, query_start_loc,
                  slot_mapping, dot);
  }

 private:
  struct Ends {
    at::Tensor table;
    std::optional<StackLinear> rows;
    at::Tensor final_norm;
    double final_eps = 1e-6;
    StackLinear head;
    int64_t vocab = 0;
  };

  std::tuple<at::Tensor, at::Tensor> layers(const at::Tensor& hidden, const at::Tensor& positions,
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

  int64_t heads_, kv_heads_, head_size_;
  double offset_;
  std::vector<StackLayer> layers_;
  c10::optional<Ends> ends_;
};

}  // namespace

void bind_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<StackLinear>(m, "StackLinear",
                          "one group-wise packed layer as groupwise_gemm takes it")
      .def(py::init([](at::Tensor packed, int64_t n, int64_t bits, bool half_scales,
                       bool with_offset, bool factored, bool levels,
                       c10::optional<at::Tensor> bias, bool takes_dot) {
             return StackLinear{std::move(packed), n,        bits,
                                half_scales,       with_offset, factored,
                                levels,            std::move(bias), takes_dot};
           }),
           py::arg("packed"), py::arg("n"), py::arg("bits"), py::arg("half_scales"),
           py::arg("with_offset"), py::arg("factored"), py::arg("levels"),
           py::arg("bias") = py::none(), py::arg("takes_dot") = true)
      .def_static("of_parts", &StackLinear::of_parts,
                  "a fused layer of parts in their own formats, their outputs side by side",
                  py::arg("parts"));
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
      .def("set_ends", &DecodeStack::set_ends, py::arg("embed_table"), py::arg("rows"),
           py::arg("final_norm"), py::arg("final_eps"), py::arg("head"), py::arg("vocab"))
      .def("run_decode", &DecodeStack::run_decode,
           "(logits, greedy tokens, their logprobs) of a decode step from the scheduler's lists",
           py::call_guard<py::gil_scoped_release>(), py::arg("token_ids"), py::arg("positions"),
           py::arg("block_tables"), py::arg("block_size"), py::arg("kv_caches"),
           py::arg("dot") = false, py::arg("head_dot") = false, py::arg("greedy") = false)
      .def("run", &DecodeStack::run,
           "(hidden, residual) after every layer; one token per sequence or any flat batch",
           py::call_guard<py::gil_scoped_release>(), py::arg("hidden"), py::arg("positions"),
           py::arg("kv_caches"), py::arg("block_tables"), py::arg("seq_lens"),
           py::arg("query_start_loc"), py::arg("slot_mapping"), py::arg("dot") = false);
}

}  // namespace pagedllm::decode
