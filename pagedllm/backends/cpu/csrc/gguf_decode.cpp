// GGUF blocks decoded into a group-wise layer's tensors, once at load. Q4_0 / Q4_1 / Q4_K:
// nibbles [N, K/2] (even k in the low nibble), float32 scale and offset [N, K/32] with
// W = q * scale + offset. Q6_K and Q3_K: int8 q [N, K], float32 d * sc [N, K/16] and d
// [N, K/256]. Q8_0, Q5_0, IQ4_NL and IQ4_XS: int8 q [N, K] and float32 scale [N, K/32],
// W = q * scale.
// Q5_K: int8 q [N, K] in 0..31, float32 scale and offset [N, K/32], W = q * scale + offset.
// The same values as the loader's numpy definitions (models/gguf/weights.py int4_groups,
// q6_k_groups, int8_groups), bit for bit, in one threaded pass instead of ~10 numpy passes over
// the whole tensor (most of a 4-bit file's conversion time).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstring>
#if defined(__SSSE3__)
#include <immintrin.h>
#endif
#include <string>
#include <tuple>
#include <vector>

#include "gemm_q4.h"

namespace pagedllm::gemm::q4 {

namespace {

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One group's 32 values 0..15 -> 16 bytes, value 2j in the low nibble of byte j.
void pack_group(const uint8_t* q, uint8_t* out) {
  for (int j = 0; j < 16; ++j) out[j] = static_cast<uint8_t>(q[2 * j] | (q[2 * j + 1] << 4));
}

// Q4_0 / Q4_1 order: value i (< 16) in the low nibble of byte i, value 16 + i in its high one.
void split_16(const uint8_t* qs, uint8_t* q) {
  for (int i = 0; i < 16; ++i) {
    q[i] = qs[i] & 0x0F;
    q[16 + i] = qs[i] >> 4;
  }
}

// Q4_K's 12 bytes of 6-bit (sc, m) for its 8 groups: groups 0-3 in the low 6 bits of bytes
// 0-3 (sc) and 4-7 (m); groups 4-7 take 4 low bits from bytes 8-11 (sc low, m high nibble) and
// their top 2 bits from the top of bytes 0-3 (sc) and 4-7 (m).
void q4_k_units(const uint8_t* s, int g, int* sc, int* m) {
  if (g < 4) {
    *sc = s[g] & 0x3F;
    *m = s[g + 4] & 0x3F;
  } else {
    *sc = (s[g + 4] & 0x0F) | ((s[g - 4] >> 6) << 4);
    *m = (s[g + 4] >> 4) | ((s[g] >> 6) << 4);
  }
}

enum class Type { kQ4_0, kQ4_1, kQ4_K, kQ6_K, kQ3_K, kQ8_0, kQ5_0, kIQ4_NL, kIQ4_XS, kQ5_K };

struct Kind {
  Type type;
  int64_t bytes;   // per block
  int64_t values;  // per block
};

Kind kind_of(const std::string& name) {
  if (name == "Q4_0") return {Type::kQ4_0, 18, 32};
  if (name == "Q4_1") return {Type::kQ4_1, 20, 32};
  if (name == "Q4_K") return {Type::kQ4_K, 144, 256};
  if (name == "Q6_K") return {Type::kQ6_K, 210, 256};
  if (name == "Q3_K") return {Type::kQ3_K, 110, 256};
  if (name == "Q8_0") return {Type::kQ8_0, 34, 32};
  if (name == "Q5_0") return {Type::kQ5_0, 22, 32};
  if (name == "IQ4_NL") return {Type::kIQ4_NL, 18, 32};
  if (name == "IQ4_XS") return {Type::kIQ4_XS, 136, 256};
  if (name == "Q5_K") return {Type::kQ5_K, 176, 256};
  TORCH_CHECK(false,
              "decode_gguf_blocks: kind must be Q4_0, Q4_1, Q4_K, Q6_K, Q3_K, Q8_0, Q5_0, IQ4_NL, "
              "IQ4_XS or Q5_K, got ",
              name);
}


// One Q3_K super-block (hmask 32 bytes, qs 64, 12 bytes of 6-bit scales, d fp16) -> 256 q in
// -4..3, 16 scales d * (sc - 32), and d. Value 32 j + i (j < 8, i < 32): its low 2 bits at bit
// 2 (j % 4) of qs byte 32 (j / 4) + i, minus 4 unless bit j of hmask byte i is set. Scale s:
// low nibble of byte s % 8 (high nibble for s >= 8), top 2 bits at bit 2 (s / 4) of byte
// 8 + s % 4.
void decode_q3_k(const uint8_t* b, int8_t* q, float* scale, float* d_out) {
  const float d = half_at(b + 108);
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 32; ++i) {
      const int low = (b[32 + 32 * (j / 4) + i] >> (2 * (j % 4))) & 0x03;
      q[32 * j + i] = static_cast<int8_t>(low - ((b[i] >> j) & 1 ? 0 : 4));
    }
  const uint8_t* s = b + 96;
  for (int k = 0; k < 16; ++k) {
    const int sc = ((s[k % 8] >> (4 * (k / 8))) & 0x0F) | (((s[8 + k % 4] >> (2 * (k / 4))) & 3) << 4);
    scale[k] = d * static_cast<float>(sc - 32);
  }
  *d_out = d;
}

// 16 bytes of IQ4 level indices (value i in the low nibble of byte i, 16 + i in its high one)
// -> their 32 levels.
void iq4_levels(const uint8_t* qs, int8_t* q) {
#if defined(__SSSE3__)
  const __m128i table = _mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Levels));
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(0x0F);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_shuffle_epi8(table, _mm_and_si128(v, m)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                   _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), m)));
#else
  uint8_t idx[32];
  split_16(qs, idx);
  for (int i = 0; i < 32; ++i) q[i] = kIq4Levels[idx[i]];
#endif
}

// One block of Q8_0 / Q5_0 / IQ4_NL (32 values) or IQ4_XS (256) -> int8 q and one scale per
// 32.
// Q5_0: (q - 16) * d, q's low 4 bits as Q4_0's, its fifth bit j at bit j of 4 bytes after d.
// IQ4_XS: per group g, d * (ls - 32) with ls's low nibble in byte 4 + g / 2 (odd g: the high
// nibble) and its top 2 bits at bit 2 g of the uint16 after d; 16 bytes of level indices.
void decode_int8_block(Type type, const uint8_t* b, int8_t* q, float* scale) {
  uint8_t idx[32];
  const float d = half_at(b);
  if (type == Type::kQ8_0) {  // d, then the 32 q themselves
    scale[0] = d;
    std::memcpy(q, b + 2, 32);
    return;
  }
  if (type == Type::kIQ4_XS) {
    uint16_t high;
    std::memcpy(&high, b + 2, sizeof high);
    for (int g = 0; g < 8; ++g) {
      const int ls = ((b[4 + g / 2] >> (4 * (g % 2))) & 0x0F) | (((high >> (2 * g)) & 3) << 4);
      scale[g] = d * static_cast<float>(ls - 32);
      iq4_levels(b + 8 + 16 * g, q + 32 * g);
    }
    return;
  }
  scale[0] = d;
  if (type == Type::kIQ4_NL) {
    iq4_levels(b + 2, q);
    return;
  }
  uint32_t high;  // Q5_0
  std::memcpy(&high, b + 2, sizeof high);
  split_16(b + 6, idx);
  for (int i = 0; i < 32; ++i)
    q[i] = static_cast<int8_t>((idx[i] | (((high >> i) & 1) << 4)) - 16);
}

// One Q6_K super-block (ql 128 bytes, qh 64, sc 16 signed, d fp16) -> 256 q - 32, 16 scales
// d * sc, and d. Each half (128 values) takes 64 bytes of ql and 32 of qh: value 32 j + i
// (j < 4, i < 32) has its low 4 bits in ql byte 32 (j % 2) + i (low nibble for j < 2) and its
// top 2 bits at bit 2 j of qh byte i.
void decode_q6_k(const uint8_t* b, int8_t* q, float* scale, float* d_out) {
  const float d = half_at(b + 208);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    for (int j = 0; j < 4; ++j) {
      for (int i = 0; i < 32; ++i) {
        const int low = (ql[32 * (j % 2) + i] >> (4 * (j / 2))) & 0x0F;
        const int high = (qh[i] >> (2 * j)) & 0x03;
        q[128 * h + 32 * j + i] = static_cast<int8_t>((low | (high << 4)) - 32);
      }
    }
  }
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int s = 0; s < 16; ++s) scale[s] = d * static_cast<float>(sc[s]);
  *d_out = d;
}

// One Q5_K super-block (d, dmin, 12 bytes of sc and m as Q4_K's, qh 32, qs 128) -> 256 q in
// 0..31 (group g, weight i: the low nibble of qs byte 32 (g / 2) + i, the high one for odd g,
// and bit g of qh byte i), and per group d * sc and -(dmin * m).
void decode_q5_k(const uint8_t* b, int8_t* q, float* scale, float* offset) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int g = 0; g < 8; ++g) {
    const uint8_t* run = qs + 32 * (g / 2);
    for (int i = 0; i < 32; ++i) {
      const int low = g % 2 ? run[i] >> 4 : run[i] & 0x0F;
      q[32 * g + i] = static_cast<int8_t>(low | (((qh[i] >> g) & 1) << 4));
    }
    int sc, m;
    q4_k_units(b + 4, g, &sc, &m);
    scale[g] = d * static_cast<float>(sc);
    offset[g] = -(dmin * static_cast<float>(m));
  }
}

// One block of `type` -> its groups' packed nibbles, scales and offsets.
void decode_block(Type type, const uint8_t* b, uint8_t* packed, float* scale, float* offset) {
  uint8_t q[32];
  if (type == Type::kQ4_K) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* qs = b + 16;
    for (int g = 0; g < 8; ++g) {
      const uint8_t* run = qs + 32 * (g / 2);  // even groups: low nibbles, odd: high
      for (int i = 0; i < 32; ++i) q[i] = g % 2 ? run[i] >> 4 : run[i] & 0x0F;
      pack_group(q, packed + 16 * g);
      int sc, m;
      q4_k_units(b + 4, g, &sc, &m);
      scale[g] = d * static_cast<float>(sc);
      offset[g] = -(dmin * static_cast<float>(m));
    }
    return;
  }
  const float d = half_at(b);
  const bool q4_1 = type == Type::kQ4_1;
  split_16(b + (q4_1 ? 4 : 2), q);
  pack_group(q, packed);
  scale[0] = d;
  offset[0] = q4_1 ? half_at(b + 2) : d * -8.0f;
}

}  // namespace

std::vector<torch::Tensor> decode_gguf_blocks(const torch::Tensor& blocks,
                                              const std::string& kind) {
  const Kind k = kind_of(kind);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.dim() == 2 && blocks.scalar_type() == at::kByte,
              "decode_gguf_blocks: blocks must be a CPU uint8 [N, row bytes]");
  TORCH_CHECK(blocks.size(1) % k.bytes == 0 && blocks.size(1) > 0, "decode_gguf_blocks: a row of ",
              blocks.size(1), " bytes is not whole ", kind, " blocks of ", k.bytes);
  const auto src = blocks.contiguous();
  const int64_t n = src.size(0), per_row = src.size(1) / k.bytes;
  const int64_t values = per_row * k.values;
  const uint8_t* in = src.data_ptr<uint8_t>();
  if (k.type == Type::kQ6_K || k.type == Type::kQ3_K) {
    auto q = torch::empty({n, values}, torch::kChar);
    auto scale = torch::empty({n, values / 16}, torch::kFloat);
    auto d = torch::empty({n, per_row}, torch::kFloat);
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    float* dp = d.data_ptr<float>();
    const auto decode = k.type == Type::kQ6_K ? decode_q6_k : decode_q3_k;
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t b = 0; b < per_row; ++b) {
          const int64_t at = r * per_row + b;
          decode(in + at * k.bytes, qp + at * 256, sp + at * 16, dp + at);
        }
    });
    return {q, scale, d};
  }
  if (k.type == Type::kQ8_0 || k.type == Type::kQ5_0 || k.type == Type::kIQ4_NL || k.type == Type::kIQ4_XS ||
      k.type == Type::kQ5_K) {  // int8 q and a scale per 32 (Q5_K: an offset too)
    const bool q5_k = k.type == Type::kQ5_K;
    const int64_t per_block = k.values / kGroup;
    auto q = torch::empty({n, values}, torch::kChar);
    auto scale = torch::empty({n, values / kGroup}, torch::kFloat);
    auto offset = q5_k ? torch::empty({n, values / kGroup}, torch::kFloat) : torch::Tensor();
    int8_t* qp = q.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    float* op = q5_k ? offset.data_ptr<float>() : nullptr;
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t b = 0; b < per_row; ++b) {
          const int64_t at = r * per_row + b;
          const uint8_t* block = in + at * k.bytes;
          if (q5_k)
            decode_q5_k(block, qp + at * k.values, sp + at * per_block, op + at * per_block);
          else
            decode_int8_block(k.type, block, qp + at * k.values, sp + at * per_block);
        }
    });
    if (q5_k) return {q, scale, offset};
    return {q, scale};
  }
  const int64_t groups = values / kGroup;
  auto packed = torch::empty({n, values / 2}, torch::kByte);
  auto scale = torch::empty({n, groups}, torch::kFloat);
  auto offset = torch::empty({n, groups}, torch::kFloat);
  uint8_t* out = packed.data_ptr<uint8_t>();
  float* sc = scale.data_ptr<float>();
  float* off = offset.data_ptr<float>();
  const int64_t block_groups = k.values / kGroup;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < per_row; ++b) {
        const int64_t g = r * groups + b * block_groups;
        decode_block(k.type, in + (r * per_row + b) * k.bytes, out + g * (kGroup / 2), sc + g,
                     off + g);
      }
    }
  });
  return {packed, scale, offset};
}

}  // namespace pagedllm::gemm::q4
