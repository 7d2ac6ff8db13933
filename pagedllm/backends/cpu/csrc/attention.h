// Entry points of the CPU paged-attention extension; bindings.cpp exposes them to Python.
#pragma once

#include "tensor_api.h"

#include <vector>

namespace pagedllm {

// Causal attention of every query token over its sequence's cached keys/values.
// query [tokens, heads, head_size] f32/bf16/f16 (the output has its dtype); kv_cache [2, blocks,
// kv_heads, block_size, head_size] f32/bf16/f16/fp8 (stored K = k / k_scale, V = v / v_scale);
// block_tables [seqs, width] i32; seq_lens [seqs] i32; query_start_loc [seqs + 1] i32.
// soft_cap > 0: each score s = scale * q.k becomes soft_cap * tanh(s / soft_cap) (Gemma 2).
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale,
                           int64_t sliding_window, double k_scale, double v_scale,
                           double soft_cap);

// kv_cache[0/1, slot / bs, :, slot % bs] = key/value[token] converted to the cache dtype (fp8:
// divided by k_scale / v_scale and saturated); negative slots are skipped.
// paged_attention into a given contiguous output of query's shape (the decode stack's scratch).
void paged_attention_into(const at::Tensor& query, const at::Tensor& kv_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, double scale,
                          int64_t sliding_window, double k_scale, double v_scale,
                          double soft_cap, const at::Tensor& out);

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                       double k_scale, double v_scale);

// For every layer cache: cache[:, pairs[i, 1]] = cache[:, pairs[i, 0]].
void copy_blocks(const std::vector<at::Tensor>& kv_caches, const at::Tensor& pairs);

// dst[:, pairs[i, 1]] = src[:, pairs[i, 0]] between two pools of one layer.
void swap_blocks(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& pairs);

// True when this build took the AVX2/FMA code path (reported by tests and the benchmark).
bool built_with_avx2();

}  // namespace pagedllm
