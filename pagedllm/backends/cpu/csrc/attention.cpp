// Paged attention on the CPU for a flat batch of prompt chunks and decodes.
//
// Cache layout of one layer: [2, num_blocks, num_kv_heads, block_size, head_size], so the keys of
// one (block, kv head) pair are a contiguous [block_size, head_size] panel: every row is a
// contiguous vector load and a whole block streams from memory in one run.
//
// One work item is (sequence, query tile, kv head). Its rows are the tile's query tokens times the
// query heads that share the kv head (GQA/MQA), so each key/value panel is read from memory once
// per item and reused from L1 by every row. Softmax is online (running max, running sum, rescaled
// accumulator per row), so no per-sequence score buffer exists however long the context. Decodes
// are items with a one-token tile, so mixed prefill + decode batches need no special case.
//
// Templated over the query/output type QT (float, bfloat16, float16: the model's compute dtype)
// and the cache type CT (those plus fp8 e4m3/e5m2). Scores, softmax and the accumulator are
// float32 whatever the types; a non-float cache's K and V panels are widened once per block into
// the thread's workspace (convert.h) and then read by the float micro-kernels of vec.h. The fp8
// scales are folded in: k_scale into the pre-scaled query, v_scale into the final normalisation.
//
// NaN safety: a row only ever reads keys [0, seq_len) of its own sequence, all written before
// the call, and keys it may not see get probability 0 by assignment (never by multiplying a
// score), so whatever bytes a never-written slot holds cannot reach an output.
#include "attention.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "convert.h"
#include "vec.h"

namespace pagedllm {
namespace {

// Rows (query tokens x heads of a group) per work item: enough to reuse each K/V panel many
// times from L1 during prefill, small enough for the accumulators to stay in L1/L2.
constexpr int kTargetRows = 32;

template <typename QT, typename CT>
struct Args {
  const QT* q;
  int64_t q_tok_stride, q_head_stride;
  QT* out;
  int64_t o_tok_stride, o_head_stride;
  const CT* k_cache;  // cache[0]
  const CT* v_cache;  // cache[1]
  int64_t block_stride, head_stride;  // in elements: kvh*bs*d and bs*d
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int num_heads, num_kv_heads, head_size, block_size;
  float scale;     // softmax scale times k_scale
  float v_scale;   // dequantisation scale of the values (1 unless fp8)
  int sliding_window;  // 0: unlimited
};

struct Tile {
  int32_t seq;
  int32_t q_begin;  // first query token of the tile, relative to the sequence's first query
  int32_t q_len;
  int32_t kv_head;
  int64_t cost;  // ~ rows x keys, for longest-first scheduling
};

// Per-thread scratch, reused across the tiles a thread runs. Row r = i * group + g is query token
// i of the tile with query head (kv_head * group + g).
struct Workspace {
  std::vector<float> q;      // [rows, d] queries pre-multiplied by the softmax scale
  std::vector<float> m, l;   // [rows] running max and running sum of exp
  std::vector<float> alpha;  // [rows] rescale of the accumulator for the current block
  std::vector<float> acc;    // [rows, d] un-normalised output
  std::vector<float> s;      // [rows, bs] scores, then probabilities, of the current block
  std::vector<int32_t> lo, hi;  // [q_len] visible keys [lo, hi) of each query token
  std::vector<float> kbuf, vbuf;  // [bs, d] the block's K and V panels widened to float
  void resize(int rows, int q_len, int d, int bs, bool widen) {
    q.resize(static_cast<size_t>(rows) * d);
    m.assign(rows, kNegInf);
    l.assign(rows, 0.f);
    alpha.resize(rows);
    acc.assign(static_cast<size_t>(rows) * d, 0.f);
    s.resize(static_cast<size_t>(rows) * bs);
    lo.resize(q_len);
    hi.resize(q_len);
    if (widen) {
      kbuf.resize(static_cast<size_t>(bs) * d);
      vbuf.resize(static_cast<size_t>(bs) * d);
    }
  }
};

// S[r, t] = q_r . k_t for the n keys of a block, two rows by four keys at a time.
void block_scores(Workspace& ws, int rows, const float* k, int n, int d, int bs,
                  PanelPrefetcher& prefetch) {
  const float* q = ws.q.data();
  float* s = ws.s.data();
  int r = 0;
  for (; r + 2 <= rows; r += 2) {
    const float *q0 = q + r * d, *q1 = q0 + d;
    float *s0 = s + r * bs, *s1 = s0 + bs;
    int t = 0;
    for (; t + 4 <= n; t += 4) {
      prefetch.step();
      dot_2x4(q0, q1, k + t * d, d, d, s0 + t, s1 + t);
    }
    for (; t < n; ++t) {
      s0[t] = dot(q0, k + t * d, d);
      s1[t] = dot(q1, k + t * d, d);
    }
  }
  if (r < rows) {
    const float* q0 = q + r * d;
    float* s0 = s + r * bs;
    int t = 0;
    for (; t + 4 <= n; t += 4) {
      prefetch.step();
      dot_1x4(q0, k + t * d, d, d, s0 + t);
    }
    for (; t < n; ++t) s0[t] = dot(q0, k + t * d, d);
  }
}

// Online softmax for row r over its visible keys [tb, te) of the block's n scored keys: updates
// the running max and sum, leaves exp(s - max) in place and zeros the keys it may not see.
void softmax_update(Workspace& ws, int r, int tb, int te, int n, int bs) {
  float* sr = ws.s.data() + static_cast<size_t>(r) * bs;
  if (tb >= te) {
    std::fill(sr, sr + n, 0.f);
    ws.alpha[r] = 1.f;
    return;
  }
  const float m_new = std::max(ws.m[r], max_of(sr + tb, te - tb));
  const float alpha = std::exp(ws.m[r] - m_new);  // 0 on the row's first visible block
  ws.l[r] = ws.l[r] * alpha + exp_shift_sum(sr + tb, te - tb, m_new);
  ws.m[r] = m_new;
  ws.alpha[r] = alpha;
  std::fill(sr, sr + tb, 0.f);
  std::fill(sr + te, sr + n, 0.f);
}

// acc_r = acc_r * alpha_r + P[r, :n] V[:n] for every row, two rows per pass over the values.
void accumulate_values(Workspace& ws, int rows, const float* v, int n, int d, int bs) {
  float* acc = ws.acc.data();
  const float* p = ws.s.data();
  int r = 0;
  for (; r + 2 <= rows; r += 2) {
    scale_accumulate2(acc + r * d, acc + (r + 1) * d, ws.alpha[r], ws.alpha[r + 1], p + r * bs,
                      p + (r + 1) * bs, v, n, d, d);
  }
  if (r < rows) scale_accumulate(acc + r * d, ws.alpha[r], p + r * bs, v, n, d, d);
}

// Copies the tile's query rows (pre-scaled) into the workspace, sets each query token's visible
// key range [lo, hi) (causal, optionally windowed) and returns the union of those ranges.
template <typename QT, typename CT>
std::pair<int, int> load_rows(const Args<QT, CT>& a, const Tile& tile, Workspace& ws) {
  const int group = a.num_heads / a.num_kv_heads;
  const int d = a.head_size;
  const int q0 = a.query_start_loc[tile.seq];
  const int seq_len = a.seq_lens[tile.seq];
  const int ctx = seq_len - (a.query_start_loc[tile.seq + 1] - q0);
  int kv_begin = seq_len, kv_end = 0;
  for (int i = 0; i < tile.q_len; ++i) {
    const int pos = ctx + tile.q_begin + i;
    ws.hi[i] = pos + 1;
    ws.lo[i] = a.sliding_window > 0 ? std::max(0, pos + 1 - a.sliding_window) : 0;
    kv_begin = std::min(kv_begin, ws.lo[i]);
    kv_end = std::max(kv_end, ws.hi[i]);
    const QT* q_tok = a.q + (q0 + tile.q_begin + i) * a.q_tok_stride;
    for (int g = 0; g < group; ++g) {
      const QT* src = q_tok + (tile.kv_head * group + g) * a.q_head_stride;
      float* dst = ws.q.data() + static_cast<size_t>(i * group + g) * d;
      for (int c = 0; c < d; ++c) dst[c] = static_cast<float>(src[c]) * a.scale;
    }
  }
  return {kv_begin, kv_end};
}

// out[token, head] = acc / l for every row of the tile.
template <typename QT, typename CT>
void store_rows(const Args<QT, CT>& a, const Tile& tile, const Workspace& ws) {
  const int group = a.num_heads / a.num_kv_heads;
  const int d = a.head_size;
  const int q0 = a.query_start_loc[tile.seq];
  for (int i = 0; i < tile.q_len; ++i) {
    QT* o_tok = a.out + (q0 + tile.q_begin + i) * a.o_tok_stride;
    for (int g = 0; g < group; ++g) {
      const int r = i * group + g;
      QT* orow = o_tok + (tile.kv_head * group + g) * a.o_head_stride;
      const float inv = ws.l[r] > 0.f ? a.v_scale / ws.l[r] : 0.f;
      store_floats(ws.acc.data() + static_cast<size_t>(r) * d, inv, orow, d);
    }
  }
}

// The n rows of a panel starting at src as floats: the cache itself when it holds float32, else
// widened into buf.
template <typename CT>
const float* panel_floats(const CT* src, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<CT, float>) {
    return src;
  } else {
    load_floats(src, buf.data(), n);
    return buf.data();
  }
}

template <typename QT, typename CT>
void attend_tile(const Args<QT, CT>& a, const Tile& tile, Workspace& ws) {
  const int group = a.num_heads / a.num_kv_heads;
  const int d = a.head_size, bs = a.block_size;
  const int rows = tile.q_len * group;
  ws.resize(rows, tile.q_len, d, bs, !std::is_same_v<CT, float>);
  const auto [kv_begin, kv_end] = load_rows(a, tile, ws);

  const int32_t* table = a.block_tables + tile.seq * a.bt_stride;
  const int64_t kv_head_off = tile.kv_head * a.head_stride;
  const int last_block = (kv_end - 1) / bs;
  const int64_t micro_tiles = static_cast<int64_t>((rows + 1) / 2) * ((bs + 3) / 4);
  PanelPrefetcher prefetch;
  for (int j = kv_begin / bs; j <= last_block; ++j) {
    const int64_t base = static_cast<int64_t>(table[j]) * a.block_stride + kv_head_off;
    if (j < last_block) {
      const int64_t next = table[j + 1] * a.block_stride + kv_head_off;
      prefetch.reset(a.k_cache + next, a.v_cache + next,
                     a.head_stride * static_cast<int64_t>(sizeof(CT)), micro_tiles);
    } else {
      prefetch.reset(nullptr, nullptr, 0, 0);
    }
    // Keys of this block that some row of the tile sees: [t0 + ub, t0 + ue).
    const int t0 = j * bs;
    const int ub = std::max(kv_begin, t0) - t0;
    const int n = std::min(kv_end, t0 + bs) - t0 - ub;
    const float* k = panel_floats(a.k_cache + base + ub * d, static_cast<int64_t>(n) * d, ws.kbuf);
    block_scores(ws, rows, k, n, d, bs, prefetch);
    for (int i = 0; i < tile.q_len; ++i) {
      const int tb = std::max(ws.lo[i] - t0 - ub, 0);
      const int te = std::min(ws.hi[i] - t0 - ub, n);
      for (int g = 0; g < group; ++g) softmax_update(ws, i * group + g, tb, te, n, bs);
    }
    const float* v = panel_floats(a.v_cache + base + ub * d, static_cast<int64_t>(n) * d, ws.vbuf);
    accumulate_values(ws, rows, v, n, d, bs);
  }
  store_rows(a, tile, ws);
}

// Every block id a sequence will read must exist: a bad table would read out of bounds.
template <typename A>
void check_tables(const A& a, int num_seqs, int64_t num_blocks, int64_t table_width) {
  TORCH_CHECK(a.query_start_loc[0] == 0, "paged_attention: query_start_loc must start at 0");
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = a.query_start_loc[s + 1] - a.query_start_loc[s];
    const int seq_len = a.seq_lens[s];
    TORCH_CHECK(q_len >= 0 && seq_len >= q_len, "paged_attention: sequence ", s,
                " has query length ", q_len, " > seq_len ", seq_len);
    const int64_t needed = (static_cast<int64_t>(seq_len) + a.block_size - 1) / a.block_size;
    TORCH_CHECK(needed <= table_width, "paged_attention: sequence ", s, " needs ", needed,
                " blocks but block_tables has ", table_width, " columns");
    const int32_t* table = a.block_tables + s * a.bt_stride;
    for (int64_t j = 0; j < needed; ++j) {
      TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, "paged_attention: block id ",
                  table[j], " of sequence ", s, " is outside [0, ", num_blocks, ")");
    }
  }
}

template <typename A>
std::vector<Tile> make_tiles(const A& a, int num_seqs) {
  const int group = a.num_heads / a.num_kv_heads;
  const int tile_len = std::max(1, kTargetRows / group);
  std::vector<Tile> tiles;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = a.query_start_loc[s + 1] - a.query_start_loc[s];
    const int ctx = a.seq_lens[s] - q_len;
    for (int b = 0; b < q_len; b += tile_len) {
      const int len = std::min(tile_len, q_len - b);
      int64_t keys = ctx + b + len;
      if (a.sliding_window > 0) keys = std::min<int64_t>(keys, a.sliding_window + len);
      for (int h = 0; h < a.num_kv_heads; ++h) {
        tiles.push_back({s, b, len, h, keys * len});
      }
    }
  }
  // Longest first, so dynamic scheduling does not leave one long prompt tile for the end.
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& x, const Tile& y) { return x.cost > y.cost; });
  return tiles;
}

template <typename QT, typename CT>
void run_attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& out,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const at::Tensor& query_start_loc, float scale, float v_scale,
                   int sliding_window) {
  Args<QT, CT> a;
  a.q = static_cast<const QT*>(query.data_ptr());
  a.q_tok_stride = query.stride(0);
  a.q_head_stride = query.stride(1);
  a.out = static_cast<QT*>(out.data_ptr());
  a.o_tok_stride = out.stride(0);
  a.o_head_stride = out.stride(1);
  a.k_cache = static_cast<const CT*>(kv_cache.data_ptr());
  a.v_cache = a.k_cache + kv_cache.stride(0);
  a.block_stride = kv_cache.stride(1);
  a.head_stride = kv_cache.stride(2);
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.bt_stride = block_tables.stride(0);
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.query_start_loc = query_start_loc.data_ptr<int32_t>();
  a.num_heads = static_cast<int>(query.size(1));
  a.num_kv_heads = static_cast<int>(kv_cache.size(2));
  a.block_size = static_cast<int>(kv_cache.size(3));
  a.head_size = static_cast<int>(kv_cache.size(4));
  a.scale = scale;
  a.v_scale = v_scale;
  a.sliding_window = sliding_window;
  const int num_seqs = static_cast<int>(seq_lens.size(0));
  check_tables(a, num_seqs, kv_cache.size(1), block_tables.size(1));

  const std::vector<Tile> tiles = make_tiles(a, num_seqs);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  const int threads = std::max(1, std::min<int>(at::get_num_threads(), num_tiles));
#pragma omp parallel num_threads(threads)
  {
    Workspace ws;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tiles; ++i) attend_tile(a, tiles[i], ws);
  }
}

}  // namespace

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale,
                           int64_t sliding_window, double k_scale, double v_scale) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(),
              "paged_attention: CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1,
              "paged_attention: query must be [tokens, heads, head_size] with unit inner stride");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "paged_attention: kv_cache must be a contiguous [2, blocks, kv_heads, block_size, "
              "head_size] tensor");
  TORCH_CHECK(kv_cache.size(4) == query.size(2), "paged_attention: head_size mismatch");
  TORCH_CHECK(query.size(1) % kv_cache.size(2) == 0,
              "paged_attention: num_heads must be a multiple of num_kv_heads");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "paged_attention: metadata tensors must be contiguous int32 CPU tensors");
  }
  const int num_seqs = static_cast<int>(seq_lens.size(0));
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.dim() == 2 &&
                  block_tables.size(0) >= num_seqs,
              "paged_attention: metadata shapes disagree");
  TORCH_CHECK(query_start_loc.data_ptr<int32_t>()[num_seqs] == query.size(0),
              "paged_attention: query has ", query.size(0), " tokens, metadata says ",
              query_start_loc.data_ptr<int32_t>()[num_seqs]);

  TORCH_CHECK(k_scale > 0 && v_scale > 0, "paged_attention: k_scale and v_scale must be > 0");
  at::Tensor out = at::empty(query.sizes(), query.options());
  const float qk_scale = static_cast<float>(scale * k_scale);
  const int window = sliding_window > 0 ? static_cast<int>(sliding_window) : 0;
  dispatch_compute(query.scalar_type(), "paged_attention", [&](auto q_tag) {
    using QT = decltype(q_tag);
    dispatch_cache(kv_cache.scalar_type(), "paged_attention", [&](auto c_tag) {
      using CT = decltype(c_tag);
      run_attention<QT, CT>(query, kv_cache, out, block_tables, seq_lens, query_start_loc,
                            qk_scale, static_cast<float>(v_scale), window);
    });
  });
  return out;
}

}  // namespace pagedllm
