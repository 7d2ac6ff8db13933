// The weight GEMM's AMX path (AVX512-BF16 builds, on processors with AMX-BF16): bf16 activations
// times bf16 or int8 weights with tile dot products (tdpbf16ps), float32 sums.
//
// Why: a batch of rows (prefill, or decode of many sequences) is bound by arithmetic, and one
// tdpbf16ps does 16 x 16 x 32 multiply-adds, 16x what vdpbf16ps does per instruction. oneDNN uses
// AMX for bf16 weights already, but int8 weight-only layers would fall far behind it (at 64 rows
// our vdpbf16ps path ran at a sixth of oneDNN's bf16); here int8 weights are converted to bf16
// (exact) once per K-block of a panel and fed to the same tiles, so int8 keeps its halved weight
// stream without losing the tiles.
//
// AMX is a run-time property, not only a compile-time one: Linux hands out the tile state only
// after a process asks for it (arch_prctl ARCH_REQ_XCOMP_PERM). So this path lives inside the
// avx512bf16 build (compiled with a target pragma) and is used only when available() says the
// processor reports AMX-BF16 and the kernel granted the permission.
#pragma once

#include <cstdint>
#include <vector>

namespace pagedllm::gemm::amx {

// Rows of bf16 x from which the tiles are used. A tile always computes 16 rows; with fewer real
// rows the vdpbf16ps path, which streams the weights with no padding, ran as fast or faster
// (measured on a 2048 x 16384 layer: faster at 2 rows, equal at 4, slower from 8).
constexpr int64_t kMinRows = 6;
// W8A8 rows from which the int8 tiles beat VNNI's vpdpbusd (measured: equal at 1-2 rows).
constexpr int64_t kMinRowsInt8 = 3;

// Whether the processor has AMX-BF16 and this process may use the tiles (asked once).
bool available();
// Whether the processor has AMX-INT8 (tdpbssd, for W8A8) and the tiles are granted.
bool int8_available();

// y[M, N] (bf16) = x[M, K] (bf16, K % 32 == 0) @ panels[ceil(N/16)][K][16] (bf16 or int8)
// (* scale[N]) (+ bias[N]). weight_is_int8 selects the panels' element type.
void gemm(const uint16_t* x, int64_t m, int64_t k, const void* panels, bool weight_is_int8,
          int64_t n, const float* scale, const float* bias, uint16_t* y);

// W8A8 on AMX-INT8, in pieces gemm_i8.cpp's panel loop calls. The packed weights' layout
// [N/16][K/4][16][4] is already the B-tile layout (16 groups of 4 k per tile), so nothing is
// converted; only x's int8 rows are copied into A-tile order once per call (pack_int8_rows:
// [ceil(M/16)][row_bytes/64][16][64], zero rows past M; row_bytes a multiple of 64). Signed by
// signed products summed exactly in int32: the same sums as the VNNI and AVX2 paths.
std::vector<uint8_t> pack_int8_rows(const int8_t* qx, int64_t m, int64_t row_bytes);
// Tile configuration is per thread: around each thread's panels.
void begin_tiles();
void end_tiles();
// acc0 [m_tiles * 16][16] int32 = packed rows xa @ panel0 of `groups` groups (groups % 16 == 0),
// and acc1 = xa @ panel1 unless panel1 is null: two panels at a time share the loads of x's tiles.
void panels_int8(const uint8_t* xa, int64_t m_tiles, int64_t groups, const int8_t* panel0,
                 const int8_t* panel1, int32_t* acc0, int32_t* acc1);

// Group-wise weights (gemm_q4.cpp's bf16 path) on the tiles. A group's 32 k are one A tile of x
// and one B tile of its q as bf16 (exact: gemm_q4_float.h's bf16_block pair rows), so each
// tile product is one group's float32 sums for 16 rows and 16 columns; they are scaled (and
// offset) per group in vector registers, as the vdpbf16ps path does, so only the float32
// summation differs from the definition there too. Two-scale groups (Q6_K, Q3_K) take two
// half products of 16 k. Rows of bf16 x from which this beats vdpbf16ps (a tile costs the same
// for 1-16 rows; measured on a Xeon on a 2048 x 16384 Q4_0 layer: vdpbf16ps 0.94 / 1.53 / 2.74
// ms at 2 / 4 / 8 rows, tiles 1.17 ms at 9 and 1.53 at 16; a 1B Q4_0 decode step: 82 ms at 4
// rows on vdpbf16ps, 70 ms at 8 on tiles):
constexpr int64_t kMinGroupRows = 4;
// x [M, K] bf16 -> A-tile order, a tile per 16 rows and group (zero rows past M).
std::vector<uint8_t> pack_bf16_rows(const uint16_t* x, int64_t m, int64_t k);
// Tile configuration for panel_groups, per thread: halves for two-scale groups; tiles of 4 or 8
// rows for batches of up to 4 or 8 rows (m), else 16.
void begin_group_tiles(bool halves, int64_t m);
// acc[M][16] += for g in [0, gc): (x's group g0 + g @ pairs[g]) * so[g][0:16] (two-scale: sums
// of k 0..15 by so[g][0:16], 16..31 by so[g][16:32]) + so[g][16:32] * xs[row][g0 + g] where
// offsets. pairs [gc][16][32] bf16 and so [gc][32] float32 as bf16_block makes them; xa from
// pack_bf16_rows (groups_total groups per row). acc and xs ([rows][groups_total]) hold whole
// tiles of 16 rows: ceil(M / 16) * 16 (rows past M zero in xs, ignored in acc).
void panel_groups(const uint8_t* xa, int64_t m, int64_t groups_total, int64_t g0,
                  const uint16_t* pairs, const float* so, int64_t gc, bool offsets, bool halves,
                  const float* xs, float* acc);

}  // namespace pagedllm::gemm::amx
