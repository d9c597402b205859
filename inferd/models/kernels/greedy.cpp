// The greedy screen of an lm_head (kernels/greedy.py has the design and why it is exact): the
// panel GEMM's loop (panel.h) over an int8 copy of the lm_head, on x quantized to uint8.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "panel.h"

namespace {

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
    const PanelSums<StepI8> sums(rows, steps);
    for (int64_t p = p0; p < p1; ++p) {
      sums(xr.u, rows, xr.stride, w, steps, p, acc, w_end);
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

// ---- the greedy head: the candidates' exact logits and their argmax ----------------------------

// Candidate columns packed and multiplied at a time: bounds the scratch (7 MiB of a float32 lm_head
// of 896 inputs) however many candidates a batch has.
constexpr int64_t kChunkColumns = 2048;

// 64-byte-aligned scratch that grows to the largest size asked of it (null if it cannot).
struct Scratch {
  void* p = nullptr;
  size_t cap = 0;
  void* get(size_t bytes) {
    if (bytes > cap) {
      std::free(p);
      cap = (bytes + 4095) / 4096 * 4096;
      p = std::aligned_alloc(64, cap);
      if (p == nullptr) cap = 0;
    }
    return p;
  }
  ~Scratch() { std::free(p); }
};

// Output columns `cols` of a weight of `words` 32-bit words a column (a float32 input, or a pair
// of bfloat16 ones) packed as the panel GEMM reads them, [ceil(ncols / 64)][words][64], zero past
// ncols: from the row-major weight ([n][words], 16 columns x 16 words at a time transposed in
// registers) or from its panel copy (`from_panels`, [n_pad / 64][words][64]: a word at a time,
// a cache line a value). The GEMM then sums each column as it sums it in the whole lm_head.
void pack_columns(const uint32_t* src, bool from_panels, int64_t words, const int32_t* cols,
                  int64_t ncols, uint32_t* out) {
  const int64_t panels = (ncols + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) if (panels > 1)
  for (int64_t q = 0; q < panels; ++q) {
    uint32_t* o = out + q * words * kPanel;
    for (int g = 0; g < kPanel / 16; ++g) {
      const int64_t c0 = q * kPanel + g * 16;
      const int live = static_cast<int>(std::clamp<int64_t>(ncols - c0, 0, 16));
      if (from_panels) {
        for (int64_t s = 0; s < words; ++s)
          for (int j = 0; j < 16; ++j) {
            const int64_t c = j < live ? cols[c0 + j] : -1;
            o[s * kPanel + g * 16 + j] =
                c < 0 ? 0u : src[((c / kPanel) * words + s) * kPanel + c % kPanel];
          }
        continue;
      }
      for (int64_t s0 = 0; s0 < words; s0 += 16) {
        const __mmask16 m = tail_mask(words - s0);
        __m512 r[16];
        for (int j = 0; j < 16; ++j)
          r[j] = j < live ? _mm512_maskz_loadu_ps(m, src + cols[c0 + j] * words + s0)
                          : _mm512_setzero_ps();
        transpose16(r);
        for (int s = 0; s < 16 && s0 + s < words; ++s)
          _mm512_store_ps(reinterpret_cast<float*>(o + (s0 + s) * kPanel + g * 16), r[s]);
      }
    }
  }
}

// The value of row r's entry i of y [rows][stride] (float32 or bfloat16) as a float.
inline float value_at(const void* y, int dtype, int64_t stride, int64_t r, int64_t i) {
  return _mm512_cvtss_f32(load16m(static_cast<const char*>(y) +
                                      (r * stride + i) * dtype_size(dtype), dtype, 1));
}

}  // namespace

extern "C" {

int inferd_argmax(const void* x, int dtype, int64_t rows, int64_t n, int64_t stride,
                  int64_t* out);  // fused_ops.cpp

// The columns of an lm_head whose exact logit can be a row's largest (ascending), from the int8
// screen: x [rows, x_stride] float32 or bfloat16 (the lm_head's input rows), w its int8 copy in
// panels [n_pad / 64][k / 4][64][4] with the per-column scale, sum, ||W||_2 and ||d||_2 (n_pad
// each), `bf16_logits` whether the exact logits are rounded to bfloat16. Returns how many were
// written to `cand`; -1 for bad arguments (rows outside [1, 128], k not a multiple of 4), -2 for a
// value of x that is not finite, -3 for more than `max_cand`, -4 where its scratch could not be
// allocated (the caller runs the whole lm_head).
int64_t inferd_greedy_screen(const void* x, int64_t rows, int64_t x_stride, int dtype,
                             const int8_t* w, int64_t n, int64_t k, const float* scale,
                             const int32_t* sum, const float* norm_w, const float* norm_d,
                             int bf16_logits, int32_t* cand, int64_t max_cand) {
  if (rows < 1 || rows > kMaxRows || k % 4 != 0 || (dtype != kF32 && dtype != kBF16)) return -1;
  const int r = static_cast<int>(rows);
  const int64_t stride = (k + 63) / 64 * 64;
  thread_local Scratch ubuf;  // the quantized rows, reused across calls
  auto* u = static_cast<uint8_t*>(ubuf.get(static_cast<size_t>(rows * stride)));
  if (u == nullptr) return -4;
  ScreenRows xr{u, stride, {}, {}, {}, {}};
  if (screen_rows(x, r, x_stride, dtype, k, u, stride, xr) != 0) return -2;
  const float rel = bf16_logits ? 0x1p-6f : 0x1p-20f;
  return greedy_screen(xr, r, w, ScreenCols{scale, sum, norm_w, norm_d}, n, k, rel, cand,
                       max_cand);
}

// The greedy tokens of x's rows (see inferd_greedy_screen for the arguments up to `max_cand`):
// the screen's candidates into `cand`, their exact weights packed from the row-major lm_head
// `plain` [n][k] (or, when it is null, from its panel copy `panels`), the panel GEMM over them and
// each row's first largest logit, as the whole lm_head and inferd_argmax find it (the first NaN,
// else the first largest; candidates ascend, so ties go to the lowest column). tokens [rows]
// int64. Returns the number of candidates, or the screen's code (< 0: the caller runs the whole
// lm_head; -4 also where this call's scratch could not be allocated).
int64_t inferd_greedy_head(const void* x, int64_t rows, int64_t x_stride, int dtype,
                           const int8_t* w8, int64_t n, int64_t k, const float* scale,
                           const int32_t* sum, const float* norm_w, const float* norm_d,
                           const void* plain, const void* panels, int32_t* cand,
                           int64_t max_cand, int64_t* tokens) {
  if (dtype == kBF16 ? !kHasAVX512BF16 : dtype != kF32) return -1;
  const int64_t count = inferd_greedy_screen(x, rows, x_stride, dtype, w8, n, k, scale, sum, norm_w,
                                             norm_d, dtype == kBF16, cand, max_cand);
  if (count <= 0) return count < 0 ? count : -1;
  const int64_t words = dtype == kBF16 ? k / 2 : k;
  const int r = static_cast<int>(rows);
  thread_local Scratch wbuf, ybuf;
  auto* packed = static_cast<uint32_t*>(wbuf.get(sizeof(uint32_t) * kChunkColumns * words));
  void* y = ybuf.get(static_cast<size_t>(rows * kChunkColumns * dtype_size(dtype)));
  if (packed == nullptr || y == nullptr) return -4;
  int64_t idx[kMaxRows];
  float best[kMaxRows];
  for (int64_t c0 = 0; c0 < count; c0 += kChunkColumns) {
    const int64_t nc = std::min(kChunkColumns, count - c0);
    pack_columns(static_cast<const uint32_t*>(plain ? plain : panels), plain == nullptr, words,
                 cand + c0, nc, packed);
    if (dtype == kF32)
      gemm_panel<StepF32>(x, r, x_stride, packed, nc, k, nullptr, y, nc);
    else
      gemm_panel<StepBF16>(x, r, x_stride, packed, nc, k, nullptr, y, nc);
    if (inferd_argmax(y, dtype, rows, nc, nc, idx) != 0) return -1;
    for (int i = 0; i < r; ++i) {
      const float v = value_at(y, dtype, nc, i, idx[i]);
      // A later chunk wins only with a strictly larger value or the first NaN.
      if (c0 == 0 || (!std::isnan(best[i]) && (std::isnan(v) || v > best[i]))) {
        best[i] = v;
        tokens[i] = cand[c0 + idx[i]];
      }
    }
  }
  return count;
}

}  // extern "C"
