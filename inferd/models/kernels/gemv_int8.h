// The int8 GEMV's inner loop (gemv.cpp has the design and its measurements), shared with
// moe_experts.cpp's int8 experts, so both compute each output value the same way: x rows
// quantized to uint8 (simd.h's quantize_u8), 64 int8 weights a step on VNNI, one float result.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace gemv8 {

constexpr int kMaxRows = 8;
// Output rows per block: up to 4 x rows, 4 weight rows share each x load (4 * R accumulators);
// past 4 x rows those would not fit the 32 vector registers beside the x vectors, so 2.
template <int R>
constexpr int kBlockRows = R <= 4 ? 4 : 2;
// Each weight row's stream is prefetched this far ahead into L2 (T1): into L1 (T0) the lines
// displaced the ones being read; measured over whole weight sets, 2 threads: float32 llama-32m
// 30 -> 37.5 GB/s, Qwen2-0.5B 29.5 -> 32.6; int8 Qwen2-0.5B 20 -> 31 (fbgemm 31.5).
constexpr int64_t kPrefetchBytes = 8192;
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

template <int V>
using Int = std::integral_constant<int, V>;

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

}  // namespace gemv8
