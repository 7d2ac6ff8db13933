// Group-wise quantised weights (4-bit and 8-bit, groups of 32 along K) for the CPU GEMM: the
// packed block layout and its unpacking into registers, per ISA level. Torch-free, so that the
// kernels can be built and timed on their own; gemm_q4.cpp binds them.
//
// The definition of the weights is pagedllm/layers/quantization/groupwise.py: 4-bit
// W[n, k] = q * scale[n, k/32] + offset[n, k/32] (q in 0..15; GGUF Q4_0 / Q4_1 / Q4_K and
// quantization="int4"), 8-bit W[n, k] = q * scale[n, k/32] (q in -127..127, GGUF Q8_0) or
// q * scale[n, k/16] (q in -32..31, GGUF Q6_K), or q * scale + offset per 32 (q in 0..31,
// GGUF Q5_K: plain super-blocks with offsets, float32 where fp16 cannot hold d * sc: 10 bits).
//
// Layout: panels of 16 output columns, each a run of super-blocks, so a decode step streams
// every panel once, front to back, scales included. A super-block is a header holding its
// groups' scales, then one block per group of 32 k holding q alone (4-bit: 256 bytes, 8-bit:
// 512), every block starting on a cache line: split 64-byte loads cost the one-row decode
// ~15% on a Zen 4 EPYC, and a block that carried its own scales (Q4_0: 256 + 32 bytes, Q8_0:
// 512 + 32) began every other one mid-line. Plain super-blocks hold 2 groups: a header of
// group 0's 16 scales | 16 offsets (4-bit, optional), then group 1's, then 2 blocks; a panel of
// an odd number of groups ends in an unread zero block. Scales and offsets are fp16 where that
// is exact for every group of the layer (GGUF Q4_0, Q4_1, Q8_0 store fp16), else float32. A
// 4-bit layer whose offsets are all -8 * scale (Q4_0, symmetric int4) stores no offsets: 4.5
// bits a weight, Q4_1-like 5, float32 scale and offset 6.
// Q4_K's scales are d * sc and offsets dm * m, with d and dm per super-block of 8 groups (fp16
// in the file) and sc, m 6-bit integers per group, products that fp16 cannot hold. Where every
// group factors so exactly, the layer is "factored": super-blocks of 8 groups whose header
// holds the 16 columns' d then dm (fp16 where exact, else float32), padded to whole 64 bytes,
// then each group's sc and m bytes (16 + 16): 4.625 bits a weight instead of 6.
// Q6_K ("two scales": 8-bit and factored) has one scale per 16 k, d * sc with d per 8 groups
// (fp16 in the file) and sc a signed byte: its header holds the 16 columns' d, padded to 64
// bytes, then each group's sc of k 0..15 (chunks 0-3) and of k 16..31 (chunks 4-7), 16 bytes
// each, before 8 blocks of q - 32 (of the file's q, in -32..31): 8.625 bits a weight.
// Q6_K at 6 bits ("six", bits = 6; AVX-512 and AVX2 builds, never the dot path): the same
// header, blocks of 384 bytes of q. A block holds two half groups of 16 k,
// 192 bytes each: three 64-byte rows R1, R2, R3 of 32 16-bit lanes. Lane 2c + j holds column
// c's q at k = 2p + j of the half group, p = 0..7 (the pair rows vdpbf16ps reads), as 6-bit
// u = q & 63: R1 = u0 | u1 << 6 | (u6 & 15) << 12,
// R2 = u2 | u3 << 6 | (u7 & 15) << 12, R3 = u4 | u5 << 6 | (u6 >> 4) << 12 | (u7 >> 4) << 14.
// vpermi2w reads only the low 6 bits of an index, so pair rows 0-5 are a lane-wise shift away
// (9 instructions for 8 rows with the two split values, where vpshufb took 8): 6.625 bits.
// On AVX2 the same lanes are the int16 pairs vpmaddwd reads: each field shifted to the top of
// its word and back down with its sign (six_word), 21 instructions for 8 rows of 8 columns.
// The weights are 64-byte chunks of one dword per column (the operand shape of vpdpbusd, and of
// vpmaddubsw + vpmaddwd): 4-bit chunk c holds, in column j's byte b, k = 8c + b in the low
// nibble and k = 8c + 4 + b in the high one; 8-bit chunk c holds k = 4c + b in byte b.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "gemm_vec.h"

#ifndef PAGEDLLM_PREFETCH_AHEAD
#define PAGEDLLM_PREFETCH_AHEAD 2048
#endif

namespace pagedllm::gemm::q4 {

// ggml's IQ4_NL / IQ4_XS levels (kvalues_iq4nl), which a `levels` layer's q index.
alignas(16) inline constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                      1,    13,   25,  38,  53,  69,  89,  113};

constexpr int64_t kCols = 16;   // output columns per panel
constexpr int64_t kGroup = 32;  // k per group: one scale (and offset) per column
constexpr int64_t kChunk = 64;  // bytes: one dword per column

// Kernels call these per group: they must inline (GCC left group_scales out of line once it
// grew the factored case, which doubled the one-row dot path's time from L2).
#define PAGEDLLM_Q4_INLINE inline __attribute__((always_inline))
// A panel kernel (one instantiation per rows, format and layout) is a function of its own: where
// GCC inlined every instantiation into its GEMM's driver, the giant function's register
// allocation kept the int32 sums of the 8-bit one-row kernel on the stack (a load, an add and a
// store per vpmaddwd: 556 such adds in run_avx2_rows<8>), which ran a Q8_0 layer at half the
// rate of the same kernel compiled alone. A call per panel costs nothing beside its groups.
#define PAGEDLLM_Q4_KERNEL inline __attribute__((noinline))

struct Format {
  static constexpr int64_t kSuper = 8;  // groups per factored super-block
  static constexpr int64_t kPlain = 2;  // groups per plain super-block
  int bits = 4;             // 4, 8, or 6 (Q6_K's q at 6 bits: always factored, two scales)
  bool half_scales = true;  // scales and offsets (factored: d and dm) stored as fp16
  // Offsets stored (4-bit: Q4_1, Q4_K; 8-bit: Q5_K's q in 0..31 with -dmin * m); a 4-bit
  // layer without them has offset = -8 * scale, an 8-bit one none.
  bool with_offset = true;
  // 4-bit with offsets: d, dm per 8 groups, sc, m bytes per group (Q4_K). 8-bit: d per 8
  // groups, two signed sc bytes per group, one per 16 k (Q6_K: two_scales).
  bool factored = false;
  // 4-bit without offsets whose q index ggml's 16 non-linear levels (IQ4_NL, IQ4_XS):
  // W = kIq4Levels[q] * scale. Q4_0's layout, read through another table.
  bool levels = false;
  PAGEDLLM_Q4_INLINE bool two_scales() const { return bits != 4 && factored; }
  PAGEDLLM_Q4_INLINE bool six() const { return bits == 6; }
  PAGEDLLM_Q4_INLINE int64_t weight_bytes() const {
    return bits == 4 ? 256 : (bits == 6 ? 2 * kSixHalf : 512);
  }
  static constexpr int64_t kSixHalf = 192;  // bytes of a six block's half group: R1, R2, R3
  PAGEDLLM_Q4_INLINE int64_t scale_bytes() const {
    return factored ? kCols : (half_scales ? 2 : 4) * kCols;
  }
  PAGEDLLM_Q4_INLINE bool stores_offset() const { return with_offset; }
  PAGEDLLM_Q4_INLINE int64_t block_bytes() const { return weight_bytes(); }  // q alone
  PAGEDLLM_Q4_INLINE int64_t super_groups() const { return factored ? kSuper : kPlain; }
  // log2(super_groups()): g / super_groups() as a shift, g % it as a mask (the compiler
  // emitted three 64-bit divisions per group for the run-time divisor, ~1/4 of a one-row
  // group's time in the int16 kernel on a Zen 3 EPYC).
  static_assert(kSuper == 8 && kPlain == 2, "super_shift: powers of two");
  PAGEDLLM_Q4_INLINE int super_shift() const { return factored ? 3 : 1; }
  PAGEDLLM_Q4_INLINE int64_t super_index(int64_t g) const { return g >> super_shift(); }
  PAGEDLLM_Q4_INLINE int64_t super_rest(int64_t g) const { return g & (super_groups() - 1); }
  // A group's bytes in the header: sc and m (factored), or its scales and offsets.
  PAGEDLLM_Q4_INLINE int64_t group_scale_bytes() const {
    return factored ? 2 * kCols : scale_bytes() * (stores_offset() ? 2 : 1);
  }
  // A factored header's leading d (and dm), and the room it takes: whole 64 bytes.
  PAGEDLLM_Q4_INLINE int64_t factor_bytes() const {
    return (two_scales() ? 1 : 2) * (half_scales ? 2 : 4) * kCols;
  }
  PAGEDLLM_Q4_INLINE int64_t factor_space() const {
    return factored ? (factor_bytes() + 63) / 64 * 64 : 0;
  }
  PAGEDLLM_Q4_INLINE int64_t header_bytes() const {
    return factor_space() + super_groups() * group_scale_bytes();
  }
  PAGEDLLM_Q4_INLINE int64_t super_bytes() const {
    return header_bytes() + super_groups() * block_bytes();
  }
  // Where group g's super-block, block and scales (or index bytes) start in its panel.
  PAGEDLLM_Q4_INLINE int64_t super_offset(int64_t g) const {
    return super_index(g) * super_bytes();
  }
  PAGEDLLM_Q4_INLINE int64_t block_offset(int64_t g) const {
    return super_offset(g) + header_bytes() + super_rest(g) * block_bytes();
  }
  PAGEDLLM_Q4_INLINE int64_t scales_offset(int64_t g) const {
    return super_offset(g) + factor_space() + super_rest(g) * group_scale_bytes();
  }
  PAGEDLLM_Q4_INLINE int64_t panel_bytes(int64_t groups) const {
    return (groups + super_groups() - 1) / super_groups() * super_bytes();
  }
};

// A layout fixed at compile time, for the kernels of few rows: L::of(f) is f itself for
// RuntimeLayout, else a constexpr Format equal to f, so that every field the kernel reads per
// group (block_offset, scales_offset, prefetch_group's range, group_scales' branches) folds to
// constants and shifts. With f read at run time, a one-row Q4_0 group spent ~50 scalar
// instructions and four format branches on addresses beside its ~130 vector ones; measured on
// a Zen 3 EPYC (a torch-free harness of avx2_i16_rows<4, 1>, K = 2048, interleaved runs): from
// L2 19-28 -> 13-15 ns a group and panel, streamed from memory on two threads 14-22 -> 20-25
// GB/s. with_layout picks the layout: GGUF's common formats fixed, any other at run time.
// IQ4 levels are always a fixed layout (format_of: 4-bit, no offsets, unfactored; fp16 or
// float32 scales: Iq4Layout, Iq4F32Layout), so a kernel knows at compile time whether it looks
// its q up (kLevels); RuntimeLayout never carries them.
template <int Bits, bool Half, bool Offset, bool Factored, bool Levels = false>
struct FixedLayout {
  static constexpr Format kFormat{Bits, Half, Offset, Factored, Levels};
  static constexpr bool kLevels = Levels;
  static PAGEDLLM_Q4_INLINE const Format& of(const Format&) { return kFormat; }
};
struct RuntimeLayout {
  static constexpr bool kLevels = false;
  static PAGEDLLM_Q4_INLINE const Format& of(const Format& f) { return f; }
};
using Q4_0Layout = FixedLayout<4, true, false, false>;  // Q4_0, int4 without offsets
using Q4_1Layout = FixedLayout<4, true, true, false>;   // Q4_1
using Q4_KLayout = FixedLayout<4, true, true, true>;    // Q4_K
using Q8_0Layout = FixedLayout<8, true, false, false>;  // Q8_0
using Q6_KLayout = FixedLayout<8, true, false, true>;   // Q6_K: two scales
using Q6_KSixLayout = FixedLayout<6, true, false, true>;  // Q6_K's q at 6 bits
using Iq4Layout = FixedLayout<4, true, false, false, true>;      // IQ4_NL: fp16 d
using Iq4F32Layout = FixedLayout<4, false, false, false, true>;  // IQ4_XS: d * (ls - 32)

inline constexpr bool operator==(const Format& a, const Format& b) {
  return a.bits == b.bits && a.half_scales == b.half_scales && a.with_offset == b.with_offset &&
         a.factored == b.factored && a.levels == b.levels;
}

// fn(L{}) with the layout a kernel of Bits-bit q (TwoScales: Q6_K's; 6: its six form) reads f
// through.
template <int Bits, bool TwoScales, typename Fn>
PAGEDLLM_Q4_INLINE void with_layout(const Format& f, Fn&& fn) {
  if constexpr (Bits == 6) {
    if (f == Q6_KSixLayout::kFormat) return fn(Q6_KSixLayout{});
  } else if constexpr (Bits == 4) {
    if (f == Q4_0Layout::kFormat) return fn(Q4_0Layout{});
    if (f == Q4_1Layout::kFormat) return fn(Q4_1Layout{});
    if (f == Q4_KLayout::kFormat) return fn(Q4_KLayout{});
    if (f == Iq4Layout::kFormat) return fn(Iq4Layout{});
    if (f == Iq4F32Layout::kFormat) return fn(Iq4F32Layout{});
  } else if constexpr (TwoScales) {
    if (f == Q6_KLayout::kFormat) return fn(Q6_KLayout{});
  } else {
    if (f == Q8_0Layout::kFormat) return fn(Q8_0Layout{});
  }
  fn(RuntimeLayout{});
}

// Group g's share of its panel's bytes (headers included, in proportion), kPrefetchAhead bytes
// further on into L1 and kPrefetchL2Ahead bytes further on into L2, asked for now: the panels
// are read front to back, so these are the lines a few groups later. Measured on a 2-core Xeon
// VM, one row, weights streamed from memory: the kernels' conversion work and the memory's
// latency did not overlap under the hardware prefetcher alone (a Q8_0 gate/up layer read its
// weights at 13 GB/s of the 31 measured, where the same layer from cache ran at 29). With the
// L1 prefetch alone a one-row Q4_K layer still read at ~23 GB/s (24 layers of 8192 x 2048 in
// turn, 230 MB: beyond the caches) where a plain read of the same bytes ran at 30: the lines
// asked for 2 KiB ahead were too few to cover the memory's latency, and asking for L1 lines
// further ahead held L1's fill buffers longer (4 and 8 KiB: slower). The second, L2 stream 8 KiB
// ahead keeps more misses in flight (L2's queue, not L1's buffers), and the L1 prefetch then
// finds the lines in L2: 24-25 GB/s there, a 1B Q4_K_M decode step at one sequence 1.08x (three
// alternating processes each), unchanged at 8 sequences; 16 KiB ahead was slower again.
#if defined(__SSE__)
constexpr int64_t kPrefetchAhead = PAGEDLLM_PREFETCH_AHEAD;
constexpr int64_t kPrefetchL2Ahead = 4 * kPrefetchAhead;
PAGEDLLM_Q4_INLINE void prefetch_group(const uint8_t* panel, int64_t g, const Format& f) {
  const int64_t share = f.super_bytes(), shift = f.super_shift();
  const int64_t base = f.super_index(g) * share, i = f.super_rest(g);  // g >= 0: shifts divide
  const int64_t from = base + (((i * share) >> shift) + 63) / 64 * 64;
  const int64_t to = base + (((i + 1) * share) >> shift);
  for (int64_t b = from; b < to; b += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + b + kPrefetchAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(panel + b + kPrefetchL2Ahead), _MM_HINT_T1);
  }
}
#else
PAGEDLLM_Q4_INLINE void prefetch_group(const uint8_t*, int64_t, const Format&) {}
#endif

// -- float32 vectors of 16 columns beyond gemm_vec.h's ------------------------------------------
#if defined(__AVX512F__)
inline V16 v_mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 v_fmav(V16 acc, V16 a, V16 b) { return {_mm512_fmadd_ps(a.v, b.v, acc.v)}; }
inline V16 v_set(float x) { return {_mm512_set1_ps(x)}; }
#elif defined(__AVX2__)
inline V16 v_mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 v_fmav(V16 acc, V16 a, V16 b) {
  return {_mm256_fmadd_ps(a.lo, b.lo, acc.lo), _mm256_fmadd_ps(a.hi, b.hi, acc.hi)};
}
inline V16 v_set(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
#else
inline V16 v_mul(V16 a, V16 b) {
  for (int j = 0; j < 16; ++j) a.v[j] *= b.v[j];
  return a;
}
inline V16 v_fmav(V16 acc, V16 a, V16 b) {
  for (int j = 0; j < 16; ++j) acc.v[j] += a.v[j] * b.v[j];
  return acc;
}
inline V16 v_set(float x) {
  V16 r;
  for (float& v : r.v) v = x;
  return r;
}
#endif

// 16 bytes as float32 (the factored layout's sc and m: unsigned; Q6_K's sc: signed).
template <bool Signed = false>
PAGEDLLM_Q4_INLINE V16 u8_load(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b))};
#elif defined(__AVX2__)
  const auto half = [p](int h) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h));
    return _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  };
  return {half(0), half(1)};
#else
  V16 r;
  for (int j = 0; j < 16; ++j)
    r.v[j] = Signed ? static_cast<float>(static_cast<int8_t>(p[j])) : static_cast<float>(p[j]);
  return r;
#endif
}

// Group g's scales and offsets (of the panel starting at `panel`) as float32; an 8-bit group
// has no offset: zero. Factored: d * sc and dm * m, exact (the products the file defines).
// Two-scale (Q6_K) groups have no offset either: *offset is the scale of k 16..31 instead,
// *scale that of k 0..15, both d * sc (exact: 11 by 8 significant bits).
PAGEDLLM_Q4_INLINE void group_scales(const uint8_t* panel, int64_t g, const Format& f,
                                     V16* scale, V16* offset) {
  const auto load = [&f](const uint8_t* q) {
    return f.half_scales ? w_load(Fp16W{}, reinterpret_cast<const uint16_t*>(q))
                         : v_load(reinterpret_cast<const float*>(q));
  };
  const uint8_t* p = panel + f.scales_offset(g);
  if (f.factored) {
    const uint8_t* header = panel + f.super_offset(g);
    const V16 d = load(header);
    if (f.two_scales()) {
      *scale = v_mul(d, u8_load<true>(p));
      *offset = v_mul(d, u8_load<true>(p + kCols));
      return;
    }
    *scale = v_mul(d, u8_load(p));
    *offset = v_mul(load(header + f.factor_bytes() / 2), u8_load(p + kCols));
    return;
  }
  *scale = load(p);
  if (f.with_offset)
    *offset = load(p + f.scale_bytes());
  else if (f.bits == 8 || f.levels)
    *offset = v_zero();
  else
    *offset = v_mul(*scale, v_set(-8.f));  // exact: a power of two
}

// -- one chunk as rows of 16 float32 weights ---------------------------------------------------
// q[i] = the 16 columns' q at k = 8c + i (4-bit) or 4c + i (8-bit), as float32 (exact).
#if defined(__AVX512F__)
// Byte b of every dword moved to the dword's low byte, the rest zeroed (vpshufb's control).
alignas(64) inline constexpr int8_t kByteCtl[4][16] = {
    {0, -1, -1, -1, 4, -1, -1, -1, 8, -1, -1, -1, 12, -1, -1, -1},
    {1, -1, -1, -1, 5, -1, -1, -1, 9, -1, -1, -1, 13, -1, -1, -1},
    {2, -1, -1, -1, 6, -1, -1, -1, 10, -1, -1, -1, 14, -1, -1, -1},
    {3, -1, -1, -1, 7, -1, -1, -1, 11, -1, -1, -1, 15, -1, -1, -1}};

inline __m512i byte_ctl(int b) {
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kByteCtl[b])));
}

// vpermps reads the low 4 bits of each index: shifting nibble t of every dword down and looking
// it up in [0.0, 1.0, ..., 15.0] (or the IQ4 levels) converts it (one shift and one permute per
// row of 16).
inline void int4_rows(const uint8_t* chunk, V16 q[8], bool levels = false) {
  const __m512i v = _mm512_loadu_si512(chunk);
  const __m512 values =
      levels ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                   _mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Levels))))
             : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {  // nibble t: byte t / 2, low (k = 8c + t / 2) or high (+4)
    const __m512i idx = t == 0 ? v : _mm512_srli_epi32(v, 4 * t);
    q[t / 2 + 4 * (t % 2)] = {_mm512_permutexvar_ps(idx, values)};
  }
}

inline void int8_rows(const uint8_t* chunk, V16 q[4]) {
  const __m512i v = _mm512_loadu_si512(chunk);
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) {  // byte b to the top, then an arithmetic shift sign-extends it
    const __m512i top = b == 3 ? v : _mm512_slli_epi32(v, 24 - 8 * b);
    q[b] = {_mm512_cvtepi32_ps(_mm512_srai_epi32(top, 24))};
  }
}

#elif defined(__AVX2__)
alignas(32) inline constexpr int8_t kByteCtl[4][16] = {
    {0, -1, -1, -1, 4, -1, -1, -1, 8, -1, -1, -1, 12, -1, -1, -1},
    {1, -1, -1, -1, 5, -1, -1, -1, 9, -1, -1, -1, 13, -1, -1, -1},
    {2, -1, -1, -1, 6, -1, -1, -1, 10, -1, -1, -1, 14, -1, -1, -1},
    {3, -1, -1, -1, 7, -1, -1, -1, 11, -1, -1, -1, 15, -1, -1, -1}};

inline __m256i byte_ctl(int b) {
  return _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kByteCtl[b])));
}

// IQ4 levels: the nibbles looked up as signed bytes (vpshufb), sign-extended once moved to
// their dwords.
inline void int4_rows(const uint8_t* chunk, V16 q[8], bool levels = false) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  const __m256i table = _mm256_broadcastsi128_si256(
      _mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Levels)));
  __m256i lo[2], hi[2];
  for (int h = 0; h < 2; ++h) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * h));
    lo[h] = _mm256_and_si256(v, m);
    hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
    if (levels) {
      lo[h] = _mm256_shuffle_epi8(table, lo[h]);
      hi[h] = _mm256_shuffle_epi8(table, hi[h]);
    }
  }
  const auto floats = [levels](__m256i d) {
    return _mm256_cvtepi32_ps(levels ? _mm256_srai_epi32(_mm256_slli_epi32(d, 24), 24) : d);
  };
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) {
    const __m256i ctl = byte_ctl(b);
    q[b] = {floats(_mm256_shuffle_epi8(lo[0], ctl)), floats(_mm256_shuffle_epi8(lo[1], ctl))};
    q[4 + b] = {floats(_mm256_shuffle_epi8(hi[0], ctl)), floats(_mm256_shuffle_epi8(hi[1], ctl))};
  }
}

inline void int8_rows(const uint8_t* chunk, V16 q[4]) {
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
  const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32));
#pragma GCC unroll 4
  for (int b = 0; b < 4; ++b) {
    const int up = 24 - 8 * b;
    q[b] = {_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v0, up), 24)),
            _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v1, up), 24))};
  }
}

#else
inline void int4_rows(const uint8_t* chunk, V16 q[8], bool levels = false) {
  const auto value = [levels](int nibble) {
    return static_cast<float>(levels ? kIq4Levels[nibble] : nibble);
  };
  for (int j = 0; j < 16; ++j) {
    for (int b = 0; b < 4; ++b) {
      const uint8_t byte = chunk[4 * j + b];
      q[b].v[j] = value(byte & 0x0F);
      q[4 + b].v[j] = value(byte >> 4);
    }
  }
}

inline void int8_rows(const uint8_t* chunk, V16 q[4]) {
  for (int j = 0; j < 16; ++j)
    for (int b = 0; b < 4; ++b)
      q[b].v[j] = static_cast<float>(static_cast<int8_t>(chunk[4 * j + b]));
}
#endif

#if defined(__AVX512BW__)
// -- six: Q6_K's q at 6 bits -------------------------------------------------------------------
// bf16 bits of the 6-bit q of a two-scale (Q6_K) layer, -32..31, by their low 6 bits (the
// index bits vpermi2w reads): i for i < 32, i - 64 above.
alignas(64) inline constexpr uint16_t kBf16OfSix[64] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x4180, 0x4188, 0x4190, 0x4198, 0x41A0, 0x41A8, 0x41B0, 0x41B8,
    0x41C0, 0x41C8, 0x41D0, 0x41D8, 0x41E0, 0x41E8, 0x41F0, 0x41F8,
    0xC200, 0xC1F8, 0xC1F0, 0xC1E8, 0xC1E0, 0xC1D8, 0xC1D0, 0xC1C8,
    0xC1C0, 0xC1B8, 0xC1B0, 0xC1A8, 0xC1A0, 0xC198, 0xC190, 0xC188,
    0xC180, 0xC170, 0xC160, 0xC150, 0xC140, 0xC130, 0xC120, 0xC110,
    0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80};

// One six half group (16 k) as its 8 pair rows of bf16 q: out[p] holds k = 2p, 2p + 1 of
// every column (vdpbf16ps's pairs). The index words carry bits above the 6 that vpermi2w
// reads; only the two split values need their high bits masked in (vpternlogd: a | (b & m)).
PAGEDLLM_Q4_INLINE void six_pairs(const uint8_t* half, __m512i out[8]) {
  const __m512i lo = _mm512_load_si512(kBf16OfSix), hi = _mm512_load_si512(kBf16OfSix + 32);
  const __m512i r1 = _mm512_loadu_si512(half), r2 = _mm512_loadu_si512(half + 64);
  const __m512i r3 = _mm512_loadu_si512(half + 128), top = _mm512_set1_epi16(0x30);
  const __m512i idx[8] = {
      r1, _mm512_srli_epi16(r1, 6), r2, _mm512_srli_epi16(r2, 6),
      r3, _mm512_srli_epi16(r3, 6),
      _mm512_ternarylogic_epi32(_mm512_srli_epi16(r1, 12), _mm512_srli_epi16(r3, 8), top, 0xF8),
      _mm512_ternarylogic_epi32(_mm512_srli_epi16(r2, 12), _mm512_srli_epi16(r3, 10), top, 0xF8)};
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) out[p] = _mm512_permutex2var_epi16(lo, idx[p], hi);
}

// A pair row's two k as float32 rows of 16 columns (bf16 to float32: the top half of a dword).
PAGEDLLM_Q4_INLINE void pair_floats(__m512i pair, V16* even, V16* odd) {
  *even = {_mm512_castsi512_ps(_mm512_slli_epi32(pair, 16))};
  *odd = {_mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(-65536)))};
}

// q of one six half group as 16 float32 rows (w[i]: k = i of the half group), times `scale`.
PAGEDLLM_Q4_INLINE void six_rows(const uint8_t* half, V16 scale, V16 w[16]) {
  __m512i pairs[8];
  six_pairs(half, pairs);
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    V16 even, odd;
    pair_floats(pairs[p], &even, &odd);
    w[2 * p] = v_mul(even, scale);
    w[2 * p + 1] = v_mul(odd, scale);
  }
}
#define PAGEDLLM_Q4_SIX 1
#elif defined(__AVX2__) && !defined(__AVX512F__)
// -- six on AVX2: the same blocks as int16 lanes -------------------------------------------------
// Pair row P (0..7) of one six half group for 8 columns (Cols 0: columns 0-7, the rows' first
// 32 bytes; 1: 8-15) as int16 lanes of q (-32..31): int32 lane c holds column c's q at
// k = 2P (low word) and 2P + 1 (high word) of the half group, the operand vpmaddwd reads
// against a word of x. A field at bits b..b+5 of its word goes to the top and comes down with
// its sign (two shifts); rows 6 and 7 join R1's / R2's top nibble with R3's top bits (their
// sign), shifted into place. Rows are loaded where used: an L1 hit, and the row kernels' sums
// keep the registers.
template <int P>
PAGEDLLM_Q4_INLINE __m256i six_word(const uint8_t* half, int cols) {
  const auto row = [half, cols](int i) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + i * kChunk + 32 * cols));
  };
  if constexpr (P < 6) {  // R1: u0, u1; R2: u2, u3; R3: u4, u5
    const __m256i r = row(P / 2);
    return _mm256_srai_epi16(_mm256_slli_epi16(r, P % 2 == 0 ? 10 : 4), 10);
  } else if constexpr (P == 6) {  // R1's bits 12..15, R3's 12..13 (the sign): times 16
    const __m256i top = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(row(2), 2), 10),
                                         _mm256_set1_epi16(-16));
    return _mm256_or_si256(_mm256_srli_epi16(row(0), 12), top);
  } else {  // R2's bits 12..15, R3's 14..15
    const __m256i top = _mm256_slli_epi16(_mm256_srai_epi16(row(2), 14), 4);
    return _mm256_or_si256(_mm256_srli_epi16(row(1), 12), top);
  }
}

// A pair row's even k (its low words) and odd k (high words) as float32, sign-extended.
PAGEDLLM_Q4_INLINE __m256 six_even(__m256i v) {
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16));
}
PAGEDLLM_Q4_INLINE __m256 six_odd(__m256i v) {
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16));
}

template <int... P>
PAGEDLLM_Q4_INLINE void six_rows_of(const uint8_t* half, V16 scale, V16 w[16],
                                    std::integer_sequence<int, P...>) {
  ((w[2 * P] = v_mul({six_even(six_word<P>(half, 0)), six_even(six_word<P>(half, 1))}, scale)),
   ...);
  ((w[2 * P + 1] = v_mul({six_odd(six_word<P>(half, 0)), six_odd(six_word<P>(half, 1))}, scale)),
   ...);
}

// q of one six half group as 16 float32 rows (w[i]: k = i of the half group), times `scale`.
PAGEDLLM_Q4_INLINE void six_rows(const uint8_t* half, V16 scale, V16 w[16]) {
  six_rows_of(half, scale, w, std::make_integer_sequence<int, 8>{});
}
#define PAGEDLLM_Q4_SIX 1
#endif  // __AVX512BW__, __AVX2__

// The 16 columns' dequantised weights at the 32 k of group g, exactly as the definition
// rounds them (q * scale + offset: one fused rounding, which for GGUF data, where q * scale is
// exact, is the definition's own): w[i] is k = i of the group.
inline void dequantize_block(const uint8_t* panel, int64_t g, const Format& f, V16 w[kGroup]) {
  const uint8_t* block = panel + f.block_offset(g);
  V16 s, o;
  group_scales(panel, g, f, &s, &o);
#if defined(PAGEDLLM_Q4_SIX)
  if (f.six()) {
    six_rows(block, s, w);
    six_rows(block + Format::kSixHalf, o, w + 16);
    return;
  }
#endif
  if (f.bits == 4) {
    for (int c = 0; c < 4; ++c) {
      V16 q[8];
      int4_rows(block + c * kChunk, q, f.levels);
      for (int i = 0; i < 8; ++i) w[8 * c + i] = v_fmav(o, q[i], s);
    }
  } else {  // two scales: chunks 4-7 (k 16..31) take the second
    for (int c = 0; c < 8; ++c) {
      V16 q[4];
      int8_rows(block + c * kChunk, q);
      const V16 sc = f.two_scales() && c >= 4 ? o : s;
      for (int i = 0; i < 4; ++i)
        w[4 * c + i] = f.with_offset ? v_fmav(o, q[i], s) : v_mul(q[i], sc);
    }
  }
}

}  // namespace pagedllm::gemm::q4
