// A paged-attention work item as the per-instruction-set paths see it: the op (work split, the
// key tiles through the block table, the online softmax) is paged_attention.cpp, the paths are
// x86/avx512_attention.h, x86/avx512bf16_attention.h and x86/amx_attention.h.
//
// A path is a class template on NC (head_dim = 16 NC) that holds an item's queries and, per key
// tile, computes every row's scores and then its P.V:
//
//   using Row = const float* | const char*;  how it reads K and V rows: float32 (in place in a
//                                            float32 cache, else widened by the op into scratch)
//                                            or bfloat16 rows in place in the cache
//   static constexpr bool kTiled;            an item of kMinTiledRows rows or more (the op's key
//                                            tile size depends on it)
//   explicit Path(const ItemRows&);          the rows' count (AMX configures its tiles here)
//   void load_q(int r, const char* q, int dtype);  row r's query (D values of the model dtype)
//   void scores(const ItemRows&, const Row* k, int t0, int n, float* s, float* tmax, Issue);
//       row r's scores of keys [t0, t0 + n) into s + r * kKeyTile, times the scale, -inf past the
//       row's limit; tmax[r] the largest (-inf when no key is visible)
//   void values(const ItemRows&, const Row* v, int t0, int n, float* s, float* alpha,
//               float* acc, Issue);
//       acc[r] = acc[r] * alpha[r] + P[r] . V, P[r] the row's weights in s (the op's softmax
//       step has made them exp(score - max)); a row with alpha[r] < 0 has seen no key yet and
//       keeps its accumulator
//
// `Issue` is called with each row (or a block's last row) r before its work: the op then issues
// its share of the software prefetch of the next tile, spread over the two passes' rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace {

constexpr int kKeyTile = 32;       // keys per tile (fewer where an item's heads are wide)
constexpr int kMaxRows = 64;       // rows of an item
constexpr int kMaxItemWidth = 512;  // floats of K (and of V) per key an item reads: nh * D
constexpr int kMinTiledRows = 16;  // an item with fewer rows takes a per-row path
constexpr float kNegInf = -INFINITY;

// Rows of an item: kv heads [head, head + nh) x queries x the G query heads of each,
// row r = (hh * queries + j) * G + g, per_head = queries x G rows per kv head.
struct ItemRows {
  int rows, nh, per_head;
  float scale;          // the softmax scale
  int limit[kMaxRows];  // last key index (inclusive) each row may see
  int first[kMaxRows];  // first key index each row may see (> 0 only with a window)
  int hoff[kMaxRows];   // the row's kv head, as a float offset from the item's first
};

// Calls f(std::integral_constant<int, RB>{}, r0) over rows [r0, r1) in blocks of RB (the rest
// one by one, as blocks of 1).
template <int RB, typename F>
inline void row_blocks(int r0, int r1, F f) {
  int r = r0;
  for (; r + RB <= r1; r += RB) f(std::integral_constant<int, RB>{}, r);
  for (; r < r1; ++r) f(std::integral_constant<int, 1>{}, r);
}

// The tiled paths' P.V over each kv head's rows in blocks of RB: issue(the block's last row), then
// f(std::integral_constant<int, RB or 1>{}, hh, r0, upto), upto the most keys of the tile any row
// of the block [r0, r0 + RB) sees.
template <int RB, class Issue, class F>
inline void value_blocks(const ItemRows& ir, int t0, int n, Issue issue, F f) {
  for (int hh = 0; hh < ir.nh; ++hh)
    row_blocks<RB>(hh * ir.per_head, (hh + 1) * ir.per_head, [&](auto rb, int r0) {
      int upto = 0;
      for (int k = 0; k < rb.value; ++k)
        upto = std::max(upto, std::min(n, ir.limit[r0 + k] - t0 + 1));
      issue(r0 + rb.value - 1);
      f(rb, hh, r0, upto);
    });
}

// The tiled paths' P.V runs whole blocks of rows: a row that saw no key yet (alpha < 0) gets
// weights 0 and alpha 1, so its accumulator stays as it is.
inline void keep_unseen(int rows, float* s, float* alpha) {
  for (int r = 0; r < rows; ++r)
    if (alpha[r] < 0.0f) {
      std::fill_n(s + r * kKeyTile, kKeyTile, 0.0f);
      alpha[r] = 1.0f;
    }
}

}  // namespace
