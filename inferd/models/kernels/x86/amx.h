// AMX tiles, for CPUs that have them (Sapphire Rapids and later Xeons): the process's permission,
// each thread's tile configuration and the blocks of 16 rows that one configuration serves. Shared
// by the panel GEMM on tiles (x86/amx_panel.h: bfloat16 and the greedy screen's int8) and the
// prefill attention items on tiles (x86/amx_attention.h); every use of the tiles is in an
// x86/amx_*.h header. The whole library builds without AMX too: everything that uses tiles is
// under INFERD_AMX, and amx_on() is false without it.
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

#else  // never called: amx_on() is false without AMX

inline void amx_configure(int) {}
inline void amx_release() {}

#endif  // INFERD_AMX

}  // namespace
