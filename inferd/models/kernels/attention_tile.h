// The tiled form of paged attention's inner loop, for work items with many query rows (prefill).
//
// paged_attention.cpp's per-row path computes a row's scores one key at a time: a dot product of
// D values into a vector of partial sums, sixteen keys' vectors folded by a transpose-reduce. For
// the few rows of a decode item that is the cheapest form. A prefill item has up to 64 rows (a
// query tile times the G heads of a kv head) over the same key tile, and there the fold costs more
// than the dot products. So an item of at least kTileRows rows instead:
//
// - for bfloat16 queries on a bfloat16 cache (the only case it takes scores for), transposes the
//   key tile once, keys fastest (pairs of dimensions as 32-bit words, [nh][D/2][kKeyTile], the
//   operand VDPBF16PS takes; zero past the tile's last key) by 16 x 16 register transposes, then
//   computes the scores of kScoreRows rows at a time as a small GEMM: per dimension pair, the 32
//   keys' values are loaded once and multiplied by each row's broadcast query pair into 32 sums
//   per row, no fold. float32 scores keep the per-row form: they are bound by the FMAs either
//   way (measured level);
// - for bfloat16 V, interleaves the tile's V rows two keys at a time once ([nh][kKeyTile/2][D]
//   words), so each row's P.V is one VDPBF16PS per 16 dimensions and key pair; float32 V is read
//   in place (or from the widened scratch);
// - runs P.V for kValueRows rows at a time, each V vector loaded once for all of them.
//
// bench/kernel_ab.py, 2 threads: prefill of a bfloat16 model 1.30-1.34x (Qwen2-0.5B's and the
// tiny shape's heads), float32 1.02-1.08x (P.V only); with the output rows stored 16 values at a
// time as well (paged_attention.cpp's write_rows), 1.43-1.47x and 1.14-1.16x. Decode items (7-14
// rows) measured 0.73-0.99x on this path: memory-bound, they gain nothing from the transposes, so
// kTileRows leaves them out.
//
// On a CPU with AMX a bfloat16 item (head_dim a multiple of 32) runs both GEMMs on tiles instead
// (scores_amx, values_amx; amx.h): the transposed K tile is already the B tile TDPBF16PS takes
// (dimension pairs by keys), the interleaved V tile too (key pairs by dimensions), a query row's
// 32 values and a row's 32 bfloat16 weights the A tile's rows. bench/kernel_ab.py on an AMX Xeon,
// 2 threads: prefill of a bfloat16 model 1.97x (Qwen2-0.5B's heads), 1.60x (the tiny shape's);
// the engine's bfloat16 prefill on the Qwen shape 4.5 % faster (docs/benchmarks.md).
//
// The softmax between the two (running max, sum and rescale, paged_attention.cpp's softmax_tile)
// and the numerics are the per-row path's: bfloat16 scores and P.V are VDPBF16PS dot products
// with fp32 sums, P rounded to bfloat16 for P.V; float32 P.V is FMAs.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "amx.h"
#include "simd.h"

namespace tiling {

constexpr int kTileRows = 16;  // an item with fewer rows takes the per-row path
constexpr int kKeys = 32;      // keys of a tile (paged_attention.cpp's kKeyTile)
constexpr int kScoreRows = 4;  // rows per score block: 8 accumulators

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

#ifdef __AVX512BF16__
// The softmax weights s[0, n) of one row (n <= kKeys) rounded to bfloat16 into pw[0, kKeys),
// zero past n (as FlashAttention rounds P for P.V).
inline void weights_bf16(const float* s, int n, uint16_t* pw) {
  const __m512 lo = _mm512_maskz_loadu_ps(tail_mask(n), s);
  const __m512 hi = _mm512_maskz_loadu_ps(tail_mask(std::max(0, n - 16)), s + 16);
  _mm512_storeu_si512(pw, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
#endif

template <int NC>
struct Tiled {
  static constexpr int D = NC * 16;
  // Rows per P.V block: kValueRows x NC accumulators stay in registers.
  static constexpr int kValueRows = std::max(1, 16 / NC);

  // The bfloat16 key tile transposed: rows `kraw` (in place, hh * D * 2 bytes into each for head
  // hh) of n keys and nh heads, into `kt` as 32-bit words (a pair of dimensions), [nh][D/2][kKeys],
  // 16 x 16 blocks at a time.
  static void transpose_k(const char* const* kraw, int nh, int n, uint32_t* kt) {
    constexpr int w = D / 2;  // words per key row of one head
    for (int hh = 0; hh < nh; ++hh)
      for (int k0 = 0; k0 < kKeys; k0 += 16)
        for (int c0 = 0; c0 < w; c0 += 16) {
          __m512 r[16];
          for (int i = 0; i < 16; ++i)
            r[i] = k0 + i < n ? _mm512_loadu_ps(kraw[k0 + i] + hh * D * 2 + 4 * c0)
                              : _mm512_setzero_ps();
          transpose16(r);
          uint32_t* o = kt + (hh * w + c0) * kKeys + k0;
          for (int c = 0; c < 16; ++c)
            _mm512_store_ps(reinterpret_cast<float*>(o + c * kKeys), r[c]);
        }
  }

  // Scores of rows [r0, r0 + RB) of one head (bfloat16 queries `qraw`, rows D apart, unscaled)
  // against its transposed tile `kt` into s (rows kKeys apart), times `scale`, keys past a row's
  // limit (or the tile's n) -inf; tmax[r] the row's largest.
  template <int RB>
  static void scores(const uint16_t* qraw, const uint32_t* kt, int r0, int t0, int n,
                     const int* limit, float scale, float* s, float* tmax) {
    __m512 a[RB][2];
    for (int rb = 0; rb < RB; ++rb) a[rb][0] = a[rb][1] = _mm512_setzero_ps();
#ifdef __AVX512BF16__
    if constexpr (D % 32 == 0) {
      const uint16_t* q = qraw + r0 * D;
      for (int p = 0; p < D / 2; ++p) {
        const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + p * kKeys);
        const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + p * kKeys + 16);
        for (int rb = 0; rb < RB; ++rb) {
          const __m512bh qp = (__m512bh)_mm512_set1_epi32(
              static_cast<int>(word(reinterpret_cast<const char*>(q + rb * D + 2 * p))));
          a[rb][0] = _mm512_dpbf16_ps(a[rb][0], k0, qp);
          a[rb][1] = _mm512_dpbf16_ps(a[rb][1], k1, qp);
        }
      }
    }
#endif
    (void)qraw, (void)kt;
    for (int rb = 0; rb < RB; ++rb) finish_scores(a[rb], r0 + rb, t0, n, limit, scale, s, tmax);
  }

  // Row r's 32 raw scores `a` into s (rows kKeys apart), times `scale`, keys past the row's limit
  // (or the tile's n) -inf; tmax[r] their largest.
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
      _mm512_store_ps(s + r * kKeys + 16 * c, h);
      vmax = _mm512_max_ps(vmax, h);
    }
    tmax[r] = _mm512_reduce_max_ps(vmax);
  }

#if INFERD_AMX
  // scores() for rows [r0, r1) of one head on AMX tiles, in blocks of m = min(16, r1 - r0) rows
  // (the last one ending at r1; the caller configured the tiles for m: amx_configure). The
  // transposed tile `kt` is the B tile TDPBF16PS takes: rows dimension pairs, 16 keys of 32-bit
  // words each (a row kKeys words long); a query row's 32 values the A tile's row.
  static void scores_amx(const uint16_t* qraw, const uint32_t* kt, int r0, int r1, int t0, int n,
                         const int* limit, float scale, float* s, float* tmax) {
    const int m = std::min(16, r1 - r0);
    alignas(64) float c[16 * kKeys];
    amx_row_blocks(r0, r1, [&](int rb, int) {
      _tile_zero(0);
      _tile_zero(1);
      for (int d0 = 0; d0 < D / 32; ++d0) {
        _tile_loadd(4, qraw + rb * D + 32 * d0, D * 2);
        _tile_loadd(5, kt + 16 * d0 * kKeys, kKeys * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, kt + 16 * d0 * kKeys + 16, kKeys * 4);
        _tile_dpbf16ps(1, 4, 6);
      }
      _tile_stored(0, c, kKeys * 4);
      _tile_stored(1, c + 16, kKeys * 4);
      for (int i = 0; i < m; ++i) {
        const __m512 a[2] = {_mm512_load_ps(c + i * kKeys), _mm512_load_ps(c + i * kKeys + 16)};
        finish_scores(a, rb + i, t0, n, limit, scale, s, tmax);
      }
    });
  }

  // values() for rows [r0, r1) of one head on AMX tiles (bfloat16 V, interleaved as
  // interleave_v leaves it: the B tile, key pairs by 16 dimensions), in blocks of m rows as
  // scores_amx; P (rounded to bfloat16) is the A tile. Key pairs past the tile's n are zeroed in
  // `vi` first (interleave_v leaves them as they were; their weights are zero, but 0 x NaN).
  static void values_amx(const float* s, const float* alpha, uint32_t* vi, int n, int r0, int r1,
                         float* acc) {
    const int m = std::min(16, r1 - r0);
    for (int q = (n + 1) / 2; q < kKeys / 2; ++q) std::memset(vi + q * D, 0, sizeof(uint32_t) * D);
    alignas(64) uint16_t pw[16][kKeys];
    alignas(64) float c[16 * D];
    amx_row_blocks(r0, r1, [&](int rb, int first_new) {
      for (int i = 0; i < m; ++i) weights_bf16(s + (rb + i) * kKeys, n, pw[i]);
      _tile_loadd(4, pw, kKeys * 2);
      for (int j = 0; j < NC; j += 4) {  // 4 C tiles of 16 dimensions at a time
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(5, vi + 16 * j, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        if (j + 1 < NC) {
          _tile_loadd(6, vi + 16 * (j + 1), D * 4);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (j + 2 < NC) {
          _tile_loadd(7, vi + 16 * (j + 2), D * 4);
          _tile_dpbf16ps(2, 4, 7);
        }
        if (j + 3 < NC) {
          _tile_loadd(5, vi + 16 * (j + 3), D * 4);
          _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, c + 16 * j, D * 4);
        if (j + 1 < NC) _tile_stored(1, c + 16 * (j + 1), D * 4);
        if (j + 2 < NC) _tile_stored(2, c + 16 * (j + 2), D * 4);
        if (j + 3 < NC) _tile_stored(3, c + 16 * (j + 3), D * 4);
      }
      // Rows an earlier block already updated (the last block overlaps) are left alone.
      for (int r = first_new; r < rb + m; ++r) {
        const __m512 va = _mm512_set1_ps(alpha[r]);
        for (int cc = 0; cc < NC; ++cc) {
          float* o = acc + r * D + cc * 16;
          _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), va,
                                              _mm512_load_ps(c + (r - rb) * D + cc * 16)));
        }
      }
    });
  }
#endif

  // The tile's bfloat16 V rows, two keys interleaved value by value: word (q, d) of head hh holds
  // V[2q][d] and V[2q + 1][d] (zero past the tile's n keys).
  static void interleave_v(const char* const* vraw, int nh, int n, uint32_t* vi) {
    const __m512i ilo = pair_lo(), ihi = pair_hi();
    for (int hh = 0; hh < nh; ++hh)
      for (int q = 0; 2 * q < n; ++q) {
        const char* v0 = vraw[2 * q] + hh * D * 2;
        const char* v1 = 2 * q + 1 < n ? vraw[2 * q + 1] + hh * D * 2 : nullptr;
        uint32_t* o = vi + (hh * (kKeys / 2) + q) * D;
        for (int c = 0; c < NC / 2; ++c) {
          const __m512i x = _mm512_loadu_si512(v0 + c * 64);
          const __m512i y = v1 ? _mm512_loadu_si512(v1 + c * 64) : _mm512_setzero_si512();
          _mm512_store_si512(o + c * 32, _mm512_permutex2var_epi16(x, ilo, y));
          _mm512_store_si512(o + c * 32 + 16, _mm512_permutex2var_epi16(x, ihi, y));
        }
      }
  }

  // acc[r] = acc[r] * alpha[r] + P[r] . V over the tile's first `upto` keys, rows [r0, r0 + RB)
  // (their weights in s, zero past each row's visible keys): float32 V rows `vrow` (+ hoff), or
  // the interleaved bfloat16 ones `vi` of the rows' head.
  template <int RB>
  static void values(const float* s, const float* alpha, const float* const* vrow, int hoff,
                     const uint32_t* vi, bool bf16, int n, int upto, int r0, float* acc) {
    __m512 a[RB][NC];
    for (int rb = 0; rb < RB; ++rb) {
      const __m512 va = _mm512_set1_ps(alpha[r0 + rb]);
      for (int c = 0; c < NC; ++c)
        a[rb][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (r0 + rb) * D + c * 16), va);
    }
#ifdef __AVX512BF16__
    if constexpr (D % 32 == 0) {
      if (bf16) {
        alignas(64) uint16_t pw[RB][kKeys];
        for (int rb = 0; rb < RB; ++rb) weights_bf16(s + (r0 + rb) * kKeys, n, pw[rb]);
        for (int q = 0; 2 * q < upto; ++q) {
          __m512bh v[NC];
          for (int c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_load_si512(vi + q * D + c * 16);
          for (int rb = 0; rb < RB; ++rb) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32(
                static_cast<int>(word(reinterpret_cast<const char*>(pw[rb] + 2 * q))));
            for (int c = 0; c < NC; ++c) a[rb][c] = _mm512_dpbf16_ps(a[rb][c], v[c], w);
          }
        }
      }
    }
#endif
    (void)vi, (void)n;
    for (int i = 0; i < (bf16 ? 0 : upto); ++i) {
      __m512 v[NC];
      for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_ps(vrow[i] + hoff + c * 16);
      for (int rb = 0; rb < RB; ++rb) {
        const __m512 p = _mm512_set1_ps(s[(r0 + rb) * kKeys + i]);
        for (int c = 0; c < NC; ++c) a[rb][c] = _mm512_fmadd_ps(p, v[c], a[rb][c]);
      }
    }
    for (int rb = 0; rb < RB; ++rb)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + (r0 + rb) * D + c * 16, a[rb][c]);
  }

  // Calls f.template operator()<RB>(r0) over rows [r0, r1) in blocks of RB (the rest one by one).
  template <int RB, typename F>
  static void blocks(int r0, int r1, F f) {
    int r = r0;
    for (; r + RB <= r1; r += RB) f(std::integral_constant<int, RB>{}, r);
    for (; r < r1; ++r) f(std::integral_constant<int, 1>{}, r);
  }
};

}  // namespace tiling
