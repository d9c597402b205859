// Linear layers of up to 128 rows on a weight packed in panels of 64 output columns:
//
//   inferd_gemm_panel  x [rows, x_stride], W packed, b [n] or null -> y [rows, y_stride] (first n
//                      columns), all of one dtype:
//     bfloat16  W [n_pad / 64][k / 2][64][2] (VNNI pairs), on AVX512_BF16;
//     float32   W [n_pad / 64][k][64].
//
// Why: a decode step of 1-128 sequences multiplies that many rows by every weight of the model,
// once per step, the weights streaming from memory. Each thread here takes its own contiguous
// range of output columns (one sequential stream of weights per thread, which the hardware
// prefetcher follows) and multiplies every row of x against each block of it while it is in L2.
// 2 threads, bench/gemv_rows.py (docs/benchmarks.md), over the Qwen2-0.5B shape's decode weights:
//   bfloat16 (0.99 GB): 30 ms at 1 row (33 GB/s, the memory's copy bandwidth; the GEMV 34 ms),
//     65 ms at 24 rows (364 GFLOP/s; oneDNN 77 ms), ~400 GFLOP/s from 48 rows (oneDNN's rate on
//     2048-row prefill batches; the CPU's VDPBF16PS peak is ~465);
//   float32 (1.98 GB): 60 ms at 1 row (the GEMV 67, oneDNN 85), 1.10-1.13x oneDNN at 16-64 rows
//     (173-178 GFLOP/s; the FMA peak is ~230).
// Over llama-32m's it is 1.05-1.3x oneDNN at 16-128 rows and 1.1-1.5x the GEMV at 1-16 in both.
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
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace {

constexpr int kPanel = 64;        // output columns per panel: 4 vectors of 16
constexpr int kBlockSteps = 512;  // steps per block: 512 x 256 bytes = 128 KiB (in L2)
constexpr int kTileRows = 6;
constexpr int kMaxRows = 128;

// One step of the packed weight is 256 bytes, 64 columns against 4 bytes of each row of x: a pair
// of bfloat16 inputs (VDPBF16PS) or one float32 input (VFMADD). Everything else is shared.
struct StepBF16 {
  static constexpr int kInputsPerStep = 2;
  using W = uint16_t;
  static __m512 madd(__m512 c, __m512i x, __m512i w) {
#ifdef __AVX512BF16__
    return _mm512_dpbf16_ps(c, (__m512bh)x, (__m512bh)w);
#else
    (void)x, (void)w;
    return c;  // not reached: inferd_gemm_panel refuses bfloat16 without AVX512_BF16
#endif
  }
};
struct StepF32 {
  static constexpr int kInputsPerStep = 1;
  using W = float;
  static __m512 madd(__m512 c, __m512i x, __m512i w) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(w), c);
  }
};

// The next block's weights, fetched into L2 a share per step while the current block's tiles
// run from L2 (see the header): its `lines` cache lines spread over `tiles` x `steps` steps.
struct Prefetch {
  const char* next;  // null: none (a single tile, or the thread's last block)
  int lines;
  int tiles;
};

// acc[r][0, 64) (+)= x rows [0, R) . `steps` steps of a panel; tile `t` of the block prefetches
// its share of the next.
template <class S, int R>
inline void tile(const typename S::W* x, int64_t x_stride, const typename S::W* w, int steps,
                 float* acc, bool first, const Prefetch& pf, int t) {
  constexpr int kStepValues = kPanel * S::kInputsPerStep;  // weight values per step
  __m512 c[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v)
      c[r][v] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + r * kPanel + v * 16);
  // Tile t of the block prefetches lines [line, end) of the next, `share` of them.
  int line = 0, end = 0, share = 0, err = 0;
  if (pf.next != nullptr) {
    line = pf.lines * t / pf.tiles;
    end = pf.lines * (t + 1) / pf.tiles;
    share = end - line;
  }
  for (int p = 0; p < steps; ++p) {
    const typename S::W* wp = w + static_cast<int64_t>(p) * kStepValues;
    // Spread the tile's share of lines evenly over its steps (integer steps of a line count,
    // Bresenham-style: no division in the loop).
    for (err += share; err >= steps && line < end; err -= steps)
      _mm_prefetch(pf.next + 64 * static_cast<int64_t>(line++), _MM_HINT_T1);
    __m512i wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = _mm512_load_si512(wp + v * kStepValues / 4);
    for (int r = 0; r < R; ++r) {
      int32_t bits;
      std::memcpy(&bits, x + r * x_stride + S::kInputsPerStep * p, sizeof(bits));
      const __m512i xb = _mm512_set1_epi32(bits);
      for (int v = 0; v < 4; ++v) c[r][v] = S::madd(c[r][v], xb, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_store_ps(acc + r * kPanel + v * 16, c[r][v]);
}

template <class S>
inline void tile_rows(int rows, const typename S::W* x, int64_t x_stride, const typename S::W* w,
                      int steps, float* acc, bool first, const Prefetch& pf, int t) {
  switch (rows) {
    case 1: return tile<S, 1>(x, x_stride, w, steps, acc, first, pf, t);
    case 2: return tile<S, 2>(x, x_stride, w, steps, acc, first, pf, t);
    case 3: return tile<S, 3>(x, x_stride, w, steps, acc, first, pf, t);
    case 4: return tile<S, 4>(x, x_stride, w, steps, acc, first, pf, t);
    case 5: return tile<S, 5>(x, x_stride, w, steps, acc, first, pf, t);
    default: return tile<S, 6>(x, x_stride, w, steps, acc, first, pf, t);
  }
}

// y[:, 64p, 64p + 64) of every row: all of panel p's blocks, then the bias (and rounding).
// `w_end`: the end of this thread's panels, where prefetching stops.
template <class S>
void panel(const typename S::W* x, int rows, int64_t x_stride, const typename S::W* w,
           int64_t steps, const typename S::W* bias, int64_t n, typename S::W* y,
           int64_t y_stride, int64_t p, float* acc, const typename S::W* w_end) {
  constexpr int kStepValues = kPanel * S::kInputsPerStep;
  constexpr int dtype = S::kInputsPerStep == 2 ? kBF16 : kF32;
  const typename S::W* wp = w + p * steps * kStepValues;
  const int tiles = (rows + kTileRows - 1) / kTileRows;
  for (int64_t i0 = 0; i0 < steps; i0 += kBlockSteps) {
    const int ns = static_cast<int>(std::min<int64_t>(kBlockSteps, steps - i0));
    const typename S::W* block = wp + i0 * kStepValues;
    // The next block is the next ns steps in memory (this panel's next block or the next
    // panel's first: a thread's panels are contiguous).
    const typename S::W* next = block + static_cast<int64_t>(ns) * kStepValues;
    const int64_t left = (w_end - next) * static_cast<int64_t>(sizeof(*next)) / 64;
    const Prefetch pf{tiles > 1 && left > 0 ? reinterpret_cast<const char*>(next) : nullptr,
                      static_cast<int>(std::min<int64_t>(4 * ns, left)), tiles};
    for (int t = 0, r0 = 0; t < tiles; ++t) {
      const int r1 = rows * (t + 1) / tiles;
      tile_rows<S>(r1 - r0, x + r0 * x_stride + S::kInputsPerStep * i0, x_stride, block, ns,
                   acc + r0 * kPanel, i0 == 0, pf, t);
      r0 = r1;
    }
  }
  const int64_t c0 = p * kPanel;
  const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - c0));
  for (int v = 0; v * 16 < cols; ++v) {
    const __mmask16 m = tail_mask(cols - v * 16);
    const __m512 b = bias ? load16m(bias + c0 + v * 16, dtype, m) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r)
      store16m(y + r * y_stride + c0 + v * 16,
               _mm512_add_ps(_mm512_load_ps(acc + r * kPanel + v * 16), b), dtype, m);
  }
}

template <class S>
int gemm_panel(const void* x, int rows, int64_t x_stride, const void* w, int64_t n, int64_t k,
               const void* bias, void* y, int64_t y_stride) {
  using W = typename S::W;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t steps = k / S::kInputsPerStep;
#pragma omp parallel if (panels > 1)
  {
    alignas(64) float acc[kMaxRows * kPanel];
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    // Contiguous ranges: one sequential stream of weights per thread.
    const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
    const W* w_end = static_cast<const W*>(w) + p1 * steps * kPanel * S::kInputsPerStep;
    for (int64_t p = p0; p < p1; ++p)
      panel<S>(static_cast<const W*>(x), rows, x_stride, static_cast<const W*>(w), steps,
               static_cast<const W*>(bias), n, static_cast<W*>(y), y_stride, p, acc, w_end);
  }
  return 0;
}

int panel_rows(int dtype) {
  if (dtype == kF32) return kMaxRows;
  return dtype == kBF16 && kHasAVX512BF16 ? kMaxRows : 0;
}

}  // namespace

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

// The most rows inferd_gemm_panel takes for `dtype` (a DType code); 0 where it takes none.
int inferd_gemm_panel_rows(int dtype) { return panel_rows(dtype); }

}  // extern "C"
