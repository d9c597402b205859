// Paged attention's tiled bfloat16 path on AMX tiles, for CPUs that have them (Sapphire Rapids
// and later Xeons; paged_attention.cpp has the op and the table of which path runs where): an
// item of kMinTiledRows rows or more of a bfloat16 model on a bfloat16 cache, head_dim a multiple
// of 32, runs both of BF16Tiles' GEMMs on tiles (x86/avx512bf16_attention.h keeps everything
// else: the transposed K tile, the interleaved V tile, the scores' masking). The transposed K
// tile is already the B tile TDPBF16PS takes (dimension pairs by keys), the interleaved V tile
// too (key pairs by dimensions), a query row's 32 values and a row's 32 bfloat16 weights the A
// tile's rows. The tiles' permission, configuration and row blocks are x86/amx.h's, shared with
// the panel GEMM.
//
// bench/kernel_ab.py on an AMX Xeon, 2 threads: prefill of a bfloat16 model 1.97x (Qwen2-0.5B's
// heads), 1.60x (the tiny shape's); the engine's bfloat16 prefill on the Qwen shape 4.5 % faster
// (docs/benchmarks.md). The numerics are BF16Tiles': fp32 sums of bfloat16 products, P rounded
// to bfloat16.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../attention_item.h"
#include "amx.h"
#include "avx512bf16_attention.h"

#if INFERD_AMX && defined(__AVX512BF16__)

namespace {

// BF16Tiles with its scores and P.V on tiles: this thread's tiles configured for the item's
// blocks of min(16, rows per head) rows when it starts, released when it ends.
template <int NC>
class AmxTiles : public BF16Tiles<NC> {
 public:
  static constexpr int D = NC * 16;
  static constexpr bool kTiled = true;
  using Row = const char*;

  explicit AmxTiles(const ItemRows& ir) : BF16Tiles<NC>(ir) {
    amx_configure(std::min(16, ir.per_head));
  }
  ~AmxTiles() { amx_release(); }

  template <class Issue>
  void scores(const ItemRows& ir, const Row* k, int t0, int n, float* s, float* tmax,
              Issue issue) {
    this->transpose_k(k, ir.nh, n, this->kt_);
    for (int hh = 0; hh < ir.nh; ++hh) {
      issue((hh + 1) * ir.per_head - 1);
      scores_amx(this->q_, this->kt_ + hh * (D / 2) * kKeyTile, hh * ir.per_head,
                 (hh + 1) * ir.per_head, t0, n, ir.limit, this->scale_, s, tmax);
    }
  }

  template <class Issue>
  void values(const ItemRows& ir, const Row* v, int, int n, float* s, float* alpha, float* acc,
              Issue issue) {
    keep_unseen(ir.rows, s, alpha);
    this->interleave_v(v, ir.nh, n, this->vi_);
    for (int hh = 0; hh < ir.nh; ++hh) {
      issue((hh + 1) * ir.per_head - 1);
      values_amx(s, alpha, this->vi_ + hh * (kKeyTile / 2) * D, n, hh * ir.per_head,
                 (hh + 1) * ir.per_head, acc);
    }
  }

 private:
  using BF16Tiles<NC>::finish_scores;

  // Scores of rows [r0, r1) of one head on AMX tiles, in blocks of m = min(16, r1 - r0) rows
  // (the last one ending at r1; the constructor configured the tiles for m: amx_configure). The
  // transposed tile `kt` is the B tile TDPBF16PS takes: rows dimension pairs, 16 keys of 32-bit
  // words each (a row kKeyTile words long); a query row's 32 values the A tile's row.
  static void scores_amx(const uint16_t* qraw, const uint32_t* kt, int r0, int r1, int t0, int n,
                         const int* limit, float scale, float* s, float* tmax) {
    const int m = std::min(16, r1 - r0);
    alignas(64) float c[16 * kKeyTile];
    amx_row_blocks(r0, r1, [&](int rb, int) {
      _tile_zero(0);
      _tile_zero(1);
      for (int d0 = 0; d0 < D / 32; ++d0) {
        _tile_loadd(4, qraw + rb * D + 32 * d0, D * 2);
        _tile_loadd(5, kt + 16 * d0 * kKeyTile, kKeyTile * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, kt + 16 * d0 * kKeyTile + 16, kKeyTile * 4);
        _tile_dpbf16ps(1, 4, 6);
      }
      _tile_stored(0, c, kKeyTile * 4);
      _tile_stored(1, c + 16, kKeyTile * 4);
      for (int i = 0; i < m; ++i) {
        const __m512 a[2] = {_mm512_load_ps(c + i * kKeyTile),
                             _mm512_load_ps(c + i * kKeyTile + 16)};
        finish_scores(a, rb + i, t0, n, limit, scale, s, tmax);
      }
    });
  }

  // acc[r] = acc[r] * alpha[r] + P[r] . V for rows [r0, r1) of one head on AMX tiles (bfloat16
  // V, interleaved as interleave_v leaves it: the B tile, key pairs by 16 dimensions), in blocks
  // of m rows as scores_amx; P (rounded to bfloat16) is the A tile. Key pairs past the tile's n
  // are zeroed in `vi` first (interleave_v leaves them as they were; their weights are zero, but
  // 0 x NaN).
  static void values_amx(const float* s, const float* alpha, uint32_t* vi, int n, int r0, int r1,
                         float* acc) {
    const int m = std::min(16, r1 - r0);
    for (int q = (n + 1) / 2; q < kKeyTile / 2; ++q)
      std::memset(vi + q * D, 0, sizeof(uint32_t) * D);
    alignas(64) uint16_t pw[16][kKeyTile];
    alignas(64) float c[16 * D];
    amx_row_blocks(r0, r1, [&](int rb, int first_new) {
      for (int i = 0; i < m; ++i) weights_bf16(s + (rb + i) * kKeyTile, n, pw[i]);
      _tile_loadd(4, pw, kKeyTile * 2);
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
};

}  // namespace

#endif  // INFERD_AMX && __AVX512BF16__
