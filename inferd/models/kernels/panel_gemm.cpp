// bfloat16 linear layers of a few dozen rows on a weight packed in VNNI panels:
//
//   inferd_gemm_bf16_panel  x [rows, x_stride] bf16, W packed [n_pad / 64][k / 2][64][2] bf16,
//                           b [n] bf16 or null  ->  y [rows, y_stride] bf16 (first n columns)
//
// Why: a decode step of 1-128 sequences multiplies that many rows by every weight of the model,
// once per step, the weights streaming from memory. Each thread here takes its own contiguous
// range of output columns (one sequential stream of weights per thread, which the hardware
// prefetcher follows) and multiplies every row of x against each block of it while it is in L2.
// 2 threads, bench/gemv_rows.py, bfloat16 (docs/benchmarks.md): over the Qwen2-0.5B shape's
// 0.99 GB of decode weights 30 ms at 1 row (33 GB/s, the memory's copy bandwidth; the GEMV 34 ms),
// 65 ms at 24 rows (364 GFLOP/s; oneDNN 77 ms), ~400 GFLOP/s from 48 rows (oneDNN's rate on
// 2048-row prefill batches; the CPU's VDPBF16PS peak is ~465); over llama-32m's 1.05-1.3x oneDNN
// at 16-128 rows and 1.1-1.2x the GEMV at 1-16.
//
// The block size is what made it that fast. With blocks of 16 KiB, in L1 across the row tiles,
// the first tile of each block waited on memory and the kernel ran at ~63 % of the peak (~290
// GFLOP/s at 24 rows; weights kept in L2, 86 %). With 128 KiB blocks the first tile pulls the
// block into L2 while the next tiles run from there, at L2's bandwidth, far above what a tile
// takes (256 bytes per 24 VDPBF16PS); the 24 accumulators stay in registers across 4x as many
// pairs. Software prefetch of the next block cost 3-10 % with L1 blocks and gained less than
// the larger block (a scratch variant, measured 2026-11-27).
//
// The packing (gemv.py's PanelWeight) interleaves pairs of input values: panel p holds output
// columns [64p, 64p + 64) as k / 2 steps of 64 x 2 values, column c's weights for inputs 2i and
// 2i + 1 side by side. One VDPBF16PS then takes a pair of x values (broadcast, 32 bits) against 16
// columns: no horizontal sums, unlike a dot product along k (gemv.cpp's few-row kernel). A tile
// is up to 6 rows x 64 columns (24 accumulators, 4 weight vectors, 1 broadcast); panels are walked
// in blocks of kBlockPairs input pairs (128 KiB of weights, in L2 across the row tiles), the
// tile's partial sums kept in a per-thread float32 buffer between blocks. Rows are split into tiles of
// near-equal size (32 rows: 5, 5, 6, 5, 5, 6) so no tile runs with a few rows. Sums are float32;
// y is rounded once to bfloat16 (to nearest even, as oneDNN rounds its accumulator).
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace {

constexpr int kPanel = 64;       // output columns per panel: 4 vectors of 16
constexpr int kBlockPairs = 512;  // input pairs per block: 512 x 64 x 2 bf16 = 128 KiB (in L2)
constexpr int kTileRows = 6;
constexpr int kMaxRows = 128;

#ifdef __AVX512BF16__
constexpr bool kHasPanel = true;

// acc[r][0, 64) (+)= x rows [0, R) . panel block of `pairs` input pairs.
template <int R>
inline void tile(const uint16_t* x, int64_t x_stride, const uint16_t* w, int pairs, float* acc,
                 bool first) {
  __m512 c[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v)
      c[r][v] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + r * kPanel + v * 16);
  for (int p = 0; p < pairs; ++p) {
    const uint16_t* wp = w + static_cast<int64_t>(p) * kPanel * 2;
    __m512bh wv[4];
    for (int v = 0; v < 4; ++v) wv[v] = (__m512bh)_mm512_load_si512(wp + v * 32);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * x_stride + 2 * p, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < 4; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], xb, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_store_ps(acc + r * kPanel + v * 16, c[r][v]);
}

inline void tile_rows(int rows, const uint16_t* x, int64_t x_stride, const uint16_t* w, int pairs,
                      float* acc, bool first) {
  switch (rows) {
    case 1: return tile<1>(x, x_stride, w, pairs, acc, first);
    case 2: return tile<2>(x, x_stride, w, pairs, acc, first);
    case 3: return tile<3>(x, x_stride, w, pairs, acc, first);
    case 4: return tile<4>(x, x_stride, w, pairs, acc, first);
    case 5: return tile<5>(x, x_stride, w, pairs, acc, first);
    default: return tile<6>(x, x_stride, w, pairs, acc, first);
  }
}

// y[:, 64p, 64p + 64) of every row: all of panel p's blocks, then rounding (and the bias).
void panel(const uint16_t* x, int rows, int64_t x_stride, const uint16_t* w, int64_t pairs,
           const uint16_t* bias, int64_t n, uint16_t* y, int64_t y_stride, int64_t p, float* acc) {
  const uint16_t* wp = w + p * pairs * kPanel * 2;
  const int tiles = (rows + kTileRows - 1) / kTileRows;
  for (int64_t i0 = 0; i0 < pairs; i0 += kBlockPairs) {
    const int np = static_cast<int>(std::min<int64_t>(kBlockPairs, pairs - i0));
    for (int t = 0, r0 = 0; t < tiles; ++t) {
      const int r1 = rows * (t + 1) / tiles;
      tile_rows(r1 - r0, x + r0 * x_stride + 2 * i0, x_stride, wp + i0 * kPanel * 2, np,
                acc + r0 * kPanel, i0 == 0);
      r0 = r1;
    }
  }
  const int64_t c0 = p * kPanel;
  const int cols = static_cast<int>(std::min<int64_t>(kPanel, n - c0));
  for (int v = 0; v * 16 < cols; ++v) {
    const __mmask16 m = tail_mask(cols - v * 16);
    const __m512 b = bias ? load16m(bias + c0 + v * 16, kBF16, m) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r)
      store16m(y + r * y_stride + c0 + v * 16,
               _mm512_add_ps(_mm512_load_ps(acc + r * kPanel + v * 16), b), kBF16, m);
  }
}

int gemm_panel(const uint16_t* x, int rows, int64_t x_stride, const uint16_t* w, int64_t n,
               int64_t k, const uint16_t* bias, uint16_t* y, int64_t y_stride) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t pairs = k / 2;
#pragma omp parallel if (panels > 1)
  {
    alignas(64) float acc[kMaxRows * kPanel];
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    // Contiguous ranges: one sequential stream of weights per thread.
    for (int64_t p = panels * t / nt; p < panels * (t + 1) / nt; ++p)
      panel(x, rows, x_stride, w, pairs, bias, n, y, y_stride, p, acc);
  }
  return 0;
}
#else
constexpr bool kHasPanel = false;

int gemm_panel(const uint16_t*, int, int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*,
               uint16_t*, int64_t) {
  return -1;
}
#endif

}  // namespace

extern "C" {

// Returns 0; -1 without AVX512_BF16, for rows outside [1, kMaxRows] or an odd k.
int inferd_gemm_bf16_panel(const void* x, int64_t rows, int64_t x_stride, const void* w,
                           int64_t n, int64_t k, const void* bias, void* y, int64_t y_stride) {
  if (!kHasPanel || rows < 1 || rows > kMaxRows || k % 2 != 0) return -1;
  return gemm_panel(static_cast<const uint16_t*>(x), static_cast<int>(rows), x_stride,
                    static_cast<const uint16_t*>(w), n, k, static_cast<const uint16_t*>(bias),
                    static_cast<uint16_t*>(y), y_stride);
}

// The most rows inferd_gemm_bf16_panel takes; 0 where the CPU has no AVX512_BF16.
int inferd_gemm_bf16_panel_rows() { return kHasPanel ? kMaxRows : 0; }

}  // extern "C"
