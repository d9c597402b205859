// The panel layout and the panel GEMM's sums on AVX-512 (panel_gemm.cpp's header has the design
// and its measurements): every CPU the native kernels build for runs it; bfloat16 needs
// AVX512_BF16, the greedy screen's int8 VNNI (which every build has: simd.h). On CPUs with AMX,
// x86/amx_panel.h runs the same panels on tiles and this loop takes the steps they leave.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../simd.h"

namespace {

constexpr int kPanel = 64;        // output columns per panel: 4 vectors of 16
constexpr int kBlockSteps = 512;  // steps per block: 512 x 256 bytes = 128 KiB (in L2)
constexpr int kTileRows = 6;
constexpr int kMaxRows = 128;

// One step of the packed weight is 256 bytes, 64 columns against 4 bytes of each row of x: a pair
// of bfloat16 inputs (VDPBF16PS), one float32 input (VFMADD) or four int8 ones (VPDPBUSD); each
// step type is that one instruction. `Acc` is the accumulators' register type: float32 sums for
// the float kernels, int32 for the int8 one.
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
// The greedy screen's int8 weights: x quantized to uint8, u8 x s8 summed into int32 lanes. The
// int32 sums are stored in the float buffers as bit patterns, never read as floats.
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
// run from L2 (panel_gemm.cpp's header says why): its `lines` cache lines spread over `tiles` x
// `steps` steps.
struct Prefetch {
  const char* next;  // null: none (a single tile, or the thread's last block)
  int lines;
  int tiles;
};

// Where the rows of x are: `stride` values apart from x (a GEMM's input), or each at its own
// address (IndexedRows: an MoE layer's rows read in place, in its experts' order). `at(r, c)`:
// row r's value c; `from(r0, c0)`: the rows from r0, values from c0.
template <class X>
struct StridedRows {
  const X* x;
  int64_t stride;
  const X* at(int r, int64_t c) const { return x + r * stride + c; }
  StridedRows from(int r0, int64_t c0) const { return {x + r0 * stride + c0, stride}; }
};
template <class X>
struct IndexedRows {
  const X* const* row;
  int64_t col;
  const X* at(int r, int64_t c) const { return row[r] + col + c; }
  IndexedRows from(int r0, int64_t c0) const { return {row + r0, col + c0}; }
};

// acc[r][0, 64) (+)= x rows [0, R) . `steps` steps of a panel; tile `t` of the block prefetches
// its share of the next.
template <class S, int R, class Rows>
inline void tile(const Rows& x, const typename S::W* w, int steps, float* acc, bool first,
                 const Prefetch& pf, int t) {
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
      std::memcpy(&bits, x.at(r, S::kInputsPerStep * p), sizeof(bits));
      const __m512i xb = _mm512_set1_epi32(bits);
      for (int v = 0; v < 4; ++v) c[r][v] = S::madd(c[r][v], xb, wv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) S::store(acc + r * kPanel + v * 16, c[r][v]);
}

template <class S, class Rows>
inline void tile_rows(int rows, const Rows& x, const typename S::W* w, int steps, float* acc,
                      bool first, const Prefetch& pf, int t) {
  switch (rows) {
    case 1: return tile<S, 1>(x, w, steps, acc, first, pf, t);
    case 2: return tile<S, 2>(x, w, steps, acc, first, pf, t);
    case 3: return tile<S, 3>(x, w, steps, acc, first, pf, t);
    case 4: return tile<S, 4>(x, w, steps, acc, first, pf, t);
    case 5: return tile<S, 5>(x, w, steps, acc, first, pf, t);
    default: return tile<S, 6>(x, w, steps, acc, first, pf, t);
  }
}

// acc[r][0, 64) = x rows [0, rows) (a StridedRows or IndexedRows) . panel p, over all of its
// blocks. `w_end`: the end of this thread's panels, where prefetching stops; `after`, where
// given: the panel (of as many steps) the thread runs next, elsewhere in memory, whose first
// block the last block prefetches.
template <class S, class Rows>
void panel_sums_of(const Rows& x, int rows, const typename S::W* w, int64_t steps, int64_t p,
                   float* acc, const typename S::W* w_end, const typename S::W* after) {
  constexpr int kStepValues = kPanel * S::kInputsPerStep;
  const typename S::W* wp = w + p * steps * kStepValues;
  const int tiles = (rows + kTileRows - 1) / kTileRows;
  for (int64_t i0 = 0; i0 < steps; i0 += kBlockSteps) {
    const int ns = static_cast<int>(std::min<int64_t>(kBlockSteps, steps - i0));
    const typename S::W* block = wp + i0 * kStepValues;
    // The next block is the next ns steps in memory (this panel's next block or the next
    // panel's first: a thread's panels are contiguous).
    const typename S::W* next = block + static_cast<int64_t>(ns) * kStepValues;
    int64_t left = (w_end - next) * static_cast<int64_t>(sizeof(*next)) / 64;
    if (after != nullptr && i0 + ns >= steps) {
      next = after;
      left = 4 * std::min<int64_t>(kBlockSteps, steps);
    }
    const Prefetch pf{tiles > 1 && left > 0 ? reinterpret_cast<const char*>(next) : nullptr,
                      static_cast<int>(std::min<int64_t>(4 * ns, left)), tiles};
    for (int t = 0, r0 = 0; t < tiles; ++t) {
      const int r1 = rows * (t + 1) / tiles;
      tile_rows<S>(r1 - r0, x.from(r0, S::kInputsPerStep * i0), block, ns, acc + r0 * kPanel,
                   i0 == 0, pf, t);
      r0 = r1;
    }
  }
}

// panel_sums_of on rows `x_stride` values apart.
template <class S>
void panel_sums(const typename S::X* x, int rows, int64_t x_stride, const typename S::W* w,
                int64_t steps, int64_t p, float* acc, const typename S::W* w_end,
                const typename S::W* after = nullptr) {
  panel_sums_of<S>(StridedRows<typename S::X>{x, x_stride}, rows, w, steps, p, acc, w_end, after);
}

// acc[r][0, 64) += x rows [0, rows) . steps [done, steps) of panel p: what the AMX tiles leave
// (steps past the last whole 16), on the AVX-512 tile.
template <class S>
void panel_tail_sums(const typename S::X* x, int rows, int64_t x_stride, const typename S::W* w,
                     int64_t steps, int64_t p, int64_t done, float* acc) {
  constexpr int kStepValues = kPanel * S::kInputsPerStep;
  const typename S::W* wp = w + p * steps * kStepValues;
  for (int r = 0; r < rows && done < steps; r += kTileRows)
    tile_rows<S>(std::min(kTileRows, rows - r),
                 StridedRows<typename S::X>{x, x_stride}.from(r, S::kInputsPerStep * done),
                 wp + done * kStepValues, static_cast<int>(steps - done), acc + r * kPanel, false,
                 Prefetch{nullptr, 0, 1}, 0);
}

}  // namespace
