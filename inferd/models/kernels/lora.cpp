// The LoRA adapters' term of one linear layer over a step's rows, many adapters at once (S-LoRA's
// SGMV / Punica's BGMV on CPU; inferd/lora/layer.py is the PyTorch reference):
//
//   for each segment s (one adapter, its rows):   y[rows_s] += (x[rows_s] At_s) Bt_s
//
// Layouts (row-major; x, y, At, Bt in the model dtype, float32 or bfloat16):
//   x [T, in] (row stride ldx), y [T, out] (row stride ldy), updated in place
//   segment s: rows[seg_off[s] .. seg_off[s+1]) of the flat batch, adapter slot seg_slot[s]
//   slot p: At [in, w_p], Bt [w_p, out], spans [w_p][2]: the columns [lo, hi) where rank row j of
//           Bt may be non-zero (the shard it belongs to: adapter.py packs q/k/v or gate/up as
//           blocks); j outside a column block's span is skipped
//   scratch [total rows, ld_v] float32: each row's x At
//
// Two phases in one parallel region: (1) x At, threads over blocks of up to 4 rows of one
// segment; (2) y += v Bt, threads over 64-column blocks of y, each streaming its columns of every
// segment's Bt once per 4 rows. Both register-block 4 rows x 4 vectors, so At and Bt are read
// from cache once per 4 rows. Sums in float32; for bfloat16 v is rounded to bfloat16 between the
// phases and y once at the end, as torch's mm then addmm_ round (layer.py).
//
// Why native: between the other native kernels, each small torch GEMM measured 4-8x slower per
// call on two threads than on one (the thread pools hand over), so the PyTorch path runs on one
// thread; this runs on torch's own OpenMP pool, both threads, one call per layer.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace {

constexpr int kRows = 4;      // rows register-blocked together
constexpr int kVecs = 4;      // 16-float vectors per block of columns (64 columns)
constexpr int kCols = 16 * kVecs;
constexpr int64_t kMinParallelWork = 1 << 16;  // multiply-adds under which one thread does it

struct Args {
  const char* x;
  int64_t ldx;
  char* y;
  int64_t ldy;
  int dtype;
  int64_t in, out;
  int64_t nseg;
  const int32_t* seg_slot;
  const int64_t* seg_off;
  const int64_t* rows;
  const void* const* at;
  const void* const* bt;
  const int32_t* const* spans;
  const int32_t* width;
  float* v;
  int64_t ld_v;
};

// The first `left` lanes (none when left <= 0, all from 16).
inline __mmask16 lanes(int64_t left) { return left <= 0 ? 0 : tail_mask(left); }

inline float scalar(const char* p, int dtype) {
  if (dtype == kF32) return *reinterpret_cast<const float*>(p);
  uint32_t u = static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// v[r0 + i][j0 .. j0 + 64) = x[rows[r0 + i]] At[:, j0 .. j0 + 64) for i < R (masked past w).
template <int R>
void shrink_block(const Args& a, int64_t r0, const char* at, int64_t w, int64_t j0) {
  const int64_t es = dtype_size(a.dtype);
  __mmask16 m[kVecs];
  for (int q = 0; q < kVecs; ++q) m[q] = lanes(w - j0 - 16 * q);
  __m512 acc[R][kVecs];
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < kVecs; ++q) acc[i][q] = _mm512_setzero_ps();
  const char* xr[R];
  for (int i = 0; i < R; ++i) xr[i] = a.x + a.rows[r0 + i] * a.ldx * es;
  for (int64_t k = 0; k < a.in; ++k) {
    __m512 b[kVecs];
    for (int q = 0; q < kVecs; ++q)
      b[q] = m[q] ? load16m(at + (k * w + j0 + 16 * q) * es, a.dtype, m[q]) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_set1_ps(scalar(xr[i] + k * es, a.dtype));
      for (int q = 0; q < kVecs; ++q) acc[i][q] = _mm512_fmadd_ps(xv, b[q], acc[i][q]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < kVecs; ++q)
      if (m[q])
        _mm512_mask_storeu_ps(a.v + (r0 + i) * a.ld_v + j0 + 16 * q, m[q],
                              as_dtype(acc[i][q], a.dtype));
}

// y[rows[r0 + i]][c0 .. c0 + 64) += v[r0 + i] Bt[:, c0 .. c0 + 64) for i < R.
template <int R>
void expand_block(const Args& a, int64_t r0, const char* bt, const int32_t* spans, int64_t w,
                  int64_t c0) {
  const int64_t es = dtype_size(a.dtype);
  __mmask16 m[kVecs];
  for (int q = 0; q < kVecs; ++q) m[q] = lanes(a.out - c0 - 16 * q);
  __m512 acc[R][kVecs];
  for (int i = 0; i < R; ++i)
    for (int q = 0; q < kVecs; ++q) acc[i][q] = _mm512_setzero_ps();
  bool touched = false;
  for (int64_t j = 0; j < w; ++j) {
    if (spans[2 * j + 1] <= c0 || spans[2 * j] >= c0 + kCols) continue;
    touched = true;
    __m512 b[kVecs];
    for (int q = 0; q < kVecs; ++q)
      b[q] = m[q] ? load16m(bt + (j * a.out + c0 + 16 * q) * es, a.dtype, m[q]) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) {
      const __m512 vj = _mm512_set1_ps(a.v[(r0 + i) * a.ld_v + j]);
      for (int q = 0; q < kVecs; ++q) acc[i][q] = _mm512_fmadd_ps(vj, b[q], acc[i][q]);
    }
  }
  if (!touched) return;
  for (int i = 0; i < R; ++i) {
    char* yr = a.y + a.rows[r0 + i] * a.ldy * es;
    for (int q = 0; q < kVecs; ++q) {
      if (!m[q]) continue;
      char* p = yr + (c0 + 16 * q) * es;
      store16m(p, _mm512_add_ps(load16m(p, a.dtype, m[q]), acc[i][q]), a.dtype, m[q]);
    }
  }
}

// Row blocks of each segment: (segment, first row, rows in the block <= kRows).
struct RowBlock {
  int64_t seg, r0;
  int n;
};

void shrink(const Args& a, const RowBlock& b, int64_t j0) {
  const int32_t p = a.seg_slot[b.seg];
  const char* at = static_cast<const char*>(a.at[p]);
  const int64_t w = a.width[p];
  switch (b.n) {
    case 4: shrink_block<4>(a, b.r0, at, w, j0); break;
    case 3: shrink_block<3>(a, b.r0, at, w, j0); break;
    case 2: shrink_block<2>(a, b.r0, at, w, j0); break;
    default: shrink_block<1>(a, b.r0, at, w, j0); break;
  }
}

void expand(const Args& a, const RowBlock& b, int64_t c0) {
  const int32_t p = a.seg_slot[b.seg];
  const char* bt = static_cast<const char*>(a.bt[p]);
  const int64_t w = a.width[p];
  switch (b.n) {
    case 4: expand_block<4>(a, b.r0, bt, a.spans[p], w, c0); break;
    case 3: expand_block<3>(a, b.r0, bt, a.spans[p], w, c0); break;
    case 2: expand_block<2>(a, b.r0, bt, a.spans[p], w, c0); break;
    default: expand_block<1>(a, b.r0, bt, a.spans[p], w, c0); break;
  }
}

}  // namespace

extern "C" {

// Returns 0, or -1 for arguments it does not take (the caller then runs layer.py's path).
int inferd_lora_sgmv(const void* x, int64_t ldx, void* y, int64_t ldy, int dtype, int64_t in,
                     int64_t out, int64_t nseg, const int32_t* seg_slot, const int64_t* seg_off,
                     const int64_t* rows, const void* const* at, const void* const* bt,
                     const int32_t* const* spans, const int32_t* width, float* v,
                     int64_t ld_v) {
  if ((dtype != kF32 && dtype != kBF16) || in <= 0 || out <= 0 || nseg < 0) return -1;
  const Args a{static_cast<const char*>(x), ldx, static_cast<char*>(y), ldy, dtype, in, out,
               nseg, seg_slot, seg_off, rows, at, bt, spans, width, v, ld_v};
  RowBlock blocks_buf[256];
  std::vector<RowBlock> heap;
  int64_t nblocks = 0, work = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t w = width[seg_slot[s]];
    if (w <= 0) continue;
    if (w > ld_v) return -1;
    nblocks += (seg_off[s + 1] - seg_off[s] + kRows - 1) / kRows;
    work += (seg_off[s + 1] - seg_off[s]) * w * (in + out);
  }
  RowBlock* blocks = blocks_buf;
  if (nblocks > 256) {
    heap.resize(nblocks);
    blocks = heap.data();
  }
  int64_t nb = 0;
  for (int64_t s = 0; s < nseg; ++s) {
    if (width[seg_slot[s]] <= 0) continue;
    for (int64_t r = seg_off[s]; r < seg_off[s + 1]; r += kRows)
      blocks[nb++] = RowBlock{s, r, static_cast<int>(std::min<int64_t>(kRows, seg_off[s + 1] - r))};
  }
  const int64_t col_blocks = (out + kCols - 1) / kCols;
#pragma omp parallel if (work >= kMinParallelWork)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t w = width[seg_slot[blocks[i].seg]];
      for (int64_t j0 = 0; j0 < w; j0 += kCols) shrink(a, blocks[i], j0);
    }
    // (the implicit barrier: every v is written before any is read)
#pragma omp for schedule(static)
    for (int64_t c = 0; c < col_blocks; ++c)
      for (int64_t i = 0; i < nb; ++i) expand(a, blocks[i], c * kCols);
  }
  return 0;
}

}  // extern "C"
