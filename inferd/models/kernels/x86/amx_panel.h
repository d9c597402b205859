// The panel GEMM's sums on AMX tiles, for CPUs that have them (Sapphire Rapids and later Xeons):
// bfloat16 (TDPBF16PS) and the greedy screen's int8 (TDPBUSD), over the same packed panels as the
// AVX-512 loop (x86/avx512_panel.h), which stays the path everywhere else (and for float32: AMX
// has no float32 products). The tiles' permission, configuration and row blocks, which attention
// shares, are in amx.h.
//
// Why: on such a CPU (a 2-core Xeon VM, docs/benchmarks.md) the AVX-512 bfloat16 loop ran at
// 100-112 GFLOP/s a core with its weights in L2, the tiles at 700-965 from 16 rows (one
// TDPBF16PS is 16 x 16 x 32 multiply-adds); over the Qwen2-0.5B shape's decode weights the loop
// took 0.2-0.85x oneDNN's (AMX) GEMM time at 2-128 rows, the tiles 1.07-1.23x.
//
// The layouts already fit: a panel's step is 64 columns x 4 bytes of x (a bfloat16 pair or four
// int8 values per column) in 256 bytes, so 16 steps of 16 columns, read with a 256-byte stride,
// are exactly the VNNI-packed B tile (16 rows x 64 bytes) TDPBF16PS / TDPBUSD take, and 64 bytes
// of a row of x (the same 16 steps) are a row of the A tile. A panel's sums are 4 C tiles, 16
// columns each, of up to 16 rows: tiles 0-3 the sums, 4 the rows of x, 5-7 the weights.
//
// Rows: blocks of 16 (amx.h's amx_row_blocks), the last one overlapping the one before, so one
// tile configuration serves the whole call. Steps past the last whole 16 (k not a multiple of 32
// bfloat16 or 64 int8 values) are added by the AVX-512 tile.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "avx512_panel.h"

namespace {

// What a panel's step type multiplies on tiles: none (float32), float32 sums of bfloat16 pairs
// (TDPBF16PS), or int32 sums of u8 x s8 quads (TDPBUSD).
enum AmxDot : int { kAmxNone = 0, kAmxBF16 = 1, kAmxI8 = 2 };

// Which tile product a step type takes and from how many rows.
template <class S>
struct AmxPanel {
  static constexpr int kDot = kAmxNone;
  static constexpr int kMinRows = 0;
};
template <>
struct AmxPanel<StepBF16> {
  static constexpr int kDot = kAmxBF16;
  static constexpr int kMinRows = 1;
};
template <>
struct AmxPanel<StepI8> {
  static constexpr int kDot = kAmxI8;
  // Below this many rows the screen's int8 weights stream no faster on tiles: on the Qwen2-0.5B
  // shape's lm_head (bench/greedy_head.py) AMX took 1.06-1.28x the AVX-512 loop's time at 1-8
  // rows in a first run, 0.96x at 12 rows and 0.66-0.94x at 16-64 (docs/benchmarks.md).
  static constexpr int kMinRows = 12;
};

#if INFERD_AMX

// The tile product of `Dot` (the intrinsics paste their tile numbers into the instruction, so
// they must be literals, not template arguments).
#define INFERD_AMX_DOT(Dot, C, A, B) \
  if constexpr (Dot == kAmxBF16)     \
    _tile_dpbf16ps(C, A, B);         \
  else                               \
    _tile_dpbusd(C, A, B)

// acc[0, m) x 64 (row stride 64 floats) (+)= m rows of x (`x`, rows `x_stride` bytes apart) .
// the panel `wp`'s chunks [c0, c1) (16 steps each); `first`: = rather than +=.
template <int Dot>
inline void amx_block(const void* x, int64_t x_stride, const void* wp, int64_t c0, int64_t c1,
                      float* acc, bool first) {
  constexpr int64_t kChunkBytes = 16 * 256;  // 16 steps of the panel
  const char* xb = static_cast<const char*>(x);
  const char* wb = static_cast<const char*>(wp) + c0 * kChunkBytes;
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, acc, 256);
    _tile_loadd(1, acc + 16, 256);
    _tile_loadd(2, acc + 32, 256);
    _tile_loadd(3, acc + 48, 256);
  }
  for (int64_t i = c0; i < c1; ++i, wb += kChunkBytes) {
    _tile_loadd(4, xb + 64 * i, x_stride);
    _tile_loadd(5, wb, 256);
    INFERD_AMX_DOT(Dot, 0, 4, 5);
    _tile_loadd(6, wb + 64, 256);
    INFERD_AMX_DOT(Dot, 1, 4, 6);
    _tile_loadd(7, wb + 128, 256);
    INFERD_AMX_DOT(Dot, 2, 4, 7);
    _tile_loadd(5, wb + 192, 256);
    INFERD_AMX_DOT(Dot, 3, 4, 5);
  }
  _tile_stored(0, acc, 256);
  _tile_stored(1, acc + 16, 256);
  _tile_stored(2, acc + 32, 256);
  _tile_stored(3, acc + 48, 256);
}

#else  // never called: amx_on() is false without AMX

template <int Dot>
inline void amx_block(const void*, int64_t, const void*, int64_t, int64_t, float*, bool) {}

#endif  // INFERD_AMX

// Chunks (16 steps, 4 KiB of weights) per segment when several row blocks share a panel.
constexpr int64_t kAmxSegmentChunks = 8;

// panel_sums on AMX tiles, in blocks of min(rows, 16) rows, the last one ending at `rows`; the
// caller configured this thread's tiles for that block (amx_use). Steps past the last whole 16
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
      amx_block<AmxPanel<S>::kDot>(x + r0 * x_stride, xs, wp, c0, std::min(chunks, c0 + seg),
                                   out, c0 == 0);
    });
  if (last_b0 >= 0)
    std::memcpy(acc + last_b0 * kPanel, last + (last_b0 - last_r0) * kPanel,
                sizeof(float) * kPanel * (rows - last_b0));
  panel_tail_sums<S>(x, rows, x_stride, w, steps, p, done, acc);
}

// Whether a call's panel sums run on AMX (a step type it has, enough rows, at least 16 steps,
// AMX on); if so, configures this thread's tiles for the call (the caller releases them,
// amx_release). Every thread of a parallel region gets the same answer.
template <class S>
inline bool amx_use(int rows, int64_t steps) {
  if (AmxPanel<S>::kDot == kAmxNone || rows < AmxPanel<S>::kMinRows || steps < 16 || !amx_on())
    return false;
  amx_configure(std::min(rows, 16));
  return true;
}

}  // namespace
