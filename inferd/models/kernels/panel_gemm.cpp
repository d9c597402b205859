// Linear layers of up to 128 rows on a weight packed in panels of 64 output columns:
//
//   inferd_gemm_panel  x [rows, x_stride], W packed, b [n] or null -> y [rows, y_stride] (first n
//                      columns), all of one dtype:
//     bfloat16  W [n_pad / 64][k / 2][64][2] (VNNI pairs), on AVX512_BF16;
//     float32   W [n_pad / 64][k][64].
//   inferd_greedy_screen  the same loop over an int8 copy of an lm_head, [n_pad / 64][k / 4][64][4]
//                      (VPDPBUSD), on x quantized to uint8: the columns whose exact logit can be a
//                      row's largest, from error bounds (kernels/greedy.py has the design).
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

constexpr int kPanel = 64;        // output columns per panel: 4 vectors of 16
constexpr int kBlockSteps = 512;  // steps per block: 512 x 256 bytes = 128 KiB (in L2)
constexpr int kTileRows = 6;
constexpr int kMaxRows = 128;

// One step of the packed weight is 256 bytes, 64 columns against 4 bytes of each row of x: a pair
// of bfloat16 inputs (VDPBF16PS) or one float32 input (VFMADD). Everything else is shared.
// `Acc` is the accumulators' register type: float32 sums for the float kernels, int32 for the
// int8 one.
struct FloatAcc {
  using Acc = __m512;
  static Acc zero() { return _mm512_setzero_ps(); }
  static Acc load(const float* p) { return _mm512_load_ps(p); }
  static void store(float* p, Acc c) { _mm512_store_ps(p, c); }
};
struct StepBF16 : FloatAcc {
  static constexpr int kInputsPerStep = 2;
  using W = uint16_t;
  using X = uint16_t;
  static __m512 madd(__m512 c, __m512i x, __m512i w) {
#ifdef __AVX512BF16__
    return _mm512_dpbf16_ps(c, (__m512bh)x, (__m512bh)w);
#else
    (void)x, (void)w;
    return c;  // not reached: inferd_gemm_panel refuses bfloat16 without AVX512_BF16
#endif
  }
};
struct StepF32 : FloatAcc {
  static constexpr int kInputsPerStep = 1;
  using W = float;
  using X = float;
  static __m512 madd(__m512 c, __m512i x, __m512i w) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_castsi512_ps(w), c);
  }
};
// The greedy screen's int8 weights: 4 inputs a step, x quantized to uint8, VPDPBUSD (u8 x s8
// summed into int32 lanes). The int32 sums are stored in the float buffers as bit patterns,
// never read as floats.
struct StepI8 {
  static constexpr int kInputsPerStep = 4;
  using W = int8_t;
  using X = uint8_t;
  using Acc = __m512i;
  static Acc zero() { return _mm512_setzero_si512(); }
  static Acc load(const float* p) { return _mm512_load_si512(p); }
  static void store(float* p, Acc c) { _mm512_store_si512(p, c); }
  static __m512i madd(__m512i c, __m512i x, __m512i w) { return dpbusd(c, x, w); }
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
inline void tile(const typename S::X* x, int64_t x_stride, const typename S::W* w, int steps,
                 float* acc, bool first, const Prefetch& pf, int t) {
  constexpr int kStepValues = kPanel * S::kInputsPerStep;  // weight values per step
  typename S::Acc c[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) c[r][v] = first ? S::zero() : S::load(acc + r * kPanel + v * 16);
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
    for (int v = 0; v < 4; ++v) S::store(acc + r * kPanel + v * 16, c[r][v]);
}

template <class S>
inline void tile_rows(int rows, const typename S::X* x, int64_t x_stride, const typename S::W* w,
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

// acc[r][0, 64) = x rows [0, rows) . panel p, over all of its blocks. `w_end`: the end of this
// thread's panels, where prefetching stops.
template <class S>
void panel_sums(const typename S::X* x, int rows, int64_t x_stride, const typename S::W* w,
                int64_t steps, int64_t p, float* acc, const typename S::W* w_end) {
  constexpr int kStepValues = kPanel * S::kInputsPerStep;
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
}

// y[:, 64p, 64p + 64) of every row from panel p's sums: the bias added (and rounded).
template <class S>
void store_panel(const float* acc, int rows, const typename S::W* bias, int64_t n,
                 typename S::W* y, int64_t y_stride, int64_t p) {
  constexpr int dtype = S::kInputsPerStep == 2 ? kBF16 : kF32;
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
    for (int64_t p = p0; p < p1; ++p) {
      panel_sums<S>(static_cast<const W*>(x), rows, x_stride, static_cast<const W*>(w), steps, p,
                    acc, w_end);
      store_panel<S>(acc, rows, static_cast<const W*>(bias), n, static_cast<W*>(y), y_stride, p);
    }
  }
  return 0;
}

// ---- the greedy screen ------------------------------------------------------------------------
// See the header of kernels/greedy.py for the bound and why it is exact.

// x's rows quantized to uint8 (quantize_u8: x ~ s (u - z) + e) and the norms the bound needs.
struct ScreenRows {
  const uint8_t* u;  // [rows][stride]
  int64_t stride;
  float s[kMaxRows];
  int32_t z[kMaxRows];
  float nx[kMaxRows];  // ||x||_2, rounded up
  float ne[kMaxRows];  // ||e||_2, rounded up
};

// Per output column of the int8 weight (W ~ scale * q + d): scale, the sum of q, ||W||_2, ||d||_2.
struct ScreenCols {
  const float* scale;
  const int32_t* sum;
  const float* norm_w;
  const float* norm_d;
};

struct Hit {
  int32_t row;
  int32_t col;
  float hi;
};

// The least exact logit a row's winner can have when m is its largest lower bound: m less the
// rounding of the logits (`rel`: bfloat16's relative spacing, twice over; float32 logits are not
// rounded) and an absolute floor for values near 0.
inline float threshold(float m, float rel) { return m - std::fabs(m) * rel - 1e-30f; }

// Rounds a non-negative double up to a float that is not below it.
inline float up(double v) {
  const float f = static_cast<float>(v);
  return static_cast<double>(f) >= v ? f : std::nextafter(f, INFINITY);
}

// Quantizes every row; -2 if a value is not finite.
int screen_rows(const void* x, int rows, int64_t x_stride, int dtype, int64_t k, uint8_t* u,
                int64_t stride, ScreenRows& xr) {
  const int64_t esz = dtype == kF32 ? 4 : 2;
  for (int r = 0; r < rows; ++r) {
    const char* xrow = static_cast<const char*>(x) + r * x_stride * esz;
    uint8_t* ur = u + r * stride;
    quantize_u8(xrow, dtype, k, stride, ur, &xr.s[r], &xr.z[r]);
    double nx2 = 0.0, ne2 = 0.0;
    for (int64_t i = 0; i < k; ++i) {
      float xi;
      if (dtype == kF32) {
        std::memcpy(&xi, xrow + 4 * i, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, xrow + 2 * i, 2);
        const uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(&xi, &bits, 4);
      }
      const double e = xi - static_cast<double>(xr.s[r]) * (ur[i] - xr.z[r]);  // exact
      nx2 += static_cast<double>(xi) * xi;
      ne2 += e * e;
    }
    if (!std::isfinite(nx2) || !std::isfinite(ne2)) return -2;
    // sqrt of a double sum of squares: relative error ~1e-16 x k, far inside the 2^-10 margin.
    xr.nx[r] = up(std::sqrt(nx2));
    xr.ne[r] = up(std::sqrt(ne2));
  }
  return 0;
}

// Panel p's bounds for every row: lo = A - eps raises the row's running largest lower bound,
// columns whose hi = A + eps reaches the threshold of it are kept. A thread's running maximum is
// at most the final one, so every column that passes the final threshold is kept here.
void screen_panel(const float* acc, int rows, const ScreenRows& xr, const ScreenCols& cols,
                  int64_t n, int64_t p, float kslack, float rel, float* row_max,
                  std::vector<Hit>& hits) {
  const int64_t c0 = p * kPanel;
  const int ncols = static_cast<int>(std::min<int64_t>(kPanel, n - c0));
  const __m512 margin = _mm512_set1_ps(1.0f + 0x1p-10f), rel_a = _mm512_set1_ps(0x1p-16f),
               tiny = _mm512_set1_ps(1e-30f), ks = _mm512_set1_ps(kslack);
  __mmask16 valid[4];
  for (int v = 0; v < 4; ++v) valid[v] = ncols > 16 * v ? tail_mask(ncols - 16 * v) : 0;
  for (int r = 0; r < rows; ++r) {
    const __m512 sx = _mm512_set1_ps(xr.s[r]), nx = _mm512_set1_ps(xr.nx[r]),
                 ne = _mm512_set1_ps(xr.ne[r]);
    const __m512i z = _mm512_set1_epi32(xr.z[r]);
    __m512 hi[4], lo_max = _mm512_set1_ps(-INFINITY);
    for (int v = 0; v < 4; ++v) {
      const __mmask16 m = valid[v];
      const int64_t c = c0 + 16 * v;
      const __m512 sw = _mm512_maskz_loadu_ps(m, cols.scale + c);
      const __m512 nw = _mm512_maskz_loadu_ps(m, cols.norm_w + c);
      const __m512 nd = _mm512_maskz_loadu_ps(m, cols.norm_d + c);
      const __m512i sum = _mm512_maskz_loadu_epi32(m, cols.sum + c);
      const __m512i raw = _mm512_castps_si512(_mm512_load_ps(acc + r * kPanel + 16 * v));
      const __m512i dot = _mm512_sub_epi32(raw, _mm512_mullo_epi32(z, sum));
      const __m512 a = _mm512_mul_ps(_mm512_mul_ps(sx, sw), _mm512_cvtepi32_ps(dot));
      // |x.w - A| <= |x| |d| + |e| |w| + |e| |d|, and the exact path's float32 sums add at most
      // kslack |x| |w|.
      __m512 eps = _mm512_fmadd_ps(nx, nd, _mm512_mul_ps(ne, nw));
      eps = _mm512_fmadd_ps(ne, nd, eps);
      eps = _mm512_fmadd_ps(_mm512_mul_ps(ks, nx), nw, eps);
      eps = _mm512_fmadd_ps(eps, margin, _mm512_fmadd_ps(_mm512_abs_ps(a), rel_a, tiny));
      hi[v] = _mm512_add_ps(a, eps);
      lo_max = _mm512_mask_max_ps(lo_max, m, lo_max, _mm512_sub_ps(a, eps));
    }
    row_max[r] = std::max(row_max[r], _mm512_reduce_max_ps(lo_max));
    const __m512 thr = _mm512_set1_ps(threshold(row_max[r], rel));
    for (int v = 0; v < 4; ++v) {
      uint32_t keep = _mm512_mask_cmp_ps_mask(valid[v], hi[v], thr, _CMP_GE_OQ);
      alignas(64) float h[16];
      if (keep) _mm512_store_ps(h, hi[v]);
      for (; keep; keep &= keep - 1) {
        const int j = __builtin_ctz(keep);
        hits.push_back({r, static_cast<int32_t>(c0 + 16 * v + j), h[j]});
      }
    }
  }
}

int64_t greedy_screen(const ScreenRows& xr, int rows, const int8_t* w, const ScreenCols& cols,
                      int64_t n, int64_t k, float rel, int32_t* cand, int64_t max_cand) {
  const int64_t panels = (n + kPanel - 1) / kPanel, steps = k / 4;
  const float kslack = 2.0f * static_cast<float>(k) * 0x1p-24f;
  const int nt_max = omp_get_max_threads();
  std::vector<float> maxes(static_cast<size_t>(nt_max) * rows, -INFINITY);
  std::vector<std::vector<Hit>> hits(nt_max);
#pragma omp parallel if (panels > 1)
  {
    alignas(64) float acc[kMaxRows * kPanel];
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
    const int8_t* w_end = w + p1 * steps * kPanel * 4;
    for (int64_t p = p0; p < p1; ++p) {
      panel_sums<StepI8>(xr.u, rows, xr.stride, w, steps, p, acc, w_end);
      screen_panel(acc, rows, xr, cols, n, p, kslack, rel, &maxes[t * rows], hits[t]);
    }
  }
  float thr[kMaxRows];
  for (int r = 0; r < rows; ++r) {
    float m = -INFINITY;
    for (int t = 0; t < nt_max; ++t) m = std::max(m, maxes[t * rows + r]);
    thr[r] = threshold(m, rel);
  }
  std::vector<uint8_t> mark(static_cast<size_t>(n), 0);
  for (const auto& th : hits)
    for (const Hit& h : th)
      if (h.hi >= thr[h.row]) mark[h.col] = 1;
  int64_t count = 0;
  for (int64_t c = 0; c < n; ++c) {
    if (!mark[c]) continue;
    if (count == max_cand) return -3;
    cand[count++] = static_cast<int32_t>(c);
  }
  return count;
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

// The columns of an lm_head whose exact logit can be a row's largest (ascending), from the int8
// screen: x [rows, x_stride] float32 or bfloat16 (the lm_head's input rows), w its int8 copy in
// panels [n_pad / 64][k / 4][64][4] with the per-column scale, sum, ||W||_2 and ||d||_2 (n_pad
// each), `bf16_logits` whether the exact logits are rounded to bfloat16. Returns how many were
// written to `cand`; -1 for bad arguments (rows outside [1, 128], k not a multiple of 4), -2 for a
// value of x that is not finite, -3 for more than `max_cand` (the caller runs the whole lm_head).
int64_t inferd_greedy_screen(const void* x, int64_t rows, int64_t x_stride, int dtype,
                             const int8_t* w, int64_t n, int64_t k, const float* scale,
                             const int32_t* sum, const float* norm_w, const float* norm_d,
                             int bf16_logits, int32_t* cand, int64_t max_cand) {
  if (rows < 1 || rows > kMaxRows || k % 4 != 0 || (dtype != kF32 && dtype != kBF16)) return -1;
  const int r = static_cast<int>(rows);
  const int64_t stride = (k + 63) / 64 * 64;
  thread_local std::vector<uint8_t> buf;  // the quantized rows, reused across calls
  buf.resize(static_cast<size_t>(rows * stride));
  ScreenRows xr{buf.data(), stride, {}, {}, {}, {}};
  if (screen_rows(x, r, x_stride, dtype, k, buf.data(), stride, xr) != 0) return -2;
  const float rel = bf16_logits ? 0x1p-6f : 0x1p-20f;
  return greedy_screen(xr, r, w, ScreenCols{scale, sum, norm_w, norm_d}, n, k, rel, cand,
                       max_cand);
}

// The most rows inferd_gemm_panel takes for `dtype` (a DType code); 0 where it takes none.
int inferd_gemm_panel_rows(int dtype) { return panel_rows(dtype); }

}  // extern "C"
