// Fused elementwise kernels of a decoder layer: what eager PyTorch runs as 4-10 separate ops, each
// reading and writing the whole activation, done in one pass per row.
//
//   inferd_rms_norm   out = rms_norm(x [+ residual]) * w; with a residual, residual <- x + residual
//                     first (vLLM's fused_add_rms_norm: the residual add of the previous block and
//                     this block's norm in one pass)
//   inferd_silu_mul   out = silu(gate) * up over [T, 2I] -> [T, I]
//   inferd_argmax     the index of each row's largest value (greedy sampling on the model-dtype
//                     logits: 24 bf16 rows of a 151,936-token vocabulary 0.24 ms, against 1.8
//                     for torch's float32 copy and argmax)
//   inferd_rope_qkv   q, k of the fused qkv projection: optional per-head RMSNorm (Qwen3), RoPE
//                     (rotate-half), q written contiguous for the attention kernel, k and v written
//                     into the paged KV cache at their slots (the attention kernel then reads them
//                     in place); replaces the norms, 4 muls, 2 adds, 2 cats, the q copy and two
//                     index_copy_ calls per layer
//
// Built into the same library as paged_attention.cpp (see its header for how it is loaded and why
// OpenMP here shares torch's thread pool). Layouts are row-major; `*_stride` counts elements.
// Arithmetic is float32; bfloat16 values are rounded where the eager model rounds (simd.h).
// Rows run in parallel once a call has kMinParallelElems elements: below that, waking the pool
// costs more than the work.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kMinParallelElems = 1 << 15;
constexpr int kMaxHeadDim = 256;

inline int64_t esize(int dtype) { return dtype_size(dtype); }

inline const char* at(const void* base, int64_t elems, int dtype) {
  return static_cast<const char*>(base) + elems * esize(dtype);
}
inline char* at(void* base, int64_t elems, int dtype) {
  return static_cast<char*>(base) + elems * esize(dtype);
}

inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }

// One row: r = x (+ residual, rounded and stored back), out = round(round(r * inv_rms) * w).
void norm_row(void* out, const void* x, void* residual, const void* w, int dtype, int64_t dim,
              float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = tail_mask(dim - i);
    __m512 v = load16m(at(x, i, dtype), dtype, m);
    if (residual != nullptr) {
      v = as_dtype(_mm512_add_ps(v, load16m(at(residual, i, dtype), dtype, m)), dtype);
      store16m(at(residual, i, dtype), v, dtype, m);
    }
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float inv = 1.0f / std::sqrt(reduce(ss) / static_cast<float>(dim) + eps);
  const __m512 vinv = _mm512_set1_ps(inv);
  const void* src = residual != nullptr ? residual : x;
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = tail_mask(dim - i);
    __m512 n = as_dtype(_mm512_mul_ps(load16m(at(src, i, dtype), dtype, m), vinv), dtype);
    store16m(at(out, i, dtype), _mm512_mul_ps(n, load16m(at(w, i, dtype), dtype, m)), dtype, m);
  }
}

// The largest of values [i0, i1) of a row and its index: the first on ties, or the first NaN (as
// torch's argmax). Each of 16 lanes keeps its running max and where it was (a strict compare keeps
// a lane's first occurrence); the lanes fold at the end. `i` < 0: an empty range.
struct Best {
  float v;
  int64_t i;
  bool nan;
};

Best argmax_range(const void* row, int dtype, int64_t i0, int64_t i1) {
  if (i0 >= i1) return {-INFINITY, -1, false};
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 vmax = ninf;
  __m512i lane = lane_index();
  __m512i vidx = lane;  // an all -inf range answers its first index
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t i = i0; i < i1; i += 16) {
    const __mmask16 m = tail_mask(i1 - i);
    const __m512 v = _mm512_mask_blend_ps(m, ninf, load16m(at(row, i, dtype), dtype, m));
    if (const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q))
      return {NAN, i + __builtin_ctz(nan), true};
    const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
    vmax = _mm512_mask_mov_ps(vmax, gt, v);
    vidx = _mm512_mask_mov_epi32(vidx, gt, lane);
    lane = _mm512_add_epi32(lane, step);
  }
  const float best = _mm512_reduce_max_ps(vmax);
  const __mmask16 at_best = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(best), _CMP_EQ_OQ);
  const __m512i cand = _mm512_mask_blend_epi32(at_best, _mm512_set1_epi32(INT32_MAX), vidx);
  return {best, i0 + _mm512_reduce_min_epi32(cand), false};
}

struct Rope {
  const void* cos;
  const void* sin;
  int dtype;  // of cos, sin (the model dtype)
  int64_t half;
};

// One head vector of d values: optional RMSNorm with weight nw, then rotate-half RoPE by the
// position's cos/sin row, stored to dst in dst_dtype. `buf` holds d floats.
void rope_head(void* dst, int dst_dtype, const void* src, int dtype, int d, const void* nw,
               float eps, const Rope& r, int64_t pos, float* buf) {
  __m512 ss = _mm512_setzero_ps();
  for (int i = 0; i < d; i += 16) {
    const __mmask16 m = tail_mask(d - i);
    __m512 v = load16m(at(src, i, dtype), dtype, m);
    _mm512_mask_storeu_ps(buf + i, m, v);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  if (nw != nullptr) {
    const __m512 vinv = _mm512_set1_ps(1.0f / std::sqrt(reduce(ss) / static_cast<float>(d) + eps));
    for (int i = 0; i < d; i += 16) {
      const __mmask16 m = tail_mask(d - i);
      __m512 n = as_dtype(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, buf + i), vinv), dtype);
      n = as_dtype(_mm512_mul_ps(n, load16m(at(nw, i, dtype), dtype, m)), dtype);
      _mm512_mask_storeu_ps(buf + i, m, n);
    }
  }
  const int64_t h = r.half;
  const void* cos = at(r.cos, pos * h, r.dtype);
  const void* sin = at(r.sin, pos * h, r.dtype);
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = tail_mask(h - i);
    __m512 a = _mm512_maskz_loadu_ps(m, buf + i), b = _mm512_maskz_loadu_ps(m, buf + h + i);
    __m512 c = load16m(at(cos, i, r.dtype), r.dtype, m);
    __m512 s = load16m(at(sin, i, r.dtype), r.dtype, m);
    store16m(at(dst, i, dst_dtype), _mm512_fmsub_ps(a, c, _mm512_mul_ps(b, s)), dst_dtype, m);
    store16m(at(dst, h + i, dst_dtype), _mm512_fmadd_ps(b, c, _mm512_mul_ps(a, s)), dst_dtype, m);
  }
}

void convert_row(void* dst, int dst_dtype, const void* src, int dtype, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    store16m(at(dst, i, dst_dtype), load16m(at(src, i, dtype), dtype, m), dst_dtype, m);
  }
}

}  // namespace

extern "C" {

// out [rows, out_stride], x [rows, x_stride], residual [rows, dim] contiguous or null, w [dim].
// out may be x. Returns 0, or -1 for a bad dtype.
int inferd_rms_norm(void* out, int64_t out_stride, const void* x, int64_t x_stride,
                    void* residual, const void* w, int dtype, int64_t rows, int64_t dim,
                    float eps) {
  if (dtype != kF32 && dtype != kBF16) return -1;
#pragma omp parallel for schedule(static) if (rows * dim >= kMinParallelElems)
  for (int64_t t = 0; t < rows; ++t) {
    void* res = residual != nullptr ? at(residual, t * dim, dtype) : nullptr;
    norm_row(at(out, t * out_stride, dtype), at(x, t * x_stride, dtype), res, w, dtype, dim, eps);
  }
  return 0;
}

// gate_up [rows, 2 * inter] contiguous (gate then up) -> out [rows, inter] contiguous.
int inferd_silu_mul(void* out, const void* gate_up, int dtype, int64_t rows, int64_t inter) {
  if (dtype != kF32 && dtype != kBF16) return -1;
#pragma omp parallel for schedule(static) if (rows * inter >= kMinParallelElems)
  for (int64_t t = 0; t < rows; ++t) {
    const void* g = at(gate_up, t * 2 * inter, dtype);
    const void* u = at(g, inter, dtype);
    void* o = at(out, t * inter, dtype);
    for (int64_t i = 0; i < inter; i += 16) {
      const __mmask16 m = tail_mask(inter - i);
      store_silu_mul(at(o, i, dtype), load16m(at(g, i, dtype), dtype, m),
                     load16m(at(u, i, dtype), dtype, m), dtype, m);
    }
  }
  return 0;
}

// out [rows] int64 <- the index of the largest of the n values of each row of x [rows, stride]
// (float32 or bfloat16): the first on ties, the first NaN if any. With fewer rows than threads,
// each row is cut into parts the threads share. Returns 0, or -1 for a bad dtype or shape.
int inferd_argmax(const void* x, int dtype, int64_t rows, int64_t n, int64_t stride,
                  int64_t* out) {
  if ((dtype != kF32 && dtype != kBF16) || rows < 0 || n <= 0 || n >= INT32_MAX || stride < n)
    return -1;
  if (rows == 0) return 0;
  const int threads = omp_get_max_threads();
  const int64_t parts = rows >= threads ? 1 : (threads + rows - 1) / rows;
  const int64_t per = ((n + parts - 1) / parts + 15) / 16 * 16;
  std::vector<Best> best(static_cast<size_t>(rows * parts));
#pragma omp parallel for schedule(static) if (rows * n >= kMinParallelElems)
  for (int64_t k = 0; k < rows * parts; ++k) {
    const int64_t i0 = std::min(n, k % parts * per);
    best[k] = argmax_range(at(x, k / parts * stride, dtype), dtype, i0, std::min(n, i0 + per));
  }
  for (int64_t r = 0; r < rows; ++r) {
    Best b = best[r * parts];
    for (int64_t p = 1; p < parts && !b.nan; ++p) {
      const Best& c = best[r * parts + p];
      if (c.i >= 0 && (c.nan || c.v > b.v)) b = c;
    }
    out[r] = b.i;
  }
  return 0;
}

// qkv [T, qkv_stride]: per row Hq query heads, then Hkv key heads, then Hkv value heads, d each.
// positions [T] index cos, sin [max_pos, d / 2]; q_norm, k_norm [d] or null; q_out [T, Hq, d]
// contiguous (model dtype); kv_cache [2, plane_slots, Hkv, d] (K plane then V plane) in kv_dtype
// (int8: rows of d + 4 bytes, simd.h);
// slots [T] its rows. Returns 0; -1 bad shape or dtype; -2 a position or slot out of range
// (nothing is guaranteed written then).
int inferd_rope_qkv(const void* qkv, int64_t qkv_stride, int dtype, int64_t T, int hq, int hkv,
                    int d, const int64_t* positions, const void* cos, const void* sin,
                    int64_t max_pos, const void* q_norm, const void* k_norm, float eps,
                    void* q_out, void* kv_cache, int kv_dtype, int64_t plane_slots,
                    const int64_t* slots) {
  if ((dtype != kF32 && dtype != kBF16) || kv_dtype < kF32 || kv_dtype > kI8 || d % 2 ||
      d > kMaxHeadDim || hq <= 0 || hkv <= 0)
    return -1;
  const Rope rope{cos, sin, dtype, d / 2};
  const int64_t row_bytes = kv_row_bytes(kv_dtype, d);
  const int64_t tok_bytes = hkv * row_bytes;
  char* k_plane = static_cast<char*>(kv_cache);
  char* v_plane = k_plane + plane_slots * tok_bytes;
  const bool int8 = kv_dtype == kI8;
  std::atomic<bool> bad{false};
#pragma omp parallel for schedule(static) if (T * (hq + 2 * hkv) * d >= kMinParallelElems)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = positions[t], slot = slots[t];
    if (pos < 0 || pos >= max_pos || slot < 0 || slot >= plane_slots) {
      bad.store(true, std::memory_order_relaxed);
      continue;
    }
    alignas(64) float buf[kMaxHeadDim];
    alignas(64) float head[kMaxHeadDim];  // a rotated K row, in the model dtype, to quantize
    const void* row = at(qkv, t * qkv_stride, dtype);
    for (int h = 0; h < hq; ++h)
      rope_head(at(q_out, (t * hq + h) * d, dtype), dtype, at(row, h * d, dtype), dtype, d,
                q_norm, eps, rope, pos, buf);
    char* k_row = k_plane + slot * tok_bytes;
    char* v_row = v_plane + slot * tok_bytes;
    if (!int8) {
      for (int h = 0; h < hkv; ++h)
        rope_head(k_row + h * row_bytes, kv_dtype, at(row, (hq + h) * d, dtype), dtype, d, k_norm,
                  eps, rope, pos, buf);
      convert_row(v_row, kv_dtype, at(row, (hq + hkv) * d, dtype), dtype, hkv * d);
      continue;
    }
    for (int h = 0; h < hkv; ++h) {
      rope_head(head, dtype, at(row, (hq + h) * d, dtype), dtype, d, k_norm, eps, rope, pos, buf);
      quantize_row(k_row + h * row_bytes, head, dtype, d);
      quantize_row(v_row + h * row_bytes, at(row, (hq + hkv + h) * d, dtype), dtype, d);
    }
  }
  return bad.load() ? -2 : 0;
}

}  // extern "C"
