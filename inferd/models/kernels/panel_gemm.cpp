// Linear layers of up to 128 rows on a weight packed in panels of 64 output columns:
//
//   inferd_gemm_panel  x [rows, x_stride], W packed, b [n] or null -> y [rows, y_stride] (first n
//                      columns), all of one dtype:
//     bfloat16  W [n_pad / 64][k / 2][64][2] (VNNI pairs), on AVX512_BF16;
//     float32   W [n_pad / 64][k][64].
// The kernel itself is in panel.h, its loops per instruction set under x86/ (for bfloat16 on CPUs
// with AMX, x86/amx_panel.h: the same panels on tiles; the AVX-512 numbers below are from an AMD
// Zen 4 without it); greedy.cpp runs the same loop over an int8 copy of an lm_head
// ([n_pad / 64][k / 4][64][4], VPDPBUSD) for the greedy screen (kernels/greedy.py has the design).
//
// Why: a decode step of 1-128 sequences multiplies that many rows by every weight of the model,
// once per step, the weights streaming from memory. Each thread here takes its own contiguous
// range of output columns (one sequential stream of weights per thread, which the hardware
// prefetcher follows) and multiplies every row of x against each block of it while it is in L2.
// 2 threads, bench/gemv_rows.py (docs/benchmarks.md), over the Qwen2-0.5B shape's decode weights:
//   bfloat16 (0.99 GB): 30 ms at 1 row (33 GB/s, the memory's copy bandwidth; a row-major GEMV
//     34 ms), 65 ms at 24 rows (364 GFLOP/s; oneDNN 77 ms), ~400 GFLOP/s from 48 rows (oneDNN's
//     rate on 2048-row prefill batches; the CPU's VDPBF16PS peak is ~465);
//   float32 (1.98 GB): 60 ms at 1 row (a row-major GEMV 67, oneDNN 85), 1.10-1.13x oneDNN at
//     16-64 rows (173-178 GFLOP/s; the FMA peak is ~230).
// Over llama-32m's it is 1.05-1.3x oneDNN at 16-128 rows and 1.1-1.5x a row-major GEMV at 1-16
// in both.
//
// The block size is what made it that fast. With blocks of 16 KiB, in L1 across the row tiles,
// the first tile of each block waited on memory and the kernel ran at ~63 % of the peak (~290
// GFLOP/s at 24 rows; weights kept in L2, 86 %). With 128 KiB blocks the first tile pulls the
// block into L2 while the next tiles run from there, at L2's bandwidth, far above what a tile
// takes (256 bytes per 24 multiply-adds); the 24 accumulators stay in registers across 8x as many
// steps. The first tile still reads its block from memory at a core's share of the bandwidth,
// slower than it computes, while the other tiles leave memory idle; so every tile of a block
// also prefetches (into L2) an equal share of the next block, a line every few steps: the
// memory traffic spreads over the whole block's time. 24 bfloat16 rows 58-63 ms instead of
// 63-67, 12-18 rows 9-20 % faster, no change from 48 rows (compute-bound) or at 1-6 rows (one
// tile: memory-bound, and no prefetch). A division per step to place those prefetches cost more
// than they gained on llama-32m's layers; the spread is an error counter (docs/benchmarks.md).
// Prefetching the next block during the first tile only, with 16 KiB blocks, cost 3-10 %.
//
// The packing (gemv.py's PanelWeight): panel p holds output columns [64p, 64p + 64) as steps of
// 256 bytes, one step 64 columns' weights for 4 bytes of x: bfloat16 k / 2 steps of 64 x 2 values,
// column c's weights for inputs 2i and 2i + 1 side by side, so one VDPBF16PS takes a pair of x
// values (broadcast, 32 bits) against 16 columns; float32 k steps of 64 values, one VFMADD per
// broadcast x value and 16 columns. No horizontal sums, unlike a dot product along k (gemv.cpp's
// few-row kernel). A tile is up to 6 rows x 64 columns (24 accumulators, 4 weight vectors, 1
// broadcast); panels are walked in blocks of kBlockSteps steps (128 KiB of weights, in L2 across
// the row tiles), the tile's partial sums kept in a per-thread float32 buffer between blocks.
// Rows are split into tiles of near-equal size (32 rows: 5, 5, 6, 5, 5, 6) so no tile runs with
// a few rows. Sums are float32; a bfloat16 y is rounded once (to nearest even, as oneDNN rounds
// its accumulator).
#include <atomic>
#include <cstdint>

#include "panel.h"

extern "C" {

// Returns 0; -1 for a dtype the CPU has no panel kernel for (bfloat16 without AVX512_BF16), rows
// outside [1, inferd_gemm_panel_rows(dtype)] or, for bfloat16, an odd k.
int inferd_gemm_panel(const void* x, int64_t rows, int64_t x_stride, const void* w, int64_t n,
                      int64_t k, const void* bias, void* y, int64_t y_stride, int dtype) {
  if (rows < 1 || rows > panel_rows(dtype)) return -1;
  const int r = static_cast<int>(rows);
  if (dtype == kF32) return gemm_panel<StepF32>(x, r, x_stride, w, n, k, bias, y, y_stride);
  if (k % 2 != 0) return -1;
  return gemm_panel<StepBF16>(x, r, x_stride, w, n, k, bias, y, y_stride);
}

int inferd_panel_amx(int on) {
  static std::atomic<int> want{1};
  if (on >= 0) want.store(on != 0);
  return want.load() && amx_permitted();
}

// The most rows inferd_gemm_panel takes for `dtype` (a DType code); 0 where it takes none.
int inferd_gemm_panel_rows(int dtype) { return panel_rows(dtype); }

}  // extern "C"
