// The panel GEMM's kernel (panel_gemm.cpp's header has the design and its measurements):
// shared by panel_gemm.cpp (the float GEMM) and greedy.cpp (the int8 screen over the same loop).
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
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
  static constexpr int kAmx = kAmxBF16;
  static constexpr int kAmxMinRows = 1;
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
  static constexpr int kAmx = kAmxNone;
  static constexpr int kAmxMinRows = 0;
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
  static constexpr int kAmx = kAmxI8;
  // Below this many rows the screen's int8 weights stream no faster on tiles: on the Qwen2-0.5B
  // shape's lm_head (bench/greedy_head.py) AMX took 1.06-1.28x the AVX-512 loop's time at 1-8
  // rows in a first run, 0.96x at 12 rows and 0.66-0.94x at 16-64 (docs/benchmarks.md).
  static constexpr int kAmxMinRows = 12;
  using W = int8_t;
  using X = uint8_t;
  using Acc = __m512i;
  static Acc zero() { return _mm512_setzero_si512(); }
  static Acc load(const float* p) { return _mm512_load_si512(p); }
  static void store(float* p, Acc c) { _mm512_store_si512(p, c); }
  static __m512i madd(__m512i c, __m512i x, __m512i w) { return dpbusd(c, x, w); }
};

// The next block's weights, fetched into L2 a share per step while the current block's tiles
// run from L2 (panel_gemm.cpp's header says why): its `lines` cache lines spread over `tiles` x
// `steps` steps.
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

// Chunks (16 steps, 4 KiB of weights) per segment when several row blocks share a panel.
constexpr int64_t kAmxSegmentChunks = 8;

// panel_sums on AMX tiles (amx.h), in blocks of min(rows, 16) rows, the last one ending at `rows`;
// the caller configured this thread's tiles for that block (amx_use). Steps past the last whole 16
// run on the AVX-512 tile.
// More than 16 rows take the panel in segments of kAmxSegmentChunks chunks (32 KiB, in L1), every
// block over a segment before the next (the sums stored and reloaded between segments, exactly),
// so the blocks after the first read their weight tiles from L1 rather than L2. Over the Qwen2-0.5B
// shape's bfloat16 layer weights (2 threads, an AMX Xeon; scratch A/B in one process) that took
// 17-32 rows 5-8 % faster, 48-64 rows 7-10 %, 128 rows 11-22 % (segments of 4 and 16 chunks were
// no better); one block (up to 16 rows) runs the whole panel in its tiles.
template <class S>
void panel_sums_amx(const typename S::X* x, int rows, int64_t x_stride, const typename S::W* w,
                    int64_t steps, int64_t p, float* acc) {
  constexpr int kStepValues = kPanel * S::kInputsPerStep;
  const typename S::W* wp = w + p * steps * kStepValues;
  const int64_t chunks = steps / 16, done = chunks * 16;
  const int64_t xs = x_stride * static_cast<int64_t>(sizeof(*x));
  const int64_t seg = rows > 16 ? kAmxSegmentChunks : chunks;
  // A last block that overlaps the one before keeps its sums apart between segments (the rows it
  // shares would otherwise take a segment twice) and adds its own rows at the end.
  alignas(64) float last[16 * kPanel];
  int last_b0 = -1, last_r0 = 0;
  for (int64_t c0 = 0; c0 < chunks; c0 += seg)
    amx_row_blocks(0, rows, [&](int r0, int b0) {
      float* out = acc + r0 * kPanel;
      if (r0 != b0 && seg < chunks) out = last, last_b0 = b0, last_r0 = r0;
      amx_block<S::kAmx>(x + r0 * x_stride, xs, wp, c0, std::min(chunks, c0 + seg), out,
                         c0 == 0);
    });
  if (last_b0 >= 0)
    std::memcpy(acc + last_b0 * kPanel, last + (last_b0 - last_r0) * kPanel,
                sizeof(float) * kPanel * (rows - last_b0));
  for (int r = 0; r < rows && done < steps; r += kTileRows)
    tile_rows<S>(std::min(kTileRows, rows - r), x + r * x_stride + S::kInputsPerStep * done,
                 x_stride, wp + done * kStepValues, static_cast<int>(steps - done),
                 acc + r * kPanel, false, Prefetch{nullptr, 0, 1}, 0);
}

// Whether this call's panel sums run on AMX (a step type it has, at least 16 steps, AMX on); if
// so, configures this thread's tiles for the call (amx_done releases them). Every thread of a
// parallel region gets the same answer.
template <class S>
inline bool amx_use(int rows, int64_t steps) {
  if (S::kAmx == kAmxNone || rows < S::kAmxMinRows || steps < 16 || !amx_on()) return false;
  amx_configure(std::min(rows, 16));
  return true;
}

inline void amx_done(bool used) {
  if (used) amx_release();
}

// Panel p's sums on tiles when `amx` (amx_use said so for this call), else on the AVX-512 loop.
template <class S>
inline void panel_sums_on(bool amx, const typename S::X* x, int rows, int64_t x_stride,
                          const typename S::W* w, int64_t steps, int64_t p, float* acc,
                          const typename S::W* w_end) {
  if (amx)
    panel_sums_amx<S>(x, rows, x_stride, w, steps, p, acc);
  else
    panel_sums<S>(x, rows, x_stride, w, steps, p, acc, w_end);
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
    const bool amx = amx_use<S>(rows, steps);
    for (int64_t p = p0; p < p1; ++p) {
      panel_sums_on<S>(amx, static_cast<const W*>(x), rows, x_stride, static_cast<const W*>(w),
                       steps, p, acc, w_end);
      store_panel<S>(acc, rows, static_cast<const W*>(bias), n, static_cast<W*>(y), y_stride, p);
    }
    amx_done(amx);
  }
  return 0;
}

inline int panel_rows(int dtype) {
  if (dtype == kF32) return kMaxRows;
  return dtype == kBF16 && kHasAVX512BF16 ? kMaxRows : 0;
}

}  // namespace
