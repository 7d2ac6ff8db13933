// KV-cache writes and block moves for the CPU backend.
//
// reshape_and_cache scatters the step's new keys/values into their slots (layout
// [2, blocks, kv_heads, block_size, head_size]), converting from the compute dtype to the cache's
// (fp8: divided by the layer's scale and saturated); copy_blocks and swap_blocks move whole
// blocks with memcpy, which serves every cache dtype, in parallel over (layer, pair, K/V). Every index is checked before the
// parallel region, where throwing is not allowed.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "attention.h"
#include "convert.h"
#include "vec.h"

namespace pagedllm {
namespace {

void check_pairs(const at::Tensor& pairs, int64_t src_blocks, int64_t dst_blocks,
                 const char* op) {
  TORCH_CHECK(pairs.device().is_cpu() && pairs.scalar_type() == at::kLong &&
                  pairs.dim() == 2 && pairs.size(1) == 2 && pairs.is_contiguous(),
              op, ": pairs must be a contiguous [n, 2] int64 CPU tensor");
  const int64_t* p = pairs.data_ptr<int64_t>();
  for (int64_t i = 0; i < pairs.size(0); ++i) {
    TORCH_CHECK(p[2 * i] >= 0 && p[2 * i] < src_blocks && p[2 * i + 1] >= 0 &&
                    p[2 * i + 1] < dst_blocks,
                op, ": pair (", p[2 * i], ", ", p[2 * i + 1], ") is out of range");
  }
}

void check_cache(const at::Tensor& cache, const char* op) {
  TORCH_CHECK(cache.device().is_cpu() && cache.dim() >= 2 && cache.size(0) == 2 &&
                  cache.is_contiguous(),
              op, ": a cache must be a contiguous CPU tensor whose dim 0 is 2 (K, V)");
}

// Shapes and strides (in elements) of one reshape_and_cache call.
struct Scatter {
  const int64_t* slots;
  int64_t num_tokens, kvh, bs, d;
  int64_t c_half, c_block, c_head;  // cache strides: K->V, block, kv head
  int64_t k_tok, k_head, v_tok, v_head;
};

// One token row: a memcpy when the types agree (fp8 excepted: it always scales), else narrowing
// element by element with round-to-nearest-even.
template <typename IT, typename CT>
inline void put_row(const IT* src, CT* dst, int64_t d, float scale) {
  if constexpr (std::is_same_v<IT, CT>) {
    std::memcpy(dst, src, static_cast<size_t>(d) * sizeof(CT));
  } else {
    for (int64_t c = 0; c < d; ++c) dst[c] = narrow<CT>(static_cast<float>(src[c]), scale);
  }
}

template <typename IT, typename CT>
void scatter(const Scatter& s, const IT* key, const IT* value, CT* cache, float k_scale,
             float v_scale) {
  // ~16 KiB of copying per task before threads pay off.
  const int64_t row_bytes = s.d * static_cast<int64_t>(sizeof(CT));
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, 2 * s.kvh * row_bytes));
  at::parallel_for(0, s.num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = s.slots[t];
      if (slot < 0) continue;  // padding token
      const int64_t dst0 = (slot / s.bs) * s.c_block + (slot % s.bs) * s.d;
      for (int64_t h = 0; h < s.kvh; ++h) {
        CT* k_dst = cache + dst0 + h * s.c_head;
        put_row(key + t * s.k_tok + h * s.k_head, k_dst, s.d, k_scale);
        put_row(value + t * s.v_tok + h * s.v_head, k_dst + s.c_half, s.d, v_scale);
      }
    }
  });
}

}  // namespace

bool built_with_avx2() { return compiled_with_avx2(); }

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                       double k_scale, double v_scale) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.device().is_cpu(),
              "reshape_and_cache: kv_cache must be a contiguous CPU [2, blocks, kv_heads, "
              "block_size, head_size] tensor");
  const int64_t num_blocks = kv_cache.size(1), kvh = kv_cache.size(2);
  const int64_t bs = kv_cache.size(3), d = kv_cache.size(4);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == kvh && t->size(2) == d && t->stride(2) == 1 &&
                    t->scalar_type() == key.scalar_type() && t->device().is_cpu(),
                "reshape_and_cache: key/value must be [tokens, ", kvh, ", ", d,
                "] of one dtype with unit inner stride");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.is_contiguous() && slot_mapping.size(0) == key.size(0) &&
                  value.size(0) == key.size(0),
              "reshape_and_cache: slot_mapping must be int64 [tokens]");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "reshape_and_cache: k_scale and v_scale must be > 0");
  const int64_t num_tokens = key.size(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] < num_blocks * bs, "reshape_and_cache: slot ", slots[t],
                " is outside the cache (", num_blocks * bs, " slots)");
  }
  Scatter s{slots, num_tokens, kvh, bs, d, kv_cache.stride(0), kv_cache.stride(1),
            kv_cache.stride(2), key.stride(0), key.stride(1), value.stride(0), value.stride(1)};
  dispatch_compute(key.scalar_type(), "reshape_and_cache", [&](auto i_tag) {
    using IT = decltype(i_tag);
    dispatch_cache(kv_cache.scalar_type(), "reshape_and_cache", [&](auto c_tag) {
      using CT = decltype(c_tag);
      scatter<IT, CT>(s, static_cast<const IT*>(key.data_ptr()),
                      static_cast<const IT*>(value.data_ptr()),
                      static_cast<CT*>(kv_cache.data_ptr()), static_cast<float>(k_scale),
                      static_cast<float>(v_scale));
    });
  });
}

void copy_blocks(const std::vector<at::Tensor>& kv_caches, const at::Tensor& pairs) {
  if (kv_caches.empty() || pairs.numel() == 0) return;
  for (const at::Tensor& c : kv_caches) check_cache(c, "copy_blocks");
  const int64_t num_blocks = kv_caches[0].size(1);
  for (const at::Tensor& c : kv_caches) {
    TORCH_CHECK(c.sizes() == kv_caches[0].sizes() && c.dtype() == kv_caches[0].dtype(),
                "copy_blocks: every layer's cache must have the same shape and dtype");
  }
  check_pairs(pairs, num_blocks, num_blocks, "copy_blocks");
  const int64_t n = pairs.size(0), layers = static_cast<int64_t>(kv_caches.size());
  const size_t elem = kv_caches[0].element_size();
  const size_t block_bytes = kv_caches[0].stride(1) * elem;
  const size_t half_bytes = kv_caches[0].stride(0) * elem;
  const int64_t* p = pairs.data_ptr<int64_t>();
  std::vector<char*> bases(layers);
  for (int64_t l = 0; l < layers; ++l) bases[l] = static_cast<char*>(kv_caches[l].data_ptr());
  // One task per (layer, pair, K/V); distinct destinations never overlap a task's source
  // unless the caller asks for src == dst, where memmove keeps it harmless.
  at::parallel_for(0, layers * n * 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t kv = i % 2, pair = (i / 2) % n, layer = i / (2 * n);
      char* base = bases[layer] + kv * half_bytes;
      std::memmove(base + p[2 * pair + 1] * block_bytes, base + p[2 * pair] * block_bytes,
                   block_bytes);
    }
  });
}

void swap_blocks(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& pairs) {
  if (pairs.numel() == 0) return;
  check_cache(src, "swap_blocks");
  check_cache(dst, "swap_blocks");
  TORCH_CHECK(src.dtype() == dst.dtype() && src.dim() == dst.dim() &&
                  src.stride(1) == dst.stride(1) &&
                  src.sizes().slice(2) == dst.sizes().slice(2),
              "swap_blocks: pools must agree on dtype and per-block shape");
  check_pairs(pairs, src.size(1), dst.size(1), "swap_blocks");
  const int64_t n = pairs.size(0);
  const size_t elem = src.element_size();
  const size_t block_bytes = src.stride(1) * elem;
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  const size_t s_half = src.stride(0) * elem, d_half = dst.stride(0) * elem;
  const int64_t* p = pairs.data_ptr<int64_t>();
  at::parallel_for(0, n * 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t kv = i % 2, pair = i / 2;
      std::memcpy(d + kv * d_half + p[2 * pair + 1] * block_bytes,
                  s + kv * s_half + p[2 * pair] * block_bytes, block_bytes);
    }
  });
}

}  // namespace pagedllm
