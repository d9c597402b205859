// The panel GEMM's sums on AMX tiles, for CPUs that have them (Sapphire Rapids and later Xeons):
// bfloat16 (TDPBF16PS) and the greedy screen's int8 (TDPBUSD), over the same packed panels as the
// AVX-512 loop in panel.h, which stays the path everywhere else (and for float32: AMX has no
// float32 products).
//
// Why: on such a CPU (a 2-core Xeon VM, docs/benchmarks.md) the AVX-512 bfloat16 loop ran at
// 100-112 GFLOP/s a core with its weights in L2, the tiles at 700-965 from 16 rows (one
// TDPBF16PS is 16 x 16 x 32 multiply-adds); over the Qwen2-0.5B shape's decode weights the loop
// took 0.2-0.85x oneDNN's (AMX) GEMM time at 2-128 rows, the tiles 1.07-1.23x.
//
// Segments (panel.h's panel_sums_amx): more than 16 rows run as blocks of 16 over 32 KiB of the
// panel at a time, so the blocks after the first read their weight tiles from L1.
//
// The layouts already fit: a panel's step is 64 columns x 4 bytes of x (a bfloat16 pair or four
// int8 values per column) in 256 bytes, so 16 steps of 16 columns, read with a 256-byte stride,
// are exactly the VNNI-packed B tile (16 rows x 64 bytes) TDPBF16PS / TDPBUSD take, and 64 bytes
// of a row of x (the same 16 steps) are a row of the A tile. A panel's sums are 4 C tiles, 16
// columns each, of up to 16 rows: tiles 0-3 the sums, 4 the rows of x, 5-7 the weights.
//
// Rows: blocks of 16 at 0, 16, 32, ...; the last block ends at `rows`, overlapping the one before
// when rows is not a multiple of 16 (those rows are computed twice, identically), so every block
// has the same row count and one tile configuration serves the whole call. Steps past the last
// whole 16 (k not a multiple of 32 bfloat16 or 64 int8 values) are added by the AVX-512 tile.
//
// Tiles need the process's permission (arch_prctl ARCH_REQ_XCOMP_PERM, asked once) and each
// thread's own configuration: every parallel region that uses them configures them first and
// releases them at its end (oneDNN, which uses AMX on the same threads, configures its own).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#define INFERD_AMX 1
#else
#define INFERD_AMX 0
#endif

// Whether the panel loop runs on AMX: the build has it, the process was granted the tiles, and
// no one turned it off (`on` 0 / 1; -1 only reads). One switch for every file of the library
// (panel_gemm.cpp defines it): benchmarks and tests compare both paths in one process.
extern "C" int inferd_panel_amx(int on);

namespace {

inline bool amx_permitted() {
#if INFERD_AMX
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return ok;
#else
  return false;
#endif
}

inline bool amx_on() { return inferd_panel_amx(-1) != 0; }

// Calls f(start, first_new) for the blocks of m = min(16, r1 - r0) rows that cover rows [r0, r1):
// starting at r0, r0 + 16, ..., the last one ending at r1 (and overlapping the block before when
// the rows are not a multiple of 16, so every block has the same row count and one tile
// configuration serves them all). `first_new` is the block's first row no earlier block covered.
template <class F>
inline void amx_row_blocks(int r0, int r1, F f) {
  const int m = std::min(16, r1 - r0);
  for (int b = r0;; b += 16) {
    const int start = std::min(b, r1 - m);
    f(start, b);
    if (start + m >= r1) return;
  }
}

// What a panel's step type multiplies on tiles (panel.h's Step*::kAmx): none (float32), float32
// sums of bfloat16 pairs (TDPBF16PS), or int32 sums of u8 x s8 quads (TDPBUSD).
enum AmxDot : int { kAmxNone = 0, kAmxBF16 = 1, kAmxI8 = 2 };

#if INFERD_AMX

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's tiles for blocks of `m` rows: 0-3 sums (m x 16 x 4 bytes), 4 x (m x 64 bytes),
// 5-7 weights (16 steps x 64 bytes).
inline void amx_configure(int m) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(t < 5 ? m : 16);
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

inline void amx_release() { _tile_release(); }

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

inline void amx_configure(int) {}
inline void amx_release() {}
template <int Dot>
inline void amx_block(const void*, int64_t, const void*, int64_t, int64_t, float*, bool) {}

#endif  // INFERD_AMX

}  // namespace
