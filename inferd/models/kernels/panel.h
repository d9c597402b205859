// The panel GEMM (panel_gemm.cpp's header has the design and its measurements): the op itself,
// shared by panel_gemm.cpp (the float GEMM) and greedy.cpp (the int8 screen over the same loop).
// The sums of a panel run per instruction set: x86/avx512_panel.h everywhere, x86/amx_panel.h on
// CPUs with AMX tiles; `PanelSums` chooses between them once per call, here and only here.
//
//   CPU class (instruction sets)           float32      bfloat16           int8 screen
//   AVX-512 + VNNI, no BF16 (Cascade Lake,  AVX-512 FMA  none (0 rows:     AVX-512 VNNI
//     Ice Lake)                                          oneDNN runs it)
//   + AVX512_BF16 (Zen 4/5, Cooper Lake)    AVX-512 FMA  VDPBF16PS         AVX-512 VNNI
//   + AMX (Sapphire Rapids and later)       AVX-512 FMA  tiles (steps past  tiles from 12 rows,
//                                                        the last 16: AVX)  else AVX-512
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"
#include "x86/amx_panel.h"
#include "x86/avx512_panel.h"

namespace {

// One thread's panel sums for one call: on AMX tiles where amx_use says so for this step type and
// row count (the tiles configured for the call, released when it ends), else on the AVX-512 loop.
// Every thread of a parallel region makes the same choice.
template <class S>
class PanelSums {
 public:
  PanelSums(int rows, int64_t steps) : amx_(amx_use<S>(rows, steps)) {}
  ~PanelSums() {
    if (amx_) amx_release();
  }
  PanelSums(const PanelSums&) = delete;
  PanelSums& operator=(const PanelSums&) = delete;

  // acc[r][0, 64) = x rows [0, rows) . panel p; `w_end`: the end of this thread's panels.
  void operator()(const typename S::X* x, int rows, int64_t x_stride, const typename S::W* w,
                  int64_t steps, int64_t p, float* acc, const typename S::W* w_end) const {
    if (amx_)
      panel_sums_amx<S>(x, rows, x_stride, w, steps, p, acc);
    else
      panel_sums<S>(x, rows, x_stride, w, steps, p, acc, w_end);
  }

 private:
  const bool amx_;
};

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
    const PanelSums<S> sums(rows, steps);
    for (int64_t p = p0; p < p1; ++p) {
      sums(static_cast<const W*>(x), rows, x_stride, static_cast<const W*>(w), steps, p, acc,
           w_end);
      store_panel<S>(acc, rows, static_cast<const W*>(bias), n, static_cast<W*>(y), y_stride, p);
    }
  }
  return 0;
}

inline int panel_rows(int dtype) {
  if (dtype == kF32) return kMaxRows;
  return dtype == kBF16 && kHasAVX512BF16 ? kMaxRows : 0;
}

}  // namespace
