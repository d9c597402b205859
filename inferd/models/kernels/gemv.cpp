// Few-row linear layers on the plain weight: y = x W^T (+ b) for 1 <= rows <= kMaxGroupedRows
// (int8: kMaxRows).
//
//   inferd_gemv   x [rows, x_stride], W [n, k] row-major contiguous, b [n] or null,
//                 y [rows, y_stride]; all in one dtype (float32 or bfloat16), float32 arithmetic
//   inferd_gemv_int8  the same over an int8 W with one float32 scale per output row (symmetric,
//                 as `--quantization int8` quantizes), its rows' integer sums, a float32 bias;
//                 x and y in the model dtype. Each x row is quantized to uint8 from its own range
//                 (asymmetric, like the batched int8 GEMM's dynamic activations) and the dot
//                 products run on VNNI (u8 x s8 summed in int32); y = sx * sw * (dot - zx * sum w)
//
// Why: a single stream (and any decode step of a few sequences) reads every weight once per token
// and does almost no arithmetic with it, so its speed is the rate the weights stream from memory.
// oneDNN's matmul on its prepacked (blocked) weight streams it at ~20 GB/s here for one row; this
// loop over the plain row-major weight at ~25 GB/s (2 threads, the whole llama-32m weight set,
// alternating in one process; the same loop in a C++ program alone 28-31 GB/s, the machine's copy
// bandwidth 31-35 GB/s), see docs/benchmarks.md. The engine keeps the plain
// weight beside the packed one for it (models/linear.py says when).
//
// Layout of the work: 4 weight rows at a time (4 streams the hardware prefetcher follows, plus a
// software prefetch ~8 KiB ahead into L2; 2 weight rows past 4 x rows, kBlockRows), each weight
// vector loaded once and multiplied into every x row, so x rows past the first cost no extra
// memory traffic. Each thread takes one contiguous range of blocks: measured in a C++ loop over the llama-32m / Qwen2-0.5B weight sets,
// static 41 / 32.4 GB/s, dynamic grabs of 16 blocks 32 / 30.2, guided 35 / 30.8 (one long stream
// per thread prefetches best; a thread preempted by another process does delay the call, which
// dynamic would absorb).
// Accumulation is float32 in 16 lanes, reduced at the end of the row (a different summation order
// than oneDNN's; both are float32 sums). bfloat16 values are widened on load and y is rounded once
// (as oneDNN's bf16 matmul rounds its float32 accumulator).
//
// bfloat16 from kDotMinRows rows on (with AVX512_BF16): the same layout on dot products
// (vdpbf16ps: two bf16 products summed into each float32 lane, 32 weights a step), up to
// kDotMaxRows rows. With a few rows the widened loop above is bound by its arithmetic, not by the
// memory: over the Qwen2-0.5B shape's decode weights (2 threads, bench/gemv_rows.py) 6 rows took
// 47.8 ms widened and 29.8 on dot products, and oneDNN's prepacked GEMM 43.9 ms at 8 rows and 54.0
// at 16 against 36.4 and 53.8 here; at 24 rows oneDNN is as fast (docs/benchmarks.md). Tiles of
// 4 weight rows x up to 6 x rows (24 accumulators); each x row's 4 sums reduce together.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

constexpr int kMaxRows = 8;
// Float rows past kMaxRows run as two groups (a block of kMaxRows, then the rest).
constexpr int kMaxGroupedRows = 2 * kMaxRows;
// bfloat16 rows [kDotMinRows, kDotMaxRows] run on dot products (above: oneDNN's GEMM is as fast).
constexpr int kDotMinRows = 3;
constexpr int kDotMaxRows = 16;
// Output rows per block: up to 4 x rows, 4 weight rows share each x load (4 * R accumulators);
// past 4 x rows those would not fit the 32 vector registers beside the x vectors, so 2.
template <int R>
constexpr int kBlockRows = R <= 4 ? 4 : 2;
// Each weight row's stream is prefetched this far ahead into L2 (T1): into L1 (T0) the lines
// displaced the ones being read; measured over whole weight sets, 2 threads: float32 llama-32m
// 30 -> 37.5 GB/s, Qwen2-0.5B 29.5 -> 32.6; int8 Qwen2-0.5B 20 -> 31 (fbgemm 31.5).
constexpr int64_t kPrefetchBytes = 8192;
constexpr int64_t kMinParallelElems = 1 << 15;

inline const char* byte_at(const void* base, int64_t elems, int64_t esz) {
  return static_cast<const char*>(base) + elems * esz;
}

// y[i] = v in the dtype (bfloat16 rounded to nearest even, once).
template <int DT>
inline void store1(void* y, int64_t i, float v) {
  if (DT == kF32) {
    std::memcpy(static_cast<char*>(y) + i * 4, &v, 4);
  } else {
    const uint16_t h = f32_to_bf16(v);
    std::memcpy(static_cast<char*>(y) + i * 2, &h, 2);
  }
}

// y[r, n0 .. n0 + NB) for R rows of x; NB = kBlockRows<R> (a block) or 1 (the last rows). The
// dtype is a template argument so the inner loop has no branch; full 16-lane steps run unmasked.
template <int R, int NB, int DT>
inline void block(const void* x, int64_t x_stride, const void* w, int64_t k, const void* bias,
                  void* y, int64_t y_stride, int64_t n0) {
  constexpr int64_t esz = DT == kF32 ? 4 : 2;
  __m512 acc[NB][R];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  const char* wrow[NB];
  const char* xrow[R];
  for (int j = 0; j < NB; ++j) wrow[j] = byte_at(w, (n0 + j) * k, esz);
  for (int r = 0; r < R; ++r) xrow[r] = byte_at(x, r * x_stride, esz);
  const int64_t full = k & ~int64_t{15};
  for (int64_t i = 0; i < full; i += 16) {
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = load16(xrow[r] + i * esz, DT);
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(wrow[j] + i * esz + kPrefetchBytes, _MM_HINT_T1);
      const __m512 wv = load16(wrow[j] + i * esz, DT);
      for (int r = 0; r < R; ++r) acc[j][r] = _mm512_fmadd_ps(wv, xv[r], acc[j][r]);
    }
  }
  if (full < k) {
    const __mmask16 m = tail_mask(k - full);
    for (int j = 0; j < NB; ++j) {
      const __m512 wv = load16m(wrow[j] + full * esz, DT, m);
      for (int r = 0; r < R; ++r)
        acc[j][r] = _mm512_fmadd_ps(wv, load16m(xrow[r] + full * esz, DT, m), acc[j][r]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    float b = 0.0f;
    if (bias != nullptr) b = _mm512_cvtss_f32(load16m(byte_at(bias, n0 + j, esz), DT, 1));
    for (int r = 0; r < R; ++r) {
      store1<DT>(y, r * y_stride + n0 + j, _mm512_reduce_add_ps(acc[j][r]) + b);
    }
  }
}

// ---- int8 weights ----------------------------------------------------------------------------

struct Int8Rows {
  const uint8_t* q;  // [R][kpad]
  int64_t kpad;
  float scale[kMaxRows];
  int32_t zero[kMaxRows];
};

// y[r, n0 .. n0 + NB) from 64 int8 weights a step (one vpdpbusd each per x row).
template <int R, int NB, int DT>
inline void block_int8(const Int8Rows& xr, const int8_t* w, int64_t k, const float* w_scale,
                       const int32_t* w_sum, const float* bias, void* y, int64_t y_stride,
                       int64_t n0) {
  __m512i acc[NB][R];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_si512();
  const int8_t* wrow[NB];
  for (int j = 0; j < NB; ++j) wrow[j] = w + (n0 + j) * k;
  for (int64_t i = 0; i < k; i += 64) {
    const __mmask64 m = k - i >= 64 ? ~__mmask64{0} : (__mmask64{1} << (k - i)) - 1;
    __m512i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_si512(xr.q + r * xr.kpad + i);
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(wrow[j] + i) + kPrefetchBytes, _MM_HINT_T1);
      const __m512i wv = _mm512_maskz_loadu_epi8(m, wrow[j] + i);
      for (int r = 0; r < R; ++r) acc[j][r] = dpbusd(acc[j][r], xv[r], wv);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t o = n0 + j;
    const float b = bias != nullptr ? bias[o] : 0.0f;
    for (int r = 0; r < R; ++r) {
      const int32_t dot = _mm512_reduce_add_epi32(acc[j][r]) - xr.zero[r] * w_sum[o];
      store1<DT>(y, r * y_stride + o, xr.scale[r] * w_scale[o] * static_cast<float>(dot) + b);
    }
  }
}

// ---- bfloat16 dot products (AVX512_BF16) ----------------------------------------------------

#ifdef __AVX512BF16__
constexpr int kDotWeightRows = 4;  // weight rows per tile
// x rows per tile: 4 x 6 accumulators, 4 weights and 1 x in the 32 vector registers.
constexpr int kDotXRows = 6;

// The 4 float32 lanes' sum of 16 lanes, as a 128-bit vector's partial sums.
inline __m128 fold(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The horizontal sums of 4 vectors, in order (values, not an array: the accumulators stay in
// registers).
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  return _mm_hadd_ps(_mm_hadd_ps(fold(a), fold(b)), _mm_hadd_ps(fold(c), fold(d)));
}

// One step of 32 weights for R rows of x: `m` masks the last, partial step.
template <int R, int B, bool Masked>
inline void dot_step(const uint16_t* x, int64_t x_stride, const uint16_t* const (&wrow)[B],
                     int64_t i, __mmask32 m, __m512 (&acc)[R][B]) {
  __m512bh wv[B];
  for (int j = 0; j < B; ++j) {
    if (Masked) {
      wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, wrow[j] + i);
    } else {
      _mm_prefetch(reinterpret_cast<const char*>(wrow[j] + i) + kPrefetchBytes, _MM_HINT_T1);
      wv[j] = (__m512bh)_mm512_loadu_si512(wrow[j] + i);
    }
  }
  for (int r = 0; r < R; ++r) {
    const uint16_t* xp = x + r * x_stride + i;
    const __m512bh xv = Masked ? (__m512bh)_mm512_maskz_loadu_epi16(m, xp)
                               : (__m512bh)_mm512_loadu_si512(xp);
    for (int j = 0; j < B; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
  }
}

// y[r, n0 .. n0 + B) for R rows of x (bfloat16), 32 weights of each row a step.
template <int R, int B>
inline void dot_tile(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t k,
                     const uint16_t* bias, uint16_t* y, int64_t y_stride, int64_t n0) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* wrow[B];
  for (int j = 0; j < B; ++j) wrow[j] = w + (n0 + j) * k;
  const int64_t full = k & ~int64_t{31};
  for (int64_t i = 0; i < full; i += 32) dot_step<R, B, false>(x, x_stride, wrow, i, 0, acc);
  if (full < k)
    dot_step<R, B, true>(x, x_stride, wrow, full, (__mmask32{1} << (k - full)) - 1, acc);
  float b[B];
  for (int j = 0; j < B; ++j) {
    const uint32_t u = bias != nullptr ? static_cast<uint32_t>(bias[n0 + j]) << 16 : 0u;
    std::memcpy(&b[j], &u, 4);
  }
  for (int r = 0; r < R; ++r) {
    float s[B];
    if constexpr (B == 4) {
      _mm_storeu_ps(s, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    } else {
      for (int j = 0; j < B; ++j) s[j] = _mm512_reduce_add_ps(acc[r][j]);
    }
    for (int j = 0; j < B; ++j) store1<kBF16>(y, r * y_stride + n0 + j, s[j] + b[j]);
  }
}

// Every x row against weight rows n0 .. n0 + B, kDotXRows rows at a time (the weight rows stay in
// L1 between the groups: the weight streams from memory once).
template <int B>
inline void dot_rows(const uint16_t* x, int64_t rows, int64_t x_stride, const uint16_t* w,
                     int64_t k, const uint16_t* bias, uint16_t* y, int64_t y_stride, int64_t n0) {
  int64_t r0 = 0;
  for (; r0 + kDotXRows <= rows; r0 += kDotXRows)
    dot_tile<kDotXRows, B>(x + r0 * x_stride, x_stride, w, k, bias, y + r0 * y_stride, y_stride,
                           n0);
  const uint16_t* xr = x + r0 * x_stride;
  uint16_t* yr = y + r0 * y_stride;
  switch (rows - r0) {
    case 1: dot_tile<1, B>(xr, x_stride, w, k, bias, yr, y_stride, n0); break;
    case 2: dot_tile<2, B>(xr, x_stride, w, k, bias, yr, y_stride, n0); break;
    case 3: dot_tile<3, B>(xr, x_stride, w, k, bias, yr, y_stride, n0); break;
    case 4: dot_tile<4, B>(xr, x_stride, w, k, bias, yr, y_stride, n0); break;
    case 5: dot_tile<5, B>(xr, x_stride, w, k, bias, yr, y_stride, n0); break;
    default: break;
  }
}

int gemm_bf16_dot(const void* x, int64_t rows, int64_t x_stride, const void* w, int64_t n,
                  int64_t k, const void* bias, void* y, int64_t y_stride) {
  const auto* X = static_cast<const uint16_t*>(x);
  const auto* W = static_cast<const uint16_t*>(w);
  const auto* b = static_cast<const uint16_t*>(bias);
  auto* Y = static_cast<uint16_t*>(y);
  const int64_t blocks = n / kDotWeightRows;
#pragma omp parallel for schedule(static) if (n * k >= kMinParallelElems)
  for (int64_t i = 0; i < blocks; ++i)
    dot_rows<kDotWeightRows>(X, rows, x_stride, W, k, b, Y, y_stride, i * kDotWeightRows);
  for (int64_t j = blocks * kDotWeightRows; j < n; ++j)
    dot_rows<1>(X, rows, x_stride, W, k, b, Y, y_stride, j);
  return 0;
}
#else
int gemm_bf16_dot(const void*, int64_t, int64_t, const void*, int64_t, int64_t, const void*,
                  void*, int64_t) {
  return -1;
}
#endif

// ---- the loop over output rows, shared by both weight kinds --------------------------------

template <int V>
using Int = std::integral_constant<int, V>;

// Output rows in blocks of B (the last n % B one at a time), the blocks split statically over the
// threads when `parallel`: block(Int<NB>{}, n0) computes y[:, n0 .. n0 + NB).
template <int B, class Block>
void over_blocks(int64_t n, bool parallel, const Block& block) {
  const int64_t blocks = n / B;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) block(Int<B>{}, b * B);
  for (int64_t j = blocks * B; j < n; ++j) block(Int<1>{}, j);
}

// f(Int<R>{}) for R = rows in [1, kMaxRows]: 0; -1 for any other row count.
template <class F>
int with_rows(int64_t rows, const F& f) {
  switch (rows) {
    case 1: f(Int<1>{}); return 0;
    case 2: f(Int<2>{}); return 0;
    case 3: f(Int<3>{}); return 0;
    case 4: f(Int<4>{}); return 0;
    case 5: f(Int<5>{}); return 0;
    case 6: f(Int<6>{}); return 0;
    case 7: f(Int<7>{}); return 0;
    case 8: f(Int<8>{}); return 0;
    default: return -1;
  }
}

template <int DT>
int gemv(const void* x, int64_t rows, int64_t x_stride, const void* w, int64_t n, int64_t k,
         const void* bias, void* y, int64_t y_stride) {
  if (rows > kMaxRows && rows <= kMaxGroupedRows) {
    // Two groups of rows, each weight block multiplied into both while it is in L1 (the weight
    // still streams from memory once).
    constexpr int64_t esz = DT == kF32 ? 4 : 2;
    const void* x2 = byte_at(x, kMaxRows * x_stride, esz);
    void* y2 = static_cast<char*>(y) + kMaxRows * y_stride * esz;
    return with_rows(rows - kMaxRows, [&](auto r) {
      constexpr int R2 = decltype(r)::value;
      over_blocks<kBlockRows<kMaxRows>>(n, n * k >= kMinParallelElems, [&](auto nb, int64_t n0) {
        constexpr int NB = decltype(nb)::value;
        block<kMaxRows, NB, DT>(x, x_stride, w, k, bias, y, y_stride, n0);
        block<R2, NB, DT>(x2, x_stride, w, k, bias, y2, y_stride, n0);
      });
    });
  }
  return with_rows(rows, [&](auto r) {
    constexpr int R = decltype(r)::value;
    over_blocks<kBlockRows<R>>(n, n * k >= kMinParallelElems, [&](auto nb, int64_t n0) {
      block<R, decltype(nb)::value, DT>(x, x_stride, w, k, bias, y, y_stride, n0);
    });
  });
}

template <int DT>
int gemv_int8(const Int8Rows& xr, int64_t rows, const int8_t* w, int64_t n, int64_t k,
              const float* w_scale, const int32_t* w_sum, const float* bias, void* y,
              int64_t y_stride) {
  // A byte per weight: the same bytes as the float loop's threshold hold 4x the weights.
  return with_rows(rows, [&](auto r) {
    constexpr int R = decltype(r)::value;
    over_blocks<kBlockRows<R>>(n, n * k >= 4 * kMinParallelElems, [&](auto nb, int64_t n0) {
      block_int8<R, decltype(nb)::value, DT>(xr, w, k, w_scale, w_sum, bias, y, y_stride, n0);
    });
  });
}

}  // namespace

extern "C" {

// Returns 0; -1 for a bad dtype or a row count outside [1, kMaxGroupedRows].
int inferd_gemv(const void* x, int64_t rows, int64_t x_stride, const void* w, int64_t n,
                int64_t k, const void* bias, void* y, int64_t y_stride, int dtype) {
  if (dtype == kF32) return gemv<kF32>(x, rows, x_stride, w, n, k, bias, y, y_stride);
  if (dtype != kBF16) return -1;
  if (kHasAVX512BF16 && rows >= kDotMinRows && rows <= kDotMaxRows)
    return gemm_bf16_dot(x, rows, x_stride, w, n, k, bias, y, y_stride);
  return gemv<kBF16>(x, rows, x_stride, w, n, k, bias, y, y_stride);
}

// The most rows inferd_gemv takes (either float dtype).
int inferd_gemv_max_rows() { return kMaxGroupedRows; }

// The most rows inferd_gemv_int8 takes.
int inferd_gemv_int8_max_rows() { return kMaxRows; }

// The most bfloat16 rows that run on AVX512_BF16 dot products (from kDotMinRows); 0 without them.
int inferd_gemv_bf16_dot_rows() { return kHasAVX512BF16 ? kDotMaxRows : 0; }

// Returns 0; -1 for a bad dtype or a row count outside [1, kMaxRows].
int inferd_gemv_int8(const void* x, int64_t rows, int64_t x_stride, const int8_t* w, int64_t n,
                     int64_t k, const float* w_scale, const int32_t* w_sum, const float* bias,
                     void* y, int64_t y_stride, int dtype) {
  if ((dtype != kF32 && dtype != kBF16) || rows < 1 || rows > kMaxRows) return -1;
  const int64_t kpad = (k + 63) / 64 * 64;
  // The quantized x rows: a few KiB, reused by the calling thread across calls.
  thread_local std::vector<uint8_t> buf;
  buf.resize(static_cast<size_t>(rows * kpad));
  Int8Rows xr{buf.data(), kpad, {}, {}};
  const int64_t esz = dtype == kF32 ? 4 : 2;
  for (int64_t r = 0; r < rows; ++r)
    quantize_u8(byte_at(x, r * x_stride, esz), dtype, k, kpad, buf.data() + r * kpad,
                &xr.scale[r], &xr.zero[r]);
  if (dtype == kF32) return gemv_int8<kF32>(xr, rows, w, n, k, w_scale, w_sum, bias, y, y_stride);
  return gemv_int8<kBF16>(xr, rows, w, n, k, w_scale, w_sum, bias, y, y_stride);
}

}  // extern "C"
