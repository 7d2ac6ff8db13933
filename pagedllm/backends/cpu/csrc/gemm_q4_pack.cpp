// Packing of group-wise weights into the GEMM's panels (layout: gemm_q4_layout.h), once at
// load, and the read-bandwidth probe the benchmarks measure the decode paths against.
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "gemm_q4.h"

namespace pagedllm::gemm::q4 {

Format format_of(int64_t bits, bool half_scales, bool with_offset, bool factored, bool levels) {
  TORCH_CHECK(bits == 4 || bits == 8 || bits == 6, "groupwise: bits must be 4, 6 or 8, got ",
              bits);
  TORCH_CHECK(!factored || (bits == 4) == with_offset,
              "groupwise: factored weights are 4-bit with offsets or 8-bit without");
  TORCH_CHECK(bits != 6 || factored, "groupwise: six-bit weights are Q6_K's: factored");
#if !defined(PAGEDLLM_Q4_SIX)
  TORCH_CHECK(bits != 6, "groupwise: six-bit weights need an AVX2 or AVX-512 build");
#endif
  TORCH_CHECK(!levels || (bits == 4 && !with_offset && !factored),
              "groupwise: IQ4 levels are 4-bit without offsets, unfactored");
  TORCH_CHECK(bits != 6 || !with_offset, "groupwise: six-bit weights have no offsets");
  return Format{static_cast<int>(bits), half_scales, with_offset, factored, levels};
}

namespace {

// -- packing ----------------------------------------------------------------------------------
template <typename S>
void put_values(uint8_t* dst, const float* src, int64_t stride, int64_t cols) {
  S* out = reinterpret_cast<S*>(dst);
  for (int64_t j = 0; j < kCols; ++j) out[j] = j < cols ? S(src[j * stride]) : S(0.f);
}

// The 16 columns (rows of W) n0.. of one group's values (src[n * stride]), as fp16 or float32.
void put_floats(uint8_t* dst, const float* src, int64_t stride, int64_t cols, bool half) {
  if (half)
    put_values<c10::Half>(dst, src, stride, cols);
  else
    put_values<float>(dst, src, stride, cols);
}

// The inputs of a pack: the layer's tensors, and for a factored layer its factors.
struct PackSource {
  const uint8_t* w;
  int64_t ldw, groups;
  const float* scale;
  const float* offset;
  const float* factors;   // [N][groups / 8][2]: d, dm
  const uint8_t* index;   // [N][groups][2]: sc, m
};

// Column j's q of one group (row: its 32 int8 q) into a six block (gemm_q4_layout.h).
void pack_six(const uint8_t* row, int64_t j, uint8_t* block) {
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t lane = 2 * j; lane < 2 * j + 2; ++lane) {
      uint32_t u[8];
      for (int64_t p = 0; p < 8; ++p) u[p] = row[16 * h + 2 * p + lane % 2] & 63u;
      const uint32_t rows[3] = {u[0] | u[1] << 6 | (u[6] & 15) << 12,
                                u[2] | u[3] << 6 | (u[7] & 15) << 12,
                                u[4] | u[5] << 6 | (u[6] >> 4) << 12 | (u[7] >> 4) << 14};
      for (int64_t r = 0; r < 3; ++r) {
        uint8_t* word = block + h * Format::kSixHalf + r * kChunk + 2 * lane;
        word[0] = static_cast<uint8_t>(rows[r]);
        word[1] = static_cast<uint8_t>(rows[r] >> 8);
      }
    }
}

// The index of each IQ4 level (a `levels` layer's int8 weight) by its byte, -1 for others.
struct LevelIndex {
  int8_t of[256];
  constexpr LevelIndex() : of{} {
    for (auto& v : of) v = -1;
    for (int i = 0; i < 16; ++i) of[static_cast<uint8_t>(kIq4Levels[i])] = static_cast<int8_t>(i);
  }
};
constexpr LevelIndex kLevelIndex{};

// Column j's q of group g (row: the column's whole stored row) into a 4- or 8-bit block's
// chunks, one dword per column. A `levels` row is int8 levels, stored as their indices.
void pack_bytes(const uint8_t* row, int64_t g, int64_t j, const Format& f, uint8_t* block) {
  // Each layout its own loop (one general loop with per-byte branches took ~1 s of a 1B Q8_0
  // file's start-up, and 2.6 s of a 1B IQ4_XS file's for its levels): 8-bit q are 4-byte
  // runs, levels a look-up per byte, 4-bit nibbles a shuffle of 2-byte runs.
  if (f.bits == 8) {
    for (int64_t c = 0; c < 8; ++c)
      std::memcpy(block + c * kChunk + 4 * j, row + g * kGroup + 4 * c, 4);
    return;
  }
  if (f.levels) {  // int8 levels to their indices: a look-up per byte, one check per group
    const uint8_t* q = row + g * kGroup;
    int bad = 0;  // an index of -1 (not a level) sets its sign bit
    for (int64_t c = 0; c < 4; ++c) {
      uint8_t* out = block + c * kChunk + 4 * j;
      for (int64_t b = 0; b < 4; ++b) {  // byte b of chunk c: k = 8c + b (low), 8c + 4 + b
        const int lo = kLevelIndex.of[q[8 * c + b]], hi = kLevelIndex.of[q[8 * c + 4 + b]];
        bad |= lo | hi;
        out[b] = static_cast<uint8_t>(lo | hi << 4);
      }
    }
    if (bad < 0)
      for (int64_t i = 0; i < kGroup; ++i)
        TORCH_CHECK(kLevelIndex.of[q[i]] >= 0, "pack_groupwise: ",
                    static_cast<int>(static_cast<int8_t>(q[i])), " is not an IQ4 level");
    return;
  }
  // 4-bit nibbles
  const uint8_t* q = row + g * kGroup / 2;  // byte i: k = 2i (low nibble), 2i + 1 (high)
  for (int64_t c = 0; c < 4; ++c) {
    // byte b of chunk c: k = 8c + b (low nibble), 8c + 4 + b (high): bytes 4c.. and 4c + 2..
    const uint8_t* lo = q + 4 * c;
    const uint8_t* hi = q + 4 * c + 2;
    uint8_t* out = block + c * kChunk + 4 * j;
    out[0] = static_cast<uint8_t>((lo[0] & 0x0F) | (hi[0] << 4));
    out[1] = static_cast<uint8_t>((lo[0] >> 4) | (hi[0] & 0xF0));
    out[2] = static_cast<uint8_t>((lo[1] & 0x0F) | (hi[1] << 4));
    out[3] = static_cast<uint8_t>((lo[1] >> 4) | (hi[1] & 0xF0));
  }
}

// One block: the 16 columns n0.. (cols of them real; the rest zero) of group g.
void pack_block(const PackSource& src, int64_t n0, int64_t cols, int64_t g, const Format& f,
                uint8_t* panel) {
  uint8_t* block = panel + f.block_offset(g);  // zeroed with its super-block
  for (int64_t j = 0; j < cols; ++j) {
    if (f.six())
      pack_six(src.w + (n0 + j) * src.ldw + g * kGroup, j, block);
    else
      pack_bytes(src.w + (n0 + j) * src.ldw, g, j, f, block);
  }
  uint8_t* s = panel + f.scales_offset(g);
  if (f.factored) {
    for (int64_t j = 0; j < cols; ++j) {
      const uint8_t* idx = src.index + ((n0 + j) * src.groups + g) * 2;
      s[j] = idx[0];
      s[kCols + j] = idx[1];
    }
    return;
  }
  put_floats(s, src.scale + n0 * src.groups + g, src.groups, cols, f.half_scales);
  if (f.stores_offset())
    put_floats(s + f.scale_bytes(), src.offset + n0 * src.groups + g, src.groups, cols,
               f.half_scales);
}

void pack_panel(const PackSource& src, int64_t n, int64_t p, const Format& f, uint8_t* panel) {
  const int64_t n0 = p * kCols, cols = std::min(kCols, n - n0);
  for (int64_t g = 0; g < src.groups; ++g) {
    if (g % f.super_groups() == 0)  // padding, absent columns' and absent groups' bytes: zero
      std::memset(panel + f.super_offset(g), 0, f.super_bytes());
    if (f.factored && g % Format::kSuper == 0) {  // the super-block's header: d, then dm
      uint8_t* header = panel + f.super_offset(g);
      const int64_t per = f.two_scales() ? 1 : 2;  // factors per super-block: d (, dm)
      const int64_t sb = g / Format::kSuper, ldf = src.groups / Format::kSuper * per;
      const float* fac = src.factors + n0 * ldf + sb * per;
      put_floats(header, fac, ldf, cols, f.half_scales);
      if (!f.two_scales())
        put_floats(header + f.factor_bytes() / 2, fac + 1, ldf, cols, f.half_scales);
    }
    pack_block(src, n0, cols, g, f, panel);
  }
}

}  // namespace

torch::Tensor pack_groupwise(const torch::Tensor& weight, const torch::Tensor& scale,
                             const c10::optional<torch::Tensor>& offset, int64_t bits,
                             bool half_scales, bool with_offset,
                             const c10::optional<torch::Tensor>& factors,
                             const c10::optional<torch::Tensor>& index, bool levels,
                             const c10::optional<torch::Tensor>& into) {
  const Format f = format_of(bits, half_scales, with_offset, factors.has_value(), levels);
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2,
              "pack_groupwise: weight must be a CPU [N, K']");
  const bool nibbles = bits == 4 && !levels;  // IQ4 levels arrive as int8 values
  TORCH_CHECK(weight.scalar_type() == (nibbles ? at::kByte : at::kChar), "pack_groupwise: ",
              bits, "-bit weights must be ", nibbles ? "uint8" : "int8", ", got ",
              weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1) * (nibbles ? 2 : 1);
  TORCH_CHECK(k % kGroup == 0 && k > 0, "pack_groupwise: K=", k, " is not a multiple of 32");
  const int64_t groups = k / kGroup, panels = (n + kCols - 1) / kCols;
  const auto check = [&](const torch::Tensor& t, at::ScalarType dtype,
                         std::vector<int64_t> shape, const char* name) {
    const at::IntArrayRef want(shape);
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.sizes() == want,
                "pack_groupwise: ", name, " must be ", dtype, " ", want, ", got ",
                t.scalar_type(), " ", t.sizes());
    return t.contiguous();
  };
  const torch::Tensor w = weight.contiguous();
  const int64_t scales = f.two_scales() ? 2 * groups : groups;  // Q6_K: one per 16 k
  const torch::Tensor s = check(scale, at::kFloat, {n, scales}, "scale");
  torch::Tensor o, fac, idx;
  if (f.stores_offset()) {
    TORCH_CHECK(offset.has_value(), "pack_groupwise: with_offset needs the offsets");
    o = check(*offset, at::kFloat, {n, groups}, "offset");
  }
  if (f.factored) {
    TORCH_CHECK(groups % Format::kSuper == 0 && index.has_value(),
                "pack_groupwise: factored scales need K in whole 256s and the indices");
    const int64_t per = f.two_scales() ? 1 : 2;
    fac = check(*factors, at::kFloat, {n, groups / Format::kSuper, per}, "factors");
    idx = check(*index, at::kByte, {n, groups, 2}, "index");
  }
  torch::Tensor out;
  if (into.has_value()) {
    const std::vector<int64_t> want{panels, f.panel_bytes(groups)};
    TORCH_CHECK(into->device().is_cpu() && into->scalar_type() == at::kByte &&
                    into->sizes() == at::IntArrayRef(want) && into->is_contiguous(),
                "pack_groupwise: into must be a contiguous uint8 ", at::IntArrayRef(want),
                ", got ", into->scalar_type(), " ", into->sizes());
    out = *into;
  } else {
    out = torch::empty({panels, f.panel_bytes(groups)}, w.options().dtype(at::kByte));
  }
  const PackSource src{static_cast<const uint8_t*>(w.data_ptr()), w.size(1), groups,
                       s.data_ptr<float>(),
                       o.defined() ? o.data_ptr<float>() : nullptr,
                       fac.defined() ? fac.data_ptr<float>() : nullptr,
                       idx.defined() ? idx.data_ptr<uint8_t>() : nullptr};
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) pack_panel(src, n, p, f, dst + p * out.size(1));
  });
  return out;
}

int64_t panel_bytes(int64_t k, int64_t bits, bool half_scales, bool with_offset, bool factored,
                    bool levels) {
  TORCH_CHECK(k % kGroup == 0 && k > 0, "groupwise_panel_bytes: K=", k,
              " is not a multiple of 32");
  return format_of(bits, half_scales, with_offset, factored, levels).panel_bytes(k / kGroup);
}

torch::Tensor huge_page_empty(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "huge_page_empty: nbytes must be >= 0, got ", nbytes);
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t size = std::max<size_t>(1, (static_cast<size_t>(nbytes) + kHuge - 1) / kHuge) * kHuge;
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, kHuge, size) == 0, "huge_page_empty: cannot allocate ", size,
              " bytes");
#if defined(MADV_HUGEPAGE)
  madvise(p, size, MADV_HUGEPAGE);  // advice: refused (THP off) is no error
#endif
  return torch::from_blob(
      p, {nbytes}, [](void* q) { std::free(q); }, torch::TensorOptions().dtype(at::kByte));
}

namespace {

// -- rows of W back from the panels -------------------------------------------------------------
// Element j (a column of the panel: a row of W) of 16 fp16 or float32 values at p.
float stored(const uint8_t* p, int64_t j, bool half) {
  if (half) {
    c10::Half h;
    std::memcpy(&h, p + 2 * j, 2);
    return static_cast<float>(h);
  }
  float v;
  std::memcpy(&v, p + 4 * j, 4);
  return v;
}

// Column j's q at k (0..31) of one block, as the packers above store it.
int32_t block_q(const uint8_t* block, int64_t j, int64_t k, const Format& f) {
  if (f.six()) {
    const int64_t h = k / 16, pair = k % 16 / 2, lane = 2 * j + k % 2;
    uint32_t r[3];
    for (int64_t i = 0; i < 3; ++i) {
      const uint8_t* word = block + h * Format::kSixHalf + i * kChunk + 2 * lane;
      r[i] = word[0] | static_cast<uint32_t>(word[1]) << 8;
    }
    uint32_t u;  // the inverse of pack_six's three rows
    switch (pair) {
      case 0: u = r[0] & 63; break;
      case 1: u = r[0] >> 6 & 63; break;
      case 2: u = r[1] & 63; break;
      case 3: u = r[1] >> 6 & 63; break;
      case 4: u = r[2] & 63; break;
      case 5: u = r[2] >> 6 & 63; break;
      case 6: u = (r[0] >> 12 & 15) | (r[2] >> 12 & 3) << 4; break;
      default: u = (r[1] >> 12 & 15) | (r[2] >> 14 & 3) << 4; break;
    }
    return u >= 32 ? static_cast<int32_t>(u) - 64 : static_cast<int32_t>(u);  // q in -32..31
  }
  if (f.bits == 4) {
    const int64_t c = k / 8, b = k % 4;
    const uint8_t byte = block[c * kChunk + 4 * j + b];
    return k % 8 < 4 ? byte & 0x0F : byte >> 4;
  }
  return static_cast<int8_t>(block[k / 4 * kChunk + 4 * j + k % 4]);
}

// Row n of W (float32 [K]) from its panel, rounded as the definition rounds it
// (layers/quantization/groupwise.py): q * scale for 8 bits, (q * scale) + offset for 4.
void unpack_row(const uint8_t* panel, int64_t j, int64_t groups, const Format& f, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = panel + f.block_offset(g);
    const uint8_t* sp = panel + f.scales_offset(g);
    float scale[2], offset = 0.f;  // scale[1]: a two-scale group's k 16..31
    if (f.factored) {
      const uint8_t* header = panel + f.super_offset(g);
      const float d = stored(header, j, f.half_scales);
      if (f.two_scales()) {
        scale[0] = d * static_cast<float>(static_cast<int8_t>(sp[j]));
        scale[1] = d * static_cast<float>(static_cast<int8_t>(sp[kCols + j]));
      } else {
        scale[0] = scale[1] = d * static_cast<float>(sp[j]);
        offset = stored(header + f.factor_bytes() / 2, j, f.half_scales) *
                 static_cast<float>(sp[kCols + j]);
      }
    } else {
      scale[0] = scale[1] = stored(sp, j, f.half_scales);
      if (f.stores_offset())
        offset = stored(sp + f.scale_bytes(), j, f.half_scales);
      else if (f.bits == 4 && !f.levels)
        offset = scale[0] * -8.f;  // exact: a power of two
    }
    // q * scale + offset (Q4_0: -8 * scale); IQ4 levels and 8-bit without offsets: q * scale.
    const bool add_offset = f.with_offset || (f.bits == 4 && !f.levels);
    for (int64_t k = 0; k < kGroup; ++k) {
      int32_t q = block_q(block, j, k, f);
      if (f.levels) q = kIq4Levels[q];
      // volatile: the product rounded before the offset is added (no fused multiply-add),
      // as PyTorch's two operations round it.
      volatile float product = static_cast<float>(q) * scale[k / 16];
      out[g * kGroup + k] = add_offset ? product + offset : product;
    }
  }
}

}  // namespace

torch::Tensor groupwise_weight_rows(const torch::Tensor& packed, int64_t n, int64_t k,
                                    int64_t bits, bool half_scales, bool with_offset,
                                    bool factored, const torch::Tensor& rows, bool levels) {
  const Format f = format_of(bits, half_scales, with_offset, factored, levels);
  TORCH_CHECK(k % kGroup == 0 && k > 0, "groupwise_weight_rows: K=", k, " is not whole groups");
  const int64_t groups = k / kGroup, panels = (n + kCols - 1) / kCols;
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte &&
                  packed.dim() == 2 && packed.size(0) == panels &&
                  packed.size(1) == f.panel_bytes(groups) && packed.is_contiguous(),
              "groupwise_weight_rows: packed must be the contiguous uint8 [", panels, ", ",
              f.panel_bytes(groups), "] panels of this format, got ", packed.sizes());
  TORCH_CHECK(rows.device().is_cpu() && rows.dim() == 1 && rows.scalar_type() == at::kLong,
              "groupwise_weight_rows: rows must be a CPU int64 [R]");
  const torch::Tensor ids = rows.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t r = ids.numel();
  for (int64_t i = 0; i < r; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "groupwise_weight_rows: row ", id[i], " of ", n);
  torch::Tensor out = torch::empty({r, k}, packed.options().dtype(at::kFloat));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, r, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      unpack_row(src + id[i] / kCols * packed.size(1), id[i] % kCols, groups, f, dst + i * k);
  });
  return out;
}

namespace {

// Every byte of t read once, threads splitting it in contiguous ranges as the GEMMs split
// their panels: the read bandwidth the decode paths are measured against
// (benchmarks/linear_cpu.py). Returns a checksum, so that the loads cannot be dropped.
uint64_t read_range(const uint8_t* p, int64_t n) {
  uint64_t sum = 0;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 256 <= n; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
  }
  const __m512i a = _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3));
  sum = static_cast<uint64_t>(_mm512_reduce_add_epi64(a));
#elif defined(__AVX2__)
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (; i + 128 <= n; i += 128) {
    const auto at = [p](int64_t j) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j));
    };
    a0 = _mm256_xor_si256(a0, at(i));
    a1 = _mm256_xor_si256(a1, at(i + 32));
    a2 = _mm256_xor_si256(a2, at(i + 64));
    a3 = _mm256_xor_si256(a3, at(i + 96));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
  sum = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
#endif
  for (; i < n; ++i) sum += p[i];
  return sum;
}

}  // namespace

int64_t read_bytes(const torch::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "read_bytes: a contiguous CPU tensor");
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  const int64_t n = static_cast<int64_t>(t.nbytes()), chunk = int64_t{1} << 16;
  std::vector<uint64_t> sums(static_cast<size_t>((n + chunk - 1) / chunk));
  at::parallel_for(0, static_cast<int64_t>(sums.size()), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      sums[c] = read_range(p + c * chunk, std::min(chunk, n - c * chunk));
  });
  uint64_t sum = 0;
  for (uint64_t v : sums) sum ^= v;
  return static_cast<int64_t>(sum);
}

}  // namespace pagedllm::gemm::q4
