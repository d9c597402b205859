// Paged attention's float32 paths on AVX-512 (paged_attention.cpp has the op and the table of
// which path runs where; attention_item.h what a path is): every CPU the native kernels build for
// runs them, for every item but a bfloat16 model's on a bfloat16 cache where the CPU has
// AVX512_BF16 (x86/avx512bf16_attention.h). Queries are widened and scaled into float32 once; K
// and V rows are float32 in the cache (read in place) or widened by the op into scratch (int8 rows
// times their scale); every product is an FMA in float32.
//
// - F32Rows, an item of a few rows (decode: the G query heads of a kv head, one query each):
//   each row's scores one key at a time, a dot product of D values into a vector of partial
//   sums, sixteen keys' vectors folded by one transpose-reduce (hsum16) instead of 16 horizontal
//   sums; P.V one row at a time. Bound by reading K/V.
// - F32Tiles, an item of kMinTiledRows rows or more (a prefill query tile times G): the same
//   scores (bound by the FMAs either way: a tiled form measured level), P.V for kValueRows rows at
//   a time, each V vector loaded once for all of them. bench/kernel_ab.py, 2 threads: prefill of
//   a float32 model 1.02-1.08x (P.V only); with the output rows stored 16 values at a time as
//   well (paged_attention.cpp's write_rows), 1.14-1.16x.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../attention_item.h"
#include "../simd.h"

namespace {

// [sum(a[0]), sum(a[1]), ..., sum(a[15])]: pairwise unpack/shuffle adds, 45 ops for 16 sums.
inline __m512 hsum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k)  // per 128-bit lane: [a0 0+2, a1 0+2, a0 1+3, a1 1+3]
    b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                         _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: 4 keys' partial sums over that lane
    __m512d x = _mm512_castps_pd(b[2 * k]), y = _mm512_castps_pd(b[2 * k + 1]);
    c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int k = 0; k < 2; ++k)  // fold the four 128-bit lanes pairwise, twice
    d[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                       _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}

// Scores of one row against keys [t0, t0 + n): 16 keys at a time, `dot(i)` giving key i's
// vector of partial sums, the 16 vectors folded by one transpose-reduce (hsum16) instead of 16
// horizontal sums, times `scale` if kScaled. Keys past the row's limit `lim` are masked
// (-inf). Returns the largest of the row's scores (-inf when no key is visible).
template <bool kScaled, typename Dot>
inline __attribute__((always_inline)) float fold_scores(int n, int t0, int lim, float* s,
                                                        float scale, Dot dot) {
  const int valid = std::min(n, lim - t0 + 1);
  const __m512i lane = lane_index();
  const __m512 vs = _mm512_set1_ps(scale);
  __m512 vmax = _mm512_set1_ps(kNegInf);
  for (int i0 = 0; i0 < n; i0 += 16) {
    __m512 a[16];
    const int cnt = std::min(16, std::max(0, valid - i0));
    for (int j = 0; j < 16; ++j) {
      if (j >= cnt) {
        a[j] = _mm512_setzero_ps();
        continue;
      }
      a[j] = dot(i0 + j);
    }
    const __mmask16 ok = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(cnt));
    const __mmask16 in = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(n - i0));
    __m512 h = hsum16(a);
    if constexpr (kScaled) h = _mm512_mul_ps(h, vs);
    __m512 r = _mm512_mask_blend_ps(ok, _mm512_set1_ps(kNegInf), h);
    _mm512_mask_storeu_ps(s + i0, in, r);
    vmax = _mm512_max_ps(vmax, r);  // masked lanes hold -inf
  }
  return _mm512_reduce_max_ps(vmax);
}

template <int NC>
class F32Rows {
 public:
  static constexpr int D = NC * 16;
  static constexpr bool kTiled = false;
  using Row = const float*;

  explicit F32Rows(const ItemRows& ir) : scale_(ir.scale) {}
  F32Rows(const F32Rows&) = delete;
  F32Rows& operator=(const F32Rows&) = delete;

  // Row r's query, widened and times the scale.
  void load_q(int r, const char* src, int dtype) {
    const int esz = dtype == kF32 ? 4 : 2;
    const __m512 vscale = _mm512_set1_ps(scale_);
    for (int c = 0; c < NC; ++c)
      _mm512_store_ps(q_ + r * D + c * 16, _mm512_mul_ps(load16(src + c * 16 * esz, dtype), vscale));
  }

  template <class Issue>
  void scores(const ItemRows& ir, const Row* k, int t0, int n, float* s, float* tmax,
              Issue issue) const {
    for (int r = 0; r < ir.rows; ++r) {
      issue(r);
      tmax[r] = scores_row(q_ + r * D, k, ir.hoff[r], n, t0, ir.limit[r], s + r * kKeyTile);
    }
  }

  template <class Issue>
  void values(const ItemRows& ir, const Row* v, int t0, int n, float* s, float* alpha,
              float* acc, Issue issue) const {
    for (int r = 0; r < ir.rows; ++r) {
      issue(r);
      if (alpha[r] < 0.0f) continue;
      const int visible = std::min(n, ir.limit[r] - t0 + 1);
      value_row(s + r * kKeyTile, alpha[r], v, ir.hoff[r], visible, acc + r * D);
    }
  }

 private:
  // Float32 rows (q already scaled; K rows widened or in place, `hoff` floats into each).
  static float scores_row(const float* qr, const float* const* krow, int hoff, int n, int t0,
                          int lim, float* s) {
    __m512 qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = _mm512_load_ps(qr + c * 16);
    return fold_scores<false>(n, t0, lim, s, 1.0f, [=](int i) {
      const float* k = krow[i] + hoff;
      __m512 x = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
      for (int c = 1; c < NC; ++c) x = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + c * 16), x);
      return x;
    });
  }

  // acc = acc * alpha + s . V over the row's `visible` keys (past them its weights are 0, so the
  // loop stops there).
  static void value_row(const float* s, float alpha, const float* const* vrow, int hoff,
                        int visible, float* acc) {
    __m512 a[NC];
    const __m512 va = _mm512_set1_ps(alpha);
    for (int c = 0; c < NC; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), va);
    for (int i = 0; i < visible; ++i) {
      const __m512 pi = _mm512_set1_ps(s[i]);
      const float* v = vrow[i] + hoff;
      for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(v + c * 16), a[c]);
    }
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + c * 16, a[c]);
  }

 protected:
  const float scale_;
  alignas(64) float q_[kMaxRows * D];
};

// Rows per P.V block of the tiled paths: kValueRows x NC accumulators stay in registers.
template <int NC>
constexpr int kValueRows = std::max(1, 16 / NC);

// An item of many rows on float32 V: F32Rows' scores, P.V kValueRows rows at a time.
template <int NC>
class F32Tiles : public F32Rows<NC> {
 public:
  static constexpr int D = NC * 16;
  static constexpr bool kTiled = true;
  using Row = const float*;

  explicit F32Tiles(const ItemRows& ir) : F32Rows<NC>(ir) {}

  template <class Issue>
  void values(const ItemRows& ir, const Row* v, int t0, int n, float* s, float* alpha,
              float* acc, Issue issue) const {
    keep_unseen(ir.rows, s, alpha);
    value_blocks<kValueRows<NC>>(ir, t0, n, issue, [&](auto rb, int hh, int r0, int upto) {
      block_values<decltype(rb)::value>(s, alpha, v, hh * D, upto, r0, acc);
    });
  }

 private:
  // acc[r] = acc[r] * alpha[r] + P[r] . V over the tile's first `upto` keys, rows [r0, r0 + RB)
  // (their weights in s, zero past each row's visible keys): float32 V rows `vrow` (+ hoff).
  template <int RB>
  static void block_values(const float* s, const float* alpha, const float* const* vrow,
                           int hoff, int upto, int r0, float* acc) {
    __m512 a[RB][NC];
    for (int rb = 0; rb < RB; ++rb) {
      const __m512 va = _mm512_set1_ps(alpha[r0 + rb]);
      for (int c = 0; c < NC; ++c)
        a[rb][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + rb) * D + c * 16), va);
    }
    for (int i = 0; i < upto; ++i) {
      __m512 v[NC];
      for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_ps(vrow[i] + hoff + c * 16);
      for (int rb = 0; rb < RB; ++rb) {
        const __m512 p = _mm512_set1_ps(s[(r0 + rb) * kKeyTile + i]);
        for (int c = 0; c < NC; ++c) a[rb][c] = _mm512_fmadd_ps(p, v[c], a[rb][c]);
      }
    }
    for (int rb = 0; rb < RB; ++rb)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + (r0 + rb) * D + c * 16, a[rb][c]);
  }
};

}  // namespace
