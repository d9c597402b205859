// Paged attention's bfloat16 paths on AVX512_BF16 (paged_attention.cpp has the op and the table
// of which path runs where; attention_item.h what a path is): a bfloat16 model's items on a
// bfloat16 cache, head_dim a multiple of 32, on CPUs with AVX512_BF16 (Zen 4/5, Cooper Lake and
// later Xeons; without it the build leaves this file out and x86/avx512_attention.h's float32
// paths take those items, the rows widened). K and V are read in place in the cache (no widened
// copy); scores and P.V are VDPBF16PS dot products (pairs of bf16 products, exact in fp32,
// summed in fp32), the scores scaled after the sum, P rounded to bfloat16 for P.V as
// FlashAttention rounds it.
//
// - BF16Rows, an item of a few rows (decode): each row's scores one key at a time, folded as
//   F32Rows folds them (fold_scores); P.V one row at a time, two keys per VDPBF16PS on their V
//   rows interleaved value by value.
// - BF16Tiles, an item of kMinTiledRows rows or more (a prefill query tile times G), where the fold
//   costs more than the dot products: the key tile is transposed once, keys fastest (pairs of
//   dimensions as 32-bit words, [nh][D/2][kKeyTile], the operand VDPBF16PS takes; zero past the
//   tile's last key) by 16 x 16 register transposes, and the scores of kScoreRows rows at a time
//   are a small GEMM: per dimension pair, the 32 keys' values are loaded once and multiplied by
//   each row's broadcast query pair into 32 sums per row, no fold. V is interleaved two keys at
//   a time once ([nh][kKeyTile/2][D] words), so each row's P.V is one VDPBF16PS per 16 dimensions
//   and key pair, kValueRows rows per loaded V vector.
//
// bench/kernel_ab.py, 2 threads: prefill of a bfloat16 model 1.30-1.34x on the tiled path
// (Qwen2-0.5B's and the tiny shape's heads); with the output rows stored 16 values at a time as
// well (paged_attention.cpp's write_rows), 1.43-1.47x. Decode items (7-14 rows) measured
// 0.73-0.99x on it: memory-bound, they gain nothing from the transposes, so kMinTiledRows leaves
// them out. On CPUs with AMX, x86/amx_attention.h runs the tiled path's two GEMMs on tiles.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../attention_item.h"
#include "../simd.h"
#include "avx512_attention.h"

#ifdef __AVX512BF16__

namespace {

constexpr int kScoreRows = 4;  // rows per score block of BF16Tiles: 8 accumulators

inline uint32_t word(const char* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// VPERMT2W indices that interleave two rows of 32 bfloat16 values value by value: `lo` pairs
// values 0-15 of the two rows, `hi` values 16-31 (the operand layout VDPBF16PS takes for two keys).
inline __m512i pair_lo() {
  return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                          6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
}
inline __m512i pair_hi() { return _mm512_add_epi16(pair_lo(), _mm512_set1_epi16(16)); }

// The softmax weights s[0, n) of one row (n <= kKeyTile) rounded to bfloat16 into
// pw[0, kKeyTile), zero past n (as FlashAttention rounds P for P.V).
inline void weights_bf16(const float* s, int n, uint16_t* pw) {
  const __m512 lo = _mm512_maskz_loadu_ps(tail_mask(n), s);
  const __m512 hi = _mm512_maskz_loadu_ps(tail_mask(std::max(0, n - 16)), s + 16);
  _mm512_storeu_si512(pw, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// The bfloat16 query rows of an item, as VDPBF16PS and the AMX tiles take them (unscaled).
template <int NC>
class BF16Queries {
 public:
  static constexpr int D = NC * 16;
  static_assert(D % 32 == 0, "VDPBF16PS takes 32 bfloat16 values a vector");
  using Row = const char*;

  explicit BF16Queries(const ItemRows& ir) : scale_(ir.scale) {}
  BF16Queries(const BF16Queries&) = delete;
  BF16Queries& operator=(const BF16Queries&) = delete;

  void load_q(int r, const char* src, int) { std::memcpy(q_ + r * D, src, sizeof(uint16_t) * D); }

 protected:
  const float scale_;
  alignas(64) uint16_t q_[kMaxRows * D];
};

template <int NC>
class BF16Rows : public BF16Queries<NC> {
 public:
  static constexpr int D = NC * 16;
  static constexpr bool kTiled = false;
  using Row = const char*;

  explicit BF16Rows(const ItemRows& ir) : BF16Queries<NC>(ir) {}

  template <class Issue>
  void scores(const ItemRows& ir, const Row* k, int t0, int n, float* s, float* tmax,
              Issue issue) const {
    for (int r = 0; r < ir.rows; ++r) {
      issue(r);
      tmax[r] = scores_row(this->q_ + r * D, k, ir.hoff[r] * 2, n, t0, ir.limit[r],
                           s + r * kKeyTile, this->scale_);
    }
  }

  template <class Issue>
  void values(const ItemRows& ir, const Row* v, int t0, int n, float* s, float* alpha,
              float* acc, Issue issue) const {
    for (int r = 0; r < ir.rows; ++r) {
      issue(r);
      const int visible = std::min(n, ir.limit[r] - t0 + 1);
      // visible <= 0: a query row of a prefill chunk none of whose keys here it may see.
      if (alpha[r] < 0.0f || visible <= 0) continue;
      value_row(s + r * kKeyTile, alpha[r], v, ir.hoff[r] * 2, n, visible, acc + r * D);
    }
  }

 private:
  // bfloat16 q (`qr`, unscaled) against bfloat16 K rows in place (`krow` + `hoff` bytes): each
  // key's partial sums by VDPBF16PS (pairs of bf16 products, exact in fp32, summed in fp32).
  static float scores_row(const uint16_t* qr, const char* const* krow, int hoff, int n, int t0,
                          int lim, float* s, float scale) {
    constexpr int NP = D / 32;
    __m512bh qv[NP];
    for (int c = 0; c < NP; ++c) qv[c] = (__m512bh)_mm512_load_si512(qr + c * 32);
    return fold_scores<true>(n, t0, lim, s, scale, [=](int i) {
      const char* k = krow[i] + hoff;
      __m512 x = _mm512_setzero_ps();
      for (int c = 0; c < NP; ++c)
        x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_loadu_si512(k + c * 64), qv[c]);
      return x;
    });
  }

  // acc = acc * alpha + s . V for bfloat16 V rows in place (`vrow` + `hoff` bytes) over the
  // row's `visible` keys: the weights rounded to bfloat16 (as FlashAttention's P), two keys at a
  // time through VDPBF16PS on their rows interleaved value by value.
  static void value_row(const float* s, float alpha, const char* const* vrow, int hoff, int n,
                        int visible, float* acc) {
    alignas(64) uint16_t pw[kKeyTile + 2];
    weights_bf16(s, n, pw);
    pw[visible] = 0;  // an odd last key pairs with a zero weight
    const __m512i ilo = pair_lo(), ihi = pair_hi();
    __m512 a[NC];
    const __m512 va = _mm512_set1_ps(alpha);
    for (int c = 0; c < NC; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), va);
    for (int i = 0; i < visible; i += 2) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(
          static_cast<int>(word(reinterpret_cast<const char*>(pw + i))));
      const char* v0 = vrow[i] + hoff;
      const char* v1 = i + 1 < visible ? vrow[i + 1] + hoff : nullptr;
      for (int c = 0; c < NC / 2; ++c) {
        const __m512i x = _mm512_loadu_si512(v0 + c * 64);
        const __m512i y = v1 != nullptr ? _mm512_loadu_si512(v1 + c * 64) : _mm512_setzero_si512();
        a[2 * c] = _mm512_dpbf16_ps(a[2 * c], (__m512bh)_mm512_permutex2var_epi16(x, ilo, y), w);
        a[2 * c + 1] =
            _mm512_dpbf16_ps(a[2 * c + 1], (__m512bh)_mm512_permutex2var_epi16(x, ihi, y), w);
      }
    }
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + c * 16, a[c]);
  }
};

template <int NC>
class BF16Tiles : public BF16Queries<NC> {
 public:
  static constexpr int D = NC * 16;
  static constexpr bool kTiled = true;
  using Row = const char*;

  explicit BF16Tiles(const ItemRows& ir) : BF16Queries<NC>(ir) {}

  template <class Issue>
  void scores(const ItemRows& ir, const Row* k, int t0, int n, float* s, float* tmax,
              Issue issue) {
    transpose_k(k, ir.nh, n, kt_);
    for (int hh = 0; hh < ir.nh; ++hh)
      row_blocks<kScoreRows>(hh * ir.per_head, (hh + 1) * ir.per_head, [&](auto rb, int r0) {
        constexpr int RB = decltype(rb)::value;
        issue(r0 + RB - 1);
        block_scores<RB>(this->q_, kt_ + hh * (D / 2) * kKeyTile, r0, t0, n, ir.limit,
                         this->scale_, s, tmax);
      });
  }

  template <class Issue>
  void values(const ItemRows& ir, const Row* v, int t0, int n, float* s, float* alpha,
              float* acc, Issue issue) {
    keep_unseen(ir.rows, s, alpha);
    interleave_v(v, ir.nh, n, vi_);
    value_blocks<kValueRows<NC>>(ir, t0, n, issue, [&](auto rb, int hh, int r0, int upto) {
      block_values<decltype(rb)::value>(s, alpha, vi_ + hh * (kKeyTile / 2) * D, n, upto, r0, acc);
    });
  }

 protected:
  // The bfloat16 key tile transposed: rows `kraw` (in place, hh * D * 2 bytes into each for head
  // hh) of n keys and nh heads, into `kt` as 32-bit words (a pair of dimensions),
  // [nh][D/2][kKeyTile], 16 x 16 blocks at a time.
  static void transpose_k(const char* const* kraw, int nh, int n, uint32_t* kt) {
    constexpr int w = D / 2;  // words per key row of one head
    for (int hh = 0; hh < nh; ++hh)
      for (int k0 = 0; k0 < kKeyTile; k0 += 16)
        for (int c0 = 0; c0 < w; c0 += 16) {
          __m512 r[16];
          for (int i = 0; i < 16; ++i)
            r[i] = k0 + i < n ? _mm512_loadu_ps(kraw[k0 + i] + hh * D * 2 + 4 * c0)
                              : _mm512_setzero_ps();
          transpose16(r);
          uint32_t* o = kt + (hh * w + c0) * kKeyTile + k0;
          for (int c = 0; c < 16; ++c)
            _mm512_store_ps(reinterpret_cast<float*>(o + c * kKeyTile), r[c]);
        }
  }

  // Row r's 32 raw scores `a` into s (rows kKeyTile apart), times `scale`, keys past the row's
  // limit (or the tile's n) -inf; tmax[r] their largest.
  static void finish_scores(const __m512* a, int r, int t0, int n, const int* limit, float scale,
                            float* s, float* tmax) {
    const __m512i lane = lane_index();
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512 vs = _mm512_set1_ps(scale);
    const int valid = std::min(n, limit[r] - t0 + 1);
    __m512 vmax = ninf;
    for (int c = 0; c < 2; ++c) {
      const __mmask16 ok = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(valid - 16 * c));
      const __m512 h = _mm512_mask_blend_ps(ok, ninf, _mm512_mul_ps(a[c], vs));
      _mm512_store_ps(s + r * kKeyTile + 16 * c, h);
      vmax = _mm512_max_ps(vmax, h);
    }
    tmax[r] = _mm512_reduce_max_ps(vmax);
  }

  // The tile's bfloat16 V rows, two keys interleaved value by value: word (q, d) of head hh holds
  // V[2q][d] and V[2q + 1][d] (zero past the tile's n keys).
  static void interleave_v(const char* const* vraw, int nh, int n, uint32_t* vi) {
    const __m512i ilo = pair_lo(), ihi = pair_hi();
    for (int hh = 0; hh < nh; ++hh)
      for (int q = 0; 2 * q < n; ++q) {
        const char* v0 = vraw[2 * q] + hh * D * 2;
        const char* v1 = 2 * q + 1 < n ? vraw[2 * q + 1] + hh * D * 2 : nullptr;
        uint32_t* o = vi + (hh * (kKeyTile / 2) + q) * D;
        for (int c = 0; c < NC / 2; ++c) {
          const __m512i x = _mm512_loadu_si512(v0 + c * 64);
          const __m512i y = v1 ? _mm512_loadu_si512(v1 + c * 64) : _mm512_setzero_si512();
          _mm512_store_si512(o + c * 32, _mm512_permutex2var_epi16(x, ilo, y));
          _mm512_store_si512(o + c * 32 + 16, _mm512_permutex2var_epi16(x, ihi, y));
        }
      }
  }

  alignas(64) uint32_t kt_[kKeyTile * kMaxItemWidth / 2];  // the transposed K tile
  alignas(64) uint32_t vi_[kKeyTile / 2 * kMaxItemWidth];  // the interleaved V tile

 private:
  // Scores of rows [r0, r0 + RB) of one head (bfloat16 queries `qraw`, rows D apart, unscaled)
  // against its transposed tile `kt` into s (rows kKeyTile apart), times `scale`, keys past a
  // row's limit (or the tile's n) -inf; tmax[r] the row's largest.
  template <int RB>
  static void block_scores(const uint16_t* qraw, const uint32_t* kt, int r0, int t0, int n,
                           const int* limit, float scale, float* s, float* tmax) {
    __m512 a[RB][2];
    for (int rb = 0; rb < RB; ++rb) a[rb][0] = a[rb][1] = _mm512_setzero_ps();
    const uint16_t* q = qraw + r0 * D;
    for (int p = 0; p < D / 2; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + p * kKeyTile);
      const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + p * kKeyTile + 16);
      for (int rb = 0; rb < RB; ++rb) {
        const __m512bh qp = (__m512bh)_mm512_set1_epi32(
            static_cast<int>(word(reinterpret_cast<const char*>(q + rb * D + 2 * p))));
        a[rb][0] = _mm512_dpbf16_ps(a[rb][0], k0, qp);
        a[rb][1] = _mm512_dpbf16_ps(a[rb][1], k1, qp);
      }
    }
    for (int rb = 0; rb < RB; ++rb) finish_scores(a[rb], r0 + rb, t0, n, limit, scale, s, tmax);
  }

  // acc[r] = acc[r] * alpha[r] + P[r] . V over the tile's first `upto` keys, rows
  // [r0, r0 + RB) (their weights in s, zero past each row's visible keys, rounded to bfloat16):
  // the interleaved bfloat16 V rows `vi` of the rows' head.
  template <int RB>
  static void block_values(const float* s, const float* alpha, const uint32_t* vi, int n,
                           int upto, int r0, float* acc) {
    __m512 a[RB][NC];
    for (int rb = 0; rb < RB; ++rb) {
      const __m512 va = _mm512_set1_ps(alpha[r0 + rb]);
      for (int c = 0; c < NC; ++c)
        a[rb][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + rb) * D + c * 16), va);
    }
    alignas(64) uint16_t pw[RB][kKeyTile];
    for (int rb = 0; rb < RB; ++rb) weights_bf16(s + (r0 + rb) * kKeyTile, n, pw[rb]);
    for (int q = 0; 2 * q < upto; ++q) {
      __m512bh v[NC];
      for (int c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_load_si512(vi + q * D + c * 16);
      for (int rb = 0; rb < RB; ++rb) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(
            static_cast<int>(word(reinterpret_cast<const char*>(pw[rb] + 2 * q))));
        for (int c = 0; c < NC; ++c) a[rb][c] = _mm512_dpbf16_ps(a[rb][c], v[c], w);
      }
    }
    for (int rb = 0; rb < RB; ++rb)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + (r0 + rb) * D + c * 16, a[rb][c]);
  }
};

}  // namespace

#endif  // __AVX512BF16__
