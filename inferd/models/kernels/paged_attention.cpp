// Paged attention over the flat, padding-free batch, reading K/V in place from the block table.
//
// Built by inferd/models/kernels/__init__.py into a plain shared library (no torch headers) and
// called through ctypes. Threads come from OpenMP; the library links libgomp.so.1, which resolves
// to the copy torch has already loaded, so the kernel shares torch's thread pool (no second pool
// spinning against it on a 2-core machine).
//
// Layouts (row-major, contiguous):
//   q, out     [T, Hq, D]                      float32 or bfloat16 (the model dtype)
//   kv_cache   [2, NB, block_size, Hkv, D]     float32, bfloat16, float8_e5m2 or int8 (K then V;
//                                              int8 rows are D + 4 bytes, their scale last)
//   tables     [S, table_stride] int32         block ids of each sequence
//   q_start, q_len, ctx_len  [S] int32         sequence s owns queries [q_start, q_start + q_len)
//                                              of the flat batch and ctx_len keys in the cache
// Query j of sequence s (0 <= j < q_len) sees keys [0, ctx_len - q_len + j]: decode is q_len = 1,
// a prefill chunk with a cached prefix is q_len = L. With a sliding window W > 0 it sees only the
// last W of them, keys (ctx_len - q_len + j - W, ctx_len - q_len + j] (Hugging Face's
// `kv_idx > q_idx - W`): an item's keys start at its first query's first visible key, so blocks
// wholly before the window are never read, and keys of a tile below a row's window are masked
// after its scores (mask_below_window), before the softmax. Attention sinks (gpt-oss: a logit per
// query head that joins its softmax's denominator, a key whose value is zero) enter once, where a
// row is written out (normaliser): the online softmax never sees them, so no path changes.
//
// Work item = (sequence, kv head, query tile, key split). The G = Hq / Hkv query heads sharing a
// KV head are G rows of one item, so each K/V row is read once per item (GQA without copies). A
// query tile holds at most kMaxRows rows. When there are few items (one long stream), keys are
// split too and the splits' partial softmax states are merged afterwards.
//
// Per item: keys go in tiles of kKeyTile (fewer where a tile of the item's heads would not fit
// in a quarter of L1: key_tile); a tile's K rows are found through the block table (float32: read
// in place; bf16 / fp8 / int8: widened into fp32 scratch, or read in place by a bfloat16 path),
// scores for every row are computed, then its V rows the same way, and the online-softmax update
// (running max m, running sum l, unnormalised accumulator acc) in fp32. This file is the op: the
// work split, the key tiles, the window, the softmax, the merge of key splits. The scores and P.V
// run per instruction set, on one of five paths (attention_item.h says what a path is), which
// run_item picks once per item, here and only here:
//
//   item                                    AVX-512 + VNNI    + AVX512_BF16     + AMX
//   float32 model, or a float32 / float8 / int8 cache:
//     < 16 rows (decode, verify steps)      F32Rows           F32Rows           F32Rows
//     >= 16 rows (prefill query tiles)      F32Tiles          F32Tiles          F32Tiles
//   bfloat16 model on a bfloat16 cache (head_dim a multiple of 32):
//     < 16 rows                             F32Rows           BF16Rows          BF16Rows
//     >= 16 rows                            F32Tiles          BF16Tiles         AmxTiles
//
// (rows: the item's queries x the G query heads of its kv heads.) F32Rows and F32Tiles are
// x86/avx512_attention.h's (queries widened and scaled, K/V float32, FMAs); BF16Rows and
// BF16Tiles x86/avx512bf16_attention.h's (K and V read in place, VDPBF16PS dot products, P
// rounded to bf16 for P.V as FlashAttention rounds it); AmxTiles x86/amx_attention.h's (BF16Tiles'
// two GEMMs on AMX tiles, turned off with the rest of the library's tiles by Gemv.amx). A Rows
// path computes a row's scores one key at a time (the cheapest form for a decode item's few rows,
// bound by reading K/V); a Tiles path runs scores and P.V as small GEMMs over the tile.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_item.h"
#include "simd.h"
#include "x86/amx_attention.h"
#include "x86/avx512_attention.h"
#include "x86/avx512bf16_attention.h"

namespace {

// Bytes of one key tile's K (or V) rows of an item's heads, as float32 (read in place, or widened
// into scratch): at most a quarter of L1.
constexpr int kTileBytes = 16 << 10;
constexpr int kMinSplitKeys = 128;
constexpr int kMaxSplits = 64;
// Query-key pairs (times query heads) under which one thread does the whole call. Low: the call
// runs right after the qkv projection, whose threads are still spinning, so the fork is cheap
// (one 265-key decode row of 8 heads: 17 -> 12 us with both threads).
constexpr int64_t kMinParallelWork = 256;

// ---- problem description -----------------------------------------------------------------------
struct Problem {
  void* out;
  const void* q;
  int act_dtype;
  const char* k_cache;
  const char* v_cache;
  int kv_dtype;
  int block_size, num_heads, num_kv_heads, head_dim;
  const int32_t* tables;
  int table_stride;
  const int32_t* q_start;
  const int32_t* q_len;
  const int32_t* ctx_len;
  float scale;
  int window;          // 0: none
  const float* sinks;  // [num_heads] fp32, one logit per query head in its softmax; null: none
};

// Rows of an item: kv heads [head, head + nh) x queries [j0, j1) x the G query heads of each,
// row r = ((hh * (j1 - j0)) + j) * G + g.
struct Item {
  int seq, head, nh, j0, j1;  // queries [j0, j1) of the sequence
  int k0, k1;             // keys [k0, k1)
  int64_t scratch;        // float offset of this split's partial state; -1: write out directly
};

struct Merge {
  int seq, head, nh, j0, j1, splits;
  int64_t scratch;  // first split's partial state; splits follow each other
};

inline int rows_per_query_tile(int g) { return std::max(1, kMaxRows / g); }
inline int item_rows(const Problem& p, int nh, int j0, int j1) {
  return nh * (j1 - j0) * (p.num_heads / p.num_kv_heads);
}

// ---- one work item -----------------------------------------------------------------------------
template <int NC>
struct Kernel {
  static constexpr int D = NC * 16;

  // locate, gather and TilePrefetch::plan run per key tile in every path's loop and are always
  // inlined there: called instead (GCC's choice once five paths instantiate the loop), decode
  // items ran 3-9 % slower (bench/kernel_ab.py's decode-96 cases, 1 thread).

  // Where the rows of keys [t0, t0 + n) of heads [head, ...) start in `plane` (n <= kKeyTile).
  // Block and offset advance incrementally (no division per key).
  static inline __attribute__((always_inline)) void locate(const Problem& p, const char* plane,
                                                          int seq, int head, int t0, int n,
                                                          const char** row) {
    const int64_t row_bytes = kv_row_bytes(p.kv_dtype, D);
    const int bs = p.block_size;
    const int32_t* table = p.tables + static_cast<int64_t>(seq) * p.table_stride;
    const int64_t tok_stride = p.num_kv_heads * row_bytes;
    const char* base = plane + head * row_bytes;
    int b = t0 / bs, off = t0 % bs;
    for (int i = 0; i < n; ++i) {
      row[i] = base + (static_cast<int64_t>(table[b]) * bs + off) * tok_stride;
      if (++off == bs) off = 0, ++b;
    }
  }

  // Row pointers to the K or V rows (`plane`: p.k_cache or p.v_cache) of keys [t0, t0 + n),
  // heads [head, head + nh): fp32 rows point into the cache (read in place); others are widened
  // into `buf` ([n][nh][D], int8 rows times their scale) once and shared by the G rows.
  static inline __attribute__((always_inline)) void gather(const Problem& p, const char* plane,
                                                          int seq, int head, int nh, int t0,
                                                          int n, float* buf, const float** row) {
    const char* at[kKeyTile];
    locate(p, plane, seq, head, t0, n, at);
    const int esz = static_cast<int>(dtype_size(p.kv_dtype));
    const int64_t row_bytes = kv_row_bytes(p.kv_dtype, D);
    for (int i = 0; i < n; ++i) {
      const char* src = at[i];
      if (p.kv_dtype == kF32) {
        row[i] = reinterpret_cast<const float*>(src);
        continue;
      }
      float* dst = buf + i * nh * D;
      row[i] = dst;
      if (p.kv_dtype != kI8) {  // heads D apart, as in the cache
        for (int c = 0; c < NC * nh; ++c)
          _mm512_store_ps(dst + c * 16, load16(src + c * 16 * esz, p.kv_dtype));
        continue;
      }
      for (int hh = 0; hh < nh; ++hh, src += row_bytes) {
        const __m512 scale = _mm512_set1_ps(row_scale(src, D));
        for (int c = 0; c < NC; ++c)
          _mm512_store_ps(dst + hh * D + c * 16, _mm512_mul_ps(load16(src + c * 16, kI8), scale));
      }
    }
  }

  // Software prefetch of one key tile's K and V lines (all the item's heads) into L2, issued a
  // slice at a time between the row passes of the tile before it. Blocks sit at random places in
  // the pool, 16 keys (a few KiB) each, so the hardware prefetchers lose the stream at every
  // block; one burst of prefetches for the whole tile instead stalls the core until the loads
  // drain, and the math and the memory take turns. Spread out, they overlap: decode attention
  // over 96 sequences went from 17 to 22.5 GB/s of K/V read (bench/kernel_ab.py,
  // docs/benchmarks.md).
  struct TilePrefetch {
    const char* k[kKeyTile];  // the tile's K rows (V rows are plane_off further)
    int64_t plane_off = 0;
    int lines_per_key = 0, lines = 0, issued = 0;

    // Rows of keys [t0, t1) of heads [head, head + nh).
    inline __attribute__((always_inline)) void plan(const Problem& p, int seq, int head, int nh,
                                                    int t0, int t1) {
      const int64_t row_bytes = kv_row_bytes(p.kv_dtype, D);
      locate(p, p.k_cache, seq, head, t0, t1 - t0, k);
      plane_off = p.v_cache - p.k_cache;
      lines_per_key = static_cast<int>((nh * row_bytes + 63) / 64);
      lines = (t1 - t0) * lines_per_key;
      issued = 0;
    }

    // Issue prefetches up to the (part + 1) / parts share of the tile's lines.
    void issue(int part, int parts) {
      for (const int upto = lines * (part + 1) / parts; issued < upto; ++issued) {
        const char* line = k[issued / lines_per_key] + (issued % lines_per_key) * 64;
        _mm_prefetch(line, _MM_HINT_T1);
        _mm_prefetch(line + plane_off, _MM_HINT_T1);
      }
    }
  };

  // Keys per tile for an item of `nh` kv heads. A tile stays within kTileBytes: for an item of 4
  // heads of 64, 16 keys (16 KiB) instead of 32, whose K and V (64 KiB) the row passes read back
  // from L2. Measured on decode with 96 sequences: 1.09x (float32 cache), 1.29x (bfloat16),
  // 1.12-1.17x (int8); with fewer heads the 32-key tile fits and is kept (16 keys measured
  // 0.86-0.94x there). A float32 cache read in place by a decode item goes 8 keys at a time: the
  // tile's K and V (16 KiB) and the next tile's, prefetched meanwhile, then fit L1 together
  // (bench/kernel_ab.py decode-96 1.03-1.08x; widened or bfloat16 tiles measured 0.92-1.02x at 8
  // keys, so they stay at 16).
  static int key_tile(int kv_dtype, int nh, bool tiled) {
    const bool narrow = kKeyTile * nh * D * 4 > kTileBytes;
    return !narrow                        ? kKeyTile
           : kv_dtype == kF32 && !tiled ? kKeyTile / 4
                                        : kKeyTile / 2;
  }

  // A tile's K or V rows as a path reads them: bfloat16 rows in place (as bytes), or float32 rows
  // (in place, or widened into `buf`).
  static void rows_of(const Problem& p, const char* plane, const Item& it, int t0, int n, float*,
                      const char** row) {
    locate(p, plane, it.seq, it.head, t0, n, row);
  }
  static void rows_of(const Problem& p, const char* plane, const Item& it, int t0, int n,
                      float* buf, const float** row) {
    gather(p, plane, it.seq, it.head, it.nh, t0, n, buf, row);
  }

  // The path of an item (this file's table), chosen once per item.
  static void run_item(const Problem& p, const Item& it, float* acc, float* m, float* l) {
    const bool tiled = item_rows(p, it.nh, it.j0, it.j1) >= kMinTiledRows;
#ifdef __AVX512BF16__
    if constexpr (D % 32 == 0) {
      if (p.kv_dtype == kBF16 && p.act_dtype == kBF16) {
        if (!tiled) return run<BF16Rows<NC>>(p, it, acc, m, l);
#if INFERD_AMX
        if (amx_on()) return run<AmxTiles<NC>>(p, it, acc, m, l);
#endif
        return run<BF16Tiles<NC>>(p, it, acc, m, l);
      }
    }
#endif
    if (tiled) return run<F32Tiles<NC>>(p, it, acc, m, l);
    run<F32Rows<NC>>(p, it, acc, m, l);
  }

  // Online softmax over keys [it.k0, it.k1) for rows of queries [it.j0, it.j1) x G heads, the
  // scores and P.V on `Path`. acc [R][D], m [R], l [R] are the item's state (unnormalised).
  template <class Path>
  static void run(const Problem& p, const Item& it, float* acc, float* m, float* l) {
    const int g = p.num_heads / p.num_kv_heads;
    const int nq = it.j1 - it.j0;
    const int qlen = p.q_len[it.seq];
    const int ctx = p.ctx_len[it.seq];
    const int esz = p.act_dtype == kF32 ? 4 : 2;
    ItemRows ir;
    ir.nh = it.nh;
    ir.per_head = nq * g;
    ir.rows = it.nh * ir.per_head;
    ir.scale = p.scale;
    const int rows = ir.rows;
    Path path(ir);
    for (int hh = 0; hh < it.nh; ++hh) {
      for (int j = 0; j < nq; ++j) {
        const int64_t tok = p.q_start[it.seq] + it.j0 + j;
        for (int h = 0; h < g; ++h) {
          const int r = (hh * nq + j) * g + h;
          const int64_t qh = static_cast<int64_t>(it.head + hh) * g + h;
          path.load_q(r, static_cast<const char*>(p.q) + (tok * p.num_heads + qh) * D * esz,
                      p.act_dtype);
          ir.limit[r] = ctx - qlen + it.j0 + j;
          ir.first[r] = p.window > 0 ? std::max(0, ir.limit[r] - p.window + 1) : 0;
          ir.hoff[r] = hh * D;
          m[r] = kNegInf;
          l[r] = 0.0f;
        }
      }
    }
    std::memset(acc, 0, sizeof(float) * rows * D);

    const int tile = key_tile(p.kv_dtype, it.nh, Path::kTiled);
    alignas(64) float buf[kKeyTile * kMaxItemWidth];  // widened K or V rows
    typename Path::Row kv[kKeyTile];
    alignas(64) float sc[kMaxRows * kKeyTile];
    float tmax[kMaxRows];   // each row's largest score in the current key tile
    float alpha[kMaxRows];  // each row's rescale factor for the tile (softmax_tile)
    TilePrefetch pf;
    pf.plan(p, it.seq, it.head, it.nh, it.k0, std::min(it.k1, it.k0 + tile));
    pf.issue(0, 1);  // the first tile has nothing to hide behind
    for (int t0 = it.k0; t0 < it.k1; t0 += tile) {
      const int n = std::min(tile, it.k1 - t0);
      rows_of(p, p.k_cache, it, t0, n, buf, kv);
      const int next = t0 + tile;
      pf.plan(p, it.seq, it.head, it.nh, next, std::min(it.k1, next + tile));
      path.scores(ir, kv, t0, n, sc, tmax, [&](int r) { pf.issue(r, 2 * rows); });
      if (t0 < ir.first[rows - 1]) mask_below_window(ir.first, rows, t0, n, sc, tmax);
      // V after every row's scores: a widened tile then reuses K's scratch, which stays in L1.
      rows_of(p, p.v_cache, it, t0, n, buf, kv);
      for (int r = 0; r < rows; ++r)
        alpha[r] = softmax_tile(sc + r * kKeyTile, tmax[r], n, m + r, l + r);
      path.values(ir, kv, t0, n, sc, alpha, acc, [&](int r) { pf.issue(rows + r, 2 * rows); });
    }
  }

  // Sliding window: scores of keys below a row's first visible key (first[r]) become -inf and
  // the row's tile max is taken again over the rest (-inf when none is left: the softmax step
  // then adds nothing). Rows' first keys ascend with r's query, so the last row's is the largest.
  static void mask_below_window(const int* first, int rows, int t0, int n, float* sc,
                                float* tmax) {
    for (int r = 0; r < rows; ++r) {
      const int cut = std::min(n, first[r] - t0);
      if (cut <= 0) continue;
      float* s = sc + r * kKeyTile;
      std::fill_n(s, cut, kNegInf);
      float mx = kNegInf;
      for (int i = cut; i < n; ++i) mx = std::max(mx, s[i]);
      tmax[r] = mx;
    }
  }

  // The online-softmax step of one row over a tile: s[0, n) becomes exp(s - new max), m and l
  // move to the new max; returns the factor the row's accumulator is rescaled by, or a negative
  // number when no key of the tile is visible to the row (nothing to add).
  static float softmax_tile(float* s, float tile_max, int n, float* m, float* l) {
    const float mx = std::max(*m, tile_max);
    if (mx == kNegInf) return -1.0f;  // no visible key in this tile
    const float alpha = *m == kNegInf ? 0.0f : std::exp(*m - mx);
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
      __mmask16 k = static_cast<__mmask16>(n - i >= 16 ? 0xffff : (1u << (n - i)) - 1);
      __m512 e = exp512(_mm512_sub_ps(_mm512_mask_loadu_ps(vmx, k, s + i), vmx));
      e = _mm512_maskz_mov_ps(k, e);
      _mm512_mask_storeu_ps(s + i, k, e);
      sum = _mm512_add_ps(sum, e);
    }
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = mx;
    return alpha;
  }
};

// The normaliser a row's unnormalised accumulator is multiplied by: 1 / l, and with a sink s (a
// key scored s whose value is zero) exp(m - M) / (l * exp(m - M) + exp(s - M)), M = max(m, s),
// which stays finite whatever s and m are. 0 for a row that saw no key and has no sink.
inline float normaliser(float m, float l, const float* sinks, int64_t qh) {
  if (sinks == nullptr) return l > 0.0f ? 1.0f / l : 0.0f;
  const float s = sinks[qh];
  const float mx = std::max(m, s);
  const float keep = m == kNegInf ? 0.0f : std::exp(m - mx);
  return keep / (l * keep + std::exp(s - mx));
}

void write_rows(const Problem& p, int seq, int head, int nh, int j0, int j1, const float* acc,
                const float* m, const float* l) {
  const int g = p.num_heads / p.num_kv_heads;
  const int d = p.head_dim;
  const int nq = j1 - j0;
  const int esz = p.act_dtype == kF32 ? 4 : 2;
  for (int hh = 0; hh < nh; ++hh) {
    for (int j = j0; j < j1; ++j) {
      const int64_t tok = p.q_start[seq] + j;
      for (int h = 0; h < g; ++h) {
        const int r = (hh * nq + (j - j0)) * g + h;
        const int64_t qh = static_cast<int64_t>(head + hh) * g + h;
        const __m512 inv = _mm512_set1_ps(normaliser(m[r], l[r], p.sinks, qh));
        char* dst = static_cast<char*>(p.out) + (tok * p.num_heads + qh) * d * esz;
        for (int i = 0; i < d; i += 16) {  // 16 at a time; bfloat16 rounded to nearest even
          const __mmask16 m = tail_mask(d - i);
          const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + r * d + i), inv);
          store16m(dst + i * esz, v, p.act_dtype, m);
        }
      }
    }
  }
}

// Combine the splits' (acc, m, l) into the final rows: weight split s by exp(m_s - max m).
void merge(const Problem& p, const Merge& mg, const float* base) {
  const int g = p.num_heads / p.num_kv_heads;
  const int d = p.head_dim;
  const int rows = item_rows(p, mg.nh, mg.j0, mg.j1);
  const int64_t split_size = static_cast<int64_t>(rows) * (d + 2);
  std::vector<float> acc(static_cast<size_t>(rows) * d, 0.0f), l(rows, 0.0f), m(rows, kNegInf);
  for (int r = 0; r < rows; ++r) {
    float& mx = m[r];
    for (int s = 0; s < mg.splits; ++s)
      mx = std::max(mx, base[mg.scratch + s * split_size + rows * d + r]);
    for (int s = 0; s < mg.splits; ++s) {
      const float* st = base + mg.scratch + s * split_size;
      const float ms = st[rows * d + r];
      if (ms == kNegInf) continue;  // no visible key in this split
      const float w = std::exp(ms - mx);
      l[r] += st[rows * d + rows + r] * w;
      for (int i = 0; i < d; ++i) acc[r * d + i] += st[r * d + i] * w;
    }
  }
  write_rows(p, mg.seq, mg.head, mg.nh, mg.j0, mg.j1, acc.data(), m.data(), l.data());
}

using ItemFn = void (*)(const Problem&, const Item&, float*, float*, float*);

ItemFn pick(int head_dim) {
  switch (head_dim) {
    case 16: return Kernel<1>::run_item;
    case 32: return Kernel<2>::run_item;
    case 64: return Kernel<4>::run_item;
    case 80: return Kernel<5>::run_item;
    case 96: return Kernel<6>::run_item;
    case 128: return Kernel<8>::run_item;
    case 256: return Kernel<16>::run_item;
    default: return nullptr;
  }
}

// Cut the batch into items: (seq, kv heads, query tile), and key splits when items are few. With
// work to spare, an item takes several kv heads (decode rows of one sequence): it then reads each
// token's [nh, D] K/V contiguously instead of one head's D of every Hkv * D.
void plan(const Problem& p, int num_seqs, int threads, std::vector<Item>& items,
          std::vector<Merge>& merges, int64_t& scratch_floats) {
  const int g = p.num_heads / p.num_kv_heads;
  const int qt = rows_per_query_tile(g);
  int base = 0;
  int max_ctx = 0;
  for (int s = 0; s < num_seqs; ++s) {
    base += (p.q_len[s] + qt - 1) / qt * p.num_kv_heads;
    max_ctx = std::max(max_ctx, p.window > 0 ? std::min(p.ctx_len[s], p.window) : p.ctx_len[s]);
  }
  int want = 1;
  if (threads > 1 && base < 4 * threads)
    want = std::min({(4 * threads + base - 1) / base, std::max(1, max_ctx / kMinSplitKeys),
                     kMaxSplits});
  const bool group_heads = base >= 8 * threads * p.num_kv_heads / 2;
  scratch_floats = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int qlen = p.q_len[s], ctx = p.ctx_len[s];
    for (int j0 = 0; j0 < qlen; j0 += qt) {
      const int j1 = std::min(qlen, j0 + qt);
      const int kend = ctx - qlen + j1;  // exclusive
      // The tile's first query's first visible key (a window skips the keys before it).
      const int kbeg = p.window > 0 ? std::max(0, ctx - qlen + j0 - p.window + 1) : 0;
      const int splits = std::min(want, std::max(1, (kend - kbeg) / kMinSplitKeys));
      int nh = 1;
      if (group_heads && splits == 1)
        nh = std::max(1, std::min({p.num_kv_heads, kMaxItemWidth / p.head_dim,
                                   kMaxRows / ((j1 - j0) * g)}));
      for (int h = 0; h < p.num_kv_heads; h += nh) {
        const int n_h = std::min(nh, p.num_kv_heads - h);
        if (splits == 1) {
          items.push_back({s, h, n_h, j0, j1, kbeg, kend, -1});
          continue;
        }
        const int64_t split_size =
            static_cast<int64_t>(item_rows(p, n_h, j0, j1)) * (p.head_dim + 2);
        merges.push_back({s, h, n_h, j0, j1, splits, scratch_floats});
        int per = (kend - kbeg + splits - 1) / splits;
        per = (per + kKeyTile - 1) / kKeyTile * kKeyTile;
        for (int sp = 0; sp < splits; ++sp) {
          const int k0 = std::min(kend, kbeg + sp * per);
          const int k1 = std::min(kend, kbeg + (sp + 1) * per);
          items.push_back({s, h, n_h, j0, j1, k0, k1, scratch_floats + sp * split_size});
        }
        scratch_floats += splits * split_size;
      }
    }
  }
}

}  // namespace

extern "C" {

int inferd_paged_attention_version() { return 3; }

// Returns 0, or -1 for an unsupported head_dim / dtype (the caller falls back to PyTorch).
// `window`: each query sees its last `window` keys only (0: every key before it). `sinks`: fp32
// [num_heads], a logit per query head that joins its softmax's denominator (gpt-oss); null: none.
int inferd_paged_attention(void* out, const void* q, int act_dtype, const void* kv_cache,
                           int kv_dtype, int64_t num_blocks, int block_size, int num_heads,
                           int num_kv_heads, int head_dim, const int32_t* tables, int table_stride,
                           const int32_t* q_start, const int32_t* q_len, const int32_t* ctx_len,
                           int num_seqs, float scale, int window, const float* sinks) {
  ItemFn fn = pick(head_dim);
  if (fn == nullptr || act_dtype < 0 || act_dtype > 1 || kv_dtype < 0 || kv_dtype > kI8 ||
      window < 0 ||
      num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > kMaxRows)
    return -1;
  const int64_t half = num_blocks * block_size * num_kv_heads * kv_row_bytes(kv_dtype, head_dim);
  const char* kc = static_cast<const char*>(kv_cache);
  Problem p{out,  q,        act_dtype, kc,         kc + half, kv_dtype, block_size, num_heads,
            num_kv_heads, head_dim, tables, table_stride, q_start, q_len, ctx_len, scale, window,
            sinks};
  const int threads = omp_get_max_threads();
  std::vector<Item> items;
  std::vector<Merge> merges;
  int64_t scratch_floats = 0;
  plan(p, num_seqs, threads, items, merges, scratch_floats);
  std::vector<float> scratch(static_cast<size_t>(scratch_floats));
  std::atomic<int> next{0}, next_merge{0};
  const int n_items = static_cast<int>(items.size());
  const int n_merges = static_cast<int>(merges.size());
  // Tiny batches run on the calling thread: waking the pool costs more than the work.
  int64_t work = 0;
  for (int s = 0; s < num_seqs; ++s)
    work += static_cast<int64_t>(q_len[s]) * (window > 0 ? std::min(ctx_len[s], window + q_len[s])
                                                         : ctx_len[s]);
  const int nthr = work * num_heads < kMinParallelWork ? 1 : std::min(threads, n_items);
#pragma omp parallel num_threads(nthr)
  {
    alignas(64) float acc[kMaxRows * 256];
    float m[kMaxRows], l[kMaxRows];
    for (int i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      if (it.scratch < 0) {
        fn(p, it, acc, m, l);
        write_rows(p, it.seq, it.head, it.nh, it.j0, it.j1, acc, m, l);
      } else {
        const int rows = item_rows(p, it.nh, it.j0, it.j1);
        float* st = scratch.data() + it.scratch;
        fn(p, it, st, st + rows * head_dim, st + rows * head_dim + rows);
      }
    }
    if (n_merges) {
#pragma omp barrier
      for (int i = next_merge.fetch_add(1); i < n_merges; i = next_merge.fetch_add(1))
        merge(p, merges[i], scratch.data());
    }
  }
  return 0;
}

}  // extern "C"
