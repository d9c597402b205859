// Few-row int8 linear layers: y = x W^T + b for 1 <= rows <= kMaxRows.
//
//   inferd_gemv_int8  x [rows, x_stride], W [n, k] int8 row-major contiguous with one float32
//                 scale per output row (symmetric, as `--quantization int8` quantizes), its rows'
//                 integer sums, a float32 bias or null, y [rows, y_stride]; x and y in the model
//                 dtype (float32 or bfloat16). Each x row is quantized to uint8 from its own range
//                 (asymmetric, like the batched int8 GEMM's dynamic activations) and the dot
//                 products run on VNNI (u8 x s8 summed in int32); y = sx * sw * (dot - zx * sum w)
//
// Who runs it (models/linear.py's plan): an int8 layer's batches of 1-2 rows and the one-call
// decode step's 1-8, on every CPU the kernels build for (AVX-512 with VNNI). Float layers run the
// panel GEMM (panel_gemm.cpp) or oneDNN.
//
// Why: a single stream (and any decode step of a few sequences) reads every weight once per token
// and does almost no arithmetic with it, so its speed is the rate the weights stream from memory:
// a byte per weight here, a quarter of float32's, with no interpreter between the 64-weight steps
// (offline 1.18x fbgemm's int8 GEMM on llama-32m, docs/benchmarks.md).
//
// Layout of the work: 4 weight rows at a time (4 streams the hardware prefetcher follows, plus a
// software prefetch ~8 KiB ahead into L2; 2 weight rows past 4 x rows, kBlockRows), each weight
// vector loaded once and multiplied into every x row, so x rows past the first cost no extra
// memory traffic. Each thread takes one contiguous range of blocks: measured with this loop over
// the float32 llama-32m / Qwen2-0.5B weight sets, static 41 / 32.4 GB/s, dynamic grabs of 16
// blocks 32 / 30.2, guided 35 / 30.8 (one long stream per thread prefetches best; a thread
// preempted by another process does delay the call, which dynamic would absorb).

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gemv_int8.h"
#include "simd.h"

namespace {

using namespace gemv8;

// Layers of fewer weights (bytes) run on the calling thread alone.
constexpr int64_t kMinParallelWeights = 1 << 17;

inline const char* byte_at(const void* base, int64_t elems, int64_t esz) {
  return static_cast<const char*>(base) + elems * esz;
}

// Output rows in blocks of B (the last n % B one at a time), the blocks split statically over the
// threads when `parallel`: block(Int<NB>{}, n0) computes y[:, n0 .. n0 + NB).
template <int B, class Block>
void over_blocks(int64_t n, bool parallel, const Block& block) {
  const int64_t blocks = n / B;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) block(Int<B>{}, b * B);
  for (int64_t j = blocks * B; j < n; ++j) block(Int<1>{}, j);
}

template <int DT>
int gemv_int8(const Int8Rows& xr, int64_t rows, const int8_t* w, int64_t n, int64_t k,
              const float* w_scale, const int32_t* w_sum, const float* bias, void* y,
              int64_t y_stride) {
  return with_rows(rows, [&](auto r) {
    constexpr int R = decltype(r)::value;
    over_blocks<kBlockRows<R>>(n, n * k >= kMinParallelWeights, [&](auto nb, int64_t n0) {
      block_int8<R, decltype(nb)::value, DT>(xr, w, k, w_scale, w_sum, bias, y, y_stride, n0);
    });
  });
}

}  // namespace

extern "C" {

// The most rows inferd_gemv_int8 takes.
int inferd_gemv_int8_max_rows() { return kMaxRows; }

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
