// Paged attention on the CPU for a flat batch of prompt chunks and decodes.
//
// Cache layout of one layer: [2, num_blocks, num_kv_heads, block_size, head_size], so the keys of
// one (block, kv head) pair are a contiguous [block_size, head_size] panel: every row is a
// contiguous vector load and a whole block streams from memory in one run.
//
// One work item is (sequence, query tile, kv head). Its rows are the tile's query tokens times the
// query heads that share the kv head (GQA/MQA), so each key/value panel is read from memory once
// per item and reused from L1 by every row. Softmax is online over spans of a few blocks (running
// max, running sum, rescaled accumulator per row; the scores of one span at a time), so no
// per-sequence score buffer exists however long the context. Decodes are items with a one-token
// tile, so mixed prefill + decode batches need no special case.
//
// Templated over the query/output type QT (float, bfloat16, float16: the model's compute dtype)
// and the cache type CT (those plus fp8 e4m3/e5m2). Scores, softmax and the accumulator are
// float32 whatever the types; a non-float cache's K and V panels are widened once per block into
// the thread's workspace (convert.h) and then read by the float micro-kernels of vec.h, except
// the scores of bf16 queries over a bf16 cache in avx512bf16 builds, which vdpbf16ps computes
// from the panel as stored. The fp8 scales are folded in: k_scale into the pre-scaled query,
// v_scale into the final normalisation.
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

// Keys per online-softmax update (whole blocks; one block if a block is longer). The update has a
// fixed cost per row (a max, an exp for the rescale, the sums), which per 16-key block was a
// quarter of a bf16-cache decode; over a span it is paid once for several blocks, whose scores
// then sit in the workspace ([rows, span]: 16 KB at 32 rows).
constexpr int kSpanKeys = 128;

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
  float soft_cap;      // 0: none; else every score s becomes soft_cap * tanh(s / soft_cap)
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
  std::vector<float> s;      // [rows, span] scores, then probabilities, of the current span
  std::vector<int32_t> lo, hi;  // [q_len] visible keys [lo, hi) of each query token
  std::vector<float> kbuf, vbuf;  // [bs, d] the block's K and V panels widened to float
  std::vector<bf16_t> qh;         // [rows, d] unscaled bf16 queries (the vdpbf16ps score path)
  void resize(int rows, int q_len, int d, int bs, bool widen) {
    q.resize(static_cast<size_t>(rows) * d);
    m.assign(rows, kNegInf);
    l.assign(rows, 0.f);
    alpha.resize(rows);
    acc.assign(static_cast<size_t>(rows) * d, 0.f);
    s.resize(static_cast<size_t>(rows) * std::max(1, kSpanKeys / bs) * bs);
    lo.resize(q_len);
    hi.resize(q_len);
    if (widen) {
      kbuf.resize(static_cast<size_t>(bs) * d);
      vbuf.resize(static_cast<size_t>(bs) * d);
    }
  }
};

// s[r * ld + t] = q_r . k_t for the n keys of a block, two rows by four keys at a time.
void block_scores(Workspace& ws, int rows, const float* k, int n, int d, float* s, int ld,
                  PanelPrefetcher& prefetch) {
  const float* q = ws.q.data();
  int r = 0;
  for (; r + 2 <= rows; r += 2) {
    const float *q0 = q + r * d, *q1 = q0 + d;
    float *s0 = s + r * ld, *s1 = s0 + ld;
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
    float* s0 = s + r * ld;
    int t = 0;
    for (; t + 4 <= n; t += 4) {
      prefetch.step();
      dot_1x4(q0, k + t * d, d, d, s0 + t);
    }
    for (; t < n; ++t) s0[t] = dot(q0, k + t * d, d);
  }
}

#if PAGEDLLM_AVX512BF16
// Whether a tile takes the bf16 dot-product score path: bf16 queries over a bf16 cache with whole
// 32-element pairs per head. Then the scores are q . k of two bf16 vectors, whose products are
// exact in float32: vdpbf16ps computes them straight from the cache panel, with no widening of K
// into the workspace and half the multiply instructions (the scale is applied to the sums).
template <typename QT, typename CT>
constexpr bool kDotProductScores = std::is_same_v<QT, bf16_t> && std::is_same_v<CT, bf16_t>;

// [sum(a), sum(b), sum(c), sum(d)] of four 16-lane vectors.
inline __m128 hsum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // 64-bit unpacks move float pairs; the sum is a float one.
  const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
  // Each 128-bit lane now holds [a, b, c, d] partial sums: add the four lanes.
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

inline __m512bh load_pairs(const bf16_t* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// s[r * ld + t] = scale * q_r . k_t for R (1..4) query rows and four keys of a bf16 panel,
// d % 32 == 0.
template <int R>
inline void dp_scores_rx4(const bf16_t* q, int d, const bf16_t* k, float scale, float* s,
                          int ld) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  for (int c = 0; c < d; c += 32) {
    const __m512bh k0 = load_pairs(k + c), k1 = load_pairs(k + d + c);
    const __m512bh k2 = load_pairs(k + 2 * d + c), k3 = load_pairs(k + 3 * d + c);
    for (int r = 0; r < R; ++r) {
      const __m512bh x = load_pairs(q + r * d + c);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, k1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], x, k2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], x, k3);
    }
  }
  const __m128 sc = _mm_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    _mm_storeu_ps(s + r * ld, _mm_mul_ps(hsum4x16(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), sc));
  }
}

// One key against R rows (the block's last n % 4 keys).
inline float dp_dot(const bf16_t* q, const bf16_t* k, int d) {
  __m512 acc = _mm512_setzero_ps();
  for (int c = 0; c < d; c += 32) acc = _mm512_dpbf16_ps(acc, load_pairs(q + c), load_pairs(k + c));
  return _mm512_reduce_add_ps(acc);
}

// block_scores for the dot-product path: the panel is read as it is stored.
void block_scores_dp(Workspace& ws, int rows, const bf16_t* k, int n, int d, float* s_base,
                     int ld, float scale, PanelPrefetcher& prefetch) {
  for (int r0 = 0; r0 < rows; r0 += 4) {
    const bf16_t* q = ws.qh.data() + static_cast<size_t>(r0) * d;
    float* s = s_base + static_cast<size_t>(r0) * ld;
    const int nr = std::min(4, rows - r0);
    int t = 0;
    for (; t + 4 <= n; t += 4) {
      prefetch.step();
      const bf16_t* kt = k + static_cast<size_t>(t) * d;
      switch (nr) {
        case 4: dp_scores_rx4<4>(q, d, kt, scale, s + t, ld); break;
        case 3: dp_scores_rx4<3>(q, d, kt, scale, s + t, ld); break;
        case 2: dp_scores_rx4<2>(q, d, kt, scale, s + t, ld); break;
        default: dp_scores_rx4<1>(q, d, kt, scale, s + t, ld); break;
      }
    }
    for (; t < n; ++t) {
      for (int r = 0; r < nr; ++r) {
        s[r * ld + t] = dp_dot(q + r * d, k + static_cast<size_t>(t) * d, d) * scale;
      }
    }
  }
}
#else
template <typename QT, typename CT>
constexpr bool kDotProductScores = false;
#endif

// Online softmax for row r over its visible keys [tb, te) of the span's n scored keys: updates
// the running max and sum, leaves exp(s - max) in place and zeros the keys it may not see.
// A soft cap (> 0) is applied to the visible scores first.
void softmax_update(Workspace& ws, int r, int tb, int te, int n, int ld, float cap) {
  float* sr = ws.s.data() + static_cast<size_t>(r) * ld;
  if (tb >= te) {
    std::fill(sr, sr + n, 0.f);
    ws.alpha[r] = 1.f;
    return;
  }
  if (cap > 0.f) soft_cap(sr + tb, te - tb, cap);
  const float m_new = std::max(ws.m[r], max_of(sr + tb, te - tb));
  const float alpha = std::exp(ws.m[r] - m_new);  // 0 on the row's first visible block
  ws.l[r] = ws.l[r] * alpha + exp_shift_sum(sr + tb, te - tb, m_new);
  ws.m[r] = m_new;
  ws.alpha[r] = alpha;
  std::fill(sr, sr + tb, 0.f);
  std::fill(sr + te, sr + n, 0.f);
}

// acc_r = acc_r * alpha_r + P[r, :n] V[:n] for every row, two rows per pass over the values.
void accumulate_values(Workspace& ws, int rows, const float* v, int n, int d, const float* p,
                       int ld) {
  float* acc = ws.acc.data();
  int r = 0;
  for (; r + 2 <= rows; r += 2) {
    scale_accumulate2(acc + r * d, acc + (r + 1) * d, ws.alpha[r], ws.alpha[r + 1], p + r * ld,
                      p + (r + 1) * ld, v, n, d, d);
  }
  if (r < rows) scale_accumulate(acc + r * d, ws.alpha[r], p + r * ld, v, n, d, d);
}

#if PAGEDLLM_AVX512
// Whether the values of a bf16 panel are read as stored (widened in registers) rather than
// widened into the workspace first: one load and a shift per 16 values instead of a store and
// a reload, with the accumulators of up to four rows in registers across the block.
template <typename CT>
constexpr bool kRegisterValues = std::is_same_v<CT, bf16_t>;

// acc_r[c0, c0 + 32) = acc_r * alpha_r + sum_t p_r[t] v[t] for R (1..4) rows.
template <int R>
inline void values_rx32(float* acc, const float* alpha, const float* p, int ld, const bf16_t* v,
                        int n, int d, int c0) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    lo[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + c0), al);
    hi[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + c0 + 16), al);
  }
  for (int t = 0; t < n; ++t) {
    const __m512 v0 = widen_bf16x16(v + static_cast<size_t>(t) * d + c0);
    const __m512 v1 = widen_bf16x16(v + static_cast<size_t>(t) * d + c0 + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * ld + t]);
      lo[r] = _mm512_fmadd_ps(w, v0, lo[r]);
      hi[r] = _mm512_fmadd_ps(w, v1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * d + c0, lo[r]);
    _mm512_storeu_ps(acc + r * d + c0 + 16, hi[r]);
  }
}

// accumulate_values over a bf16 panel as stored, d % 32 == 0.
void accumulate_values_bf16(Workspace& ws, int rows, const bf16_t* v, int n, int d,
                            const float* p, int ld) {
  for (int r0 = 0; r0 < rows; r0 += 4) {
    float* acc = ws.acc.data() + static_cast<size_t>(r0) * d;
    const float* alpha = ws.alpha.data() + r0;
    const float* pr = p + static_cast<size_t>(r0) * ld;
    const int nr = std::min(4, rows - r0);
    for (int c0 = 0; c0 < d; c0 += 32) {
      switch (nr) {
        case 4: values_rx32<4>(acc, alpha, pr, ld, v, n, d, c0); break;
        case 3: values_rx32<3>(acc, alpha, pr, ld, v, n, d, c0); break;
        case 2: values_rx32<2>(acc, alpha, pr, ld, v, n, d, c0); break;
        default: values_rx32<1>(acc, alpha, pr, ld, v, n, d, c0); break;
      }
    }
  }
}
#else
template <typename CT>
constexpr bool kRegisterValues = false;
#endif

// Copies the tile's query rows into the workspace (pre-scaled floats, or the bf16 rows as they are
// for the dot-product score path), sets each query token's visible key range [lo, hi) (causal,
// optionally windowed) and returns the union of those ranges.
template <typename QT, typename CT>
std::pair<int, int> load_rows(const Args<QT, CT>& a, const Tile& tile, Workspace& ws,
                              bool dot_product_scores) {
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
      const size_t row = static_cast<size_t>(i * group + g) * d;
      if (dot_product_scores) {
        if constexpr (std::is_same_v<QT, bf16_t>) std::copy(src, src + d, ws.qh.data() + row);
      } else {
        float* dst = ws.q.data() + row;
        for (int c = 0; c < d; ++c) dst[c] = static_cast<float>(src[c]) * a.scale;
      }
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
  const bool dp = kDotProductScores<QT, CT> && d % 32 == 0;
  const bool register_values = kRegisterValues<CT> && d % 32 == 0;
  if (dp) ws.qh.resize(static_cast<size_t>(rows) * d);
  const auto [kv_begin, kv_end] = load_rows(a, tile, ws, dp);

  const int32_t* table = a.block_tables + tile.seq * a.bt_stride;
  const int64_t kv_head_off = tile.kv_head * a.head_stride;
  const int first_block = kv_begin / bs, last_block = (kv_end - 1) / bs;
  // step() calls per block: one per micro-tile of the score kernel (2 or 4 rows x 4 keys).
  const int rows_per_micro = dp ? 4 : 2;
  const int64_t micro_tiles =
      static_cast<int64_t>((rows + rows_per_micro - 1) / rows_per_micro) * ((bs + 3) / 4);
  const int span_blocks = std::max(1, kSpanKeys / bs);
  const int ld = span_blocks * bs;  // row stride of the span's scores
  PanelPrefetcher prefetch;
  for (int j0 = first_block; j0 <= last_block; j0 += span_blocks) {
    const int j1 = std::min(last_block, j0 + span_blocks - 1);
    // The span's keys [span_begin, span_end): the blocks' visible keys, end to end.
    const int span_begin = std::max(kv_begin, j0 * bs);
    const int span_end = std::min(kv_end, (j1 + 1) * bs);
    for (int j = j0; j <= j1; ++j) {
      if (j < last_block) {
        const int64_t next = table[j + 1] * a.block_stride + kv_head_off;
        prefetch.reset(a.k_cache + next, a.v_cache + next,
                       a.head_stride * static_cast<int64_t>(sizeof(CT)), micro_tiles);
      } else {
        prefetch.reset(nullptr, nullptr, 0, 0);
      }
      const int kb = std::max(kv_begin, j * bs);
      const int n = std::min(kv_end, (j + 1) * bs) - kb;
      const CT* k_panel = a.k_cache + static_cast<int64_t>(table[j]) * a.block_stride +
                          kv_head_off + static_cast<int64_t>(kb - j * bs) * d;
      float* s = ws.s.data() + (kb - span_begin);
      if (dp) {
        if constexpr (kDotProductScores<QT, CT>) {
          block_scores_dp(ws, rows, k_panel, n, d, s, ld, a.scale, prefetch);
        }
      } else {
        block_scores(ws, rows, panel_floats(k_panel, static_cast<int64_t>(n) * d, ws.kbuf), n, d,
                     s, ld, prefetch);
      }
    }
    const int width = span_end - span_begin;
    for (int i = 0; i < tile.q_len; ++i) {
      const int tb = std::max(ws.lo[i] - span_begin, 0);
      const int te = std::min(ws.hi[i] - span_begin, width);
      for (int g = 0; g < group; ++g) softmax_update(ws, i * group + g, tb, te, width, ld, a.soft_cap);
    }
    for (int j = j0; j <= j1; ++j) {
      const int kb = std::max(kv_begin, j * bs);
      const int n = std::min(kv_end, (j + 1) * bs) - kb;
      const CT* v_panel = a.v_cache + static_cast<int64_t>(table[j]) * a.block_stride +
                          kv_head_off + static_cast<int64_t>(kb - j * bs) * d;
      const float* p = ws.s.data() + (kb - span_begin);
      if (register_values) {
        if constexpr (kRegisterValues<CT>) accumulate_values_bf16(ws, rows, v_panel, n, d, p, ld);
      } else {
        accumulate_values(ws, rows, panel_floats(v_panel, static_cast<int64_t>(n) * d, ws.vbuf),
                          n, d, p, ld);
      }
      // The accumulator is rescaled once per span, by its first block.
      if (j == j0) std::fill(ws.alpha.begin(), ws.alpha.begin() + rows, 1.f);
    }
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
                   int sliding_window, float soft_cap) {
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
  a.soft_cap = soft_cap;
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
                           int64_t sliding_window, double k_scale, double v_scale,
                           double soft_cap) {
  at::Tensor out = at::empty(query.sizes(), query.options());
  paged_attention_into(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                       sliding_window, k_scale, v_scale, soft_cap, out);
  return out;
}

void paged_attention_into(const at::Tensor& query, const at::Tensor& kv_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, double scale,
                          int64_t sliding_window, double k_scale, double v_scale,
                          double soft_cap, const at::Tensor& out) {
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
  TORCH_CHECK(soft_cap >= 0, "paged_attention: soft_cap must be >= 0 (0: none), got ", soft_cap);
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() &&
                  out.scalar_type() == query.scalar_type() && out.device().is_cpu(),
              "paged_attention: out must be a contiguous tensor of query's shape and dtype");
  const float qk_scale = static_cast<float>(scale * k_scale);
  const int window = sliding_window > 0 ? static_cast<int>(sliding_window) : 0;
  dispatch_compute(query.scalar_type(), "paged_attention", [&](auto q_tag) {
    using QT = decltype(q_tag);
    dispatch_cache(kv_cache.scalar_type(), "paged_attention", [&](auto c_tag) {
      using CT = decltype(c_tag);
      run_attention<QT, CT>(query, kv_cache, out, block_tables, seq_lens, query_start_loc,
                            qk_scale, static_cast<float>(v_scale), window,
                            static_cast<float>(soft_cap));
    });
  });
}

}  // namespace pagedllm
