// Vector helpers shared by the native kernels: float32 / bfloat16 / float8 (e5m2, KV cache only)
// loads and stores on AVX-512, rounding as torch rounds (to nearest even), int8 KV rows with their
// own scale, an exp for the softmax, and SiLU * up (rounded as the eager model rounds it).
//
// Every kernel computes in float32. A bfloat16 or float8 tensor is widened on load and rounded on
// store. float8_e5m2 is the upper byte of a float16 (same exponent, 2 of its 10 mantissa bits), so
// it widens exactly through the float16 conversion instructions.
// An int8 KV cache row (`kI8`, --kv-cache-dtype int8) is one head's d values quantized
// symmetrically with that row's own float32 scale stored after them: d + 4 bytes, value i =
// q[i] * scale, scale = max|x| / 127 (llama.cpp's q8_0 cache, one scale per head row instead of
// per 32 values). `quantize_row` computes it exactly as attention.py's PyTorch path does.
// `as_dtype` rounds an intermediate where the eager PyTorch model would have rounded it (after
// each op on a bfloat16 tensor), so the fused kernels stay within bfloat16's usual tolerance of it.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || \
    !defined(__AVX512VNNI__)
#error "the native kernels need AVX-512 F/BW/VL/VNNI (the loader falls back to the PyTorch path)"
#endif

namespace {

enum DType : int { kF32 = 0, kBF16 = 1, kFP8E5M2 = 2, kI8 = 3 };

// Whether this build has the AVX512_BF16 dot products (VDPBF16PS); kernels that use them keep a
// path without.
#ifdef __AVX512BF16__
constexpr bool kHasAVX512BF16 = true;
#else
constexpr bool kHasAVX512BF16 = false;
#endif

// Each lane's own index, 0-15 (masks of the first n lanes, positions within a vector).
inline __m512i lane_index() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

inline int64_t dtype_size(int dtype) { return dtype == kF32 ? 4 : dtype == kBF16 ? 2 : 1; }

// Bytes of one head's K or V row of d values in the cache (int8 rows end with their scale).
inline int64_t kv_row_bytes(int dtype, int64_t d) {
  return d * dtype_size(dtype) + (dtype == kI8 ? 4 : 0);
}

// ---- conversions -------------------------------------------------------------------------------
// 16 float8_e5m2 bytes -> floats: each byte becomes the high byte of a float16.
inline __m512 e5m2_to_ps(__m128i b) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
}

// Floats -> float8_e5m2 bytes in 32-bit lanes, as torch rounds (c10's fp8e5m2_from_fp32_value):
// to nearest even; from 65536 on inf, NaN a NaN; below 2^-14 by adding and removing the float
// 2^7 (134 << 23 as bits), whose last mantissa bits then hold the value on the subnormal grid.
inline __m512i e5m2_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  const __m512i a = _mm512_xor_si512(u, sign);
  const __m512i denorm = _mm512_set1_epi32(134 << 23);
  // Normal: a + ((15 - 127) << 23) + 0xFFFFF + (bit 21 of a), the result in bits 21-28.
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 21), _mm512_set1_epi32(1));
  __m512i normal = _mm512_add_epi32(a, _mm512_set1_epi32(static_cast<int>((15u - 127u) << 23) + 0xFFFFF));
  normal = _mm512_srli_epi32(_mm512_add_epi32(normal, odd), 21);
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm))),
      denorm);
  // Below 2^-14, the smallest normal float8_e5m2: the subnormal grid.
  const __mmask16 tiny = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(113 << 23));
  __m512i r = _mm512_mask_mov_epi32(normal, tiny, sub);
  const __mmask16 big = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(143 << 23));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, big, _mm512_set1_epi32(0x7C));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7F));
  r = _mm512_and_si512(r, _mm512_set1_epi32(0xFF));
  return _mm512_or_si512(r, _mm512_srli_epi32(sign, 24));
}

// 16 bfloat16 values (16-bit patterns) widened to float32, exactly.
inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 values widened to float; int8 ones unscaled (the caller multiplies by the row's scale).
inline __m512 load16(const void* p, int dtype) {
  if (dtype == kF32) return _mm512_loadu_ps(p);
  if (dtype == kFP8E5M2) return e5m2_to_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  if (dtype == kI8)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))));
  return widen_bf16(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// exp for x <= 0 (scores minus the running max); exactly 0 below -87.
inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}


// acc + u . s: 64 uint8 x int8 products summed into acc's 16 int32 lanes (VPDPBUSD), in place.
// Inline asm, not _mm512_dpbusd_epi32: GCC 12 does not accumulate that builtin in place. It copied
// every accumulator into a scratch register and back around each VPDPBUSD and spilled a third of
// them to the stack: the greedy screen ran at ~40 % of the instruction's rate (docs/benchmarks.md).
// The int8 GEMV uses it too, though it streams memory at the rows it takes.
inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

// ---- masked forms, for rows whose length is not a multiple of 16 -------------------------------
// r[i][j] -> r[j][i]: 16 x 16 32-bit values in four rounds of unpacks and lane shuffles.
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(t[4 * k]), b = _mm512_castps_pd(t[4 * k + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * k + 1]), d = _mm512_castps_pd(t[4 * k + 3]);
    r[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int k = 0; k < 2; ++k)
    for (int j = 0; j < 4; ++j) {
      t[8 * k + j] = _mm512_shuffle_f32x4(r[8 * k + j], r[8 * k + 4 + j], 0x88);
      t[8 * k + 4 + j] = _mm512_shuffle_f32x4(r[8 * k + j], r[8 * k + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
  }
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

inline __m512 load16m(const void* p, int dtype, __mmask16 m) {
  if (dtype == kF32) return _mm512_maskz_loadu_ps(m, p);
  if (dtype == kFP8E5M2) return e5m2_to_ps(_mm_maskz_loadu_epi8(m, p));
  if (dtype == kI8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
  return widen_bf16(_mm256_maskz_loadu_epi16(m, p));
}

// x row [k] (model dtype) -> q [kpad] uint8 (zero past k), its scale and zero point: the range
// [min(x, 0), max(x, 0)] over 0..255, values rounded to nearest even, as a dynamic int8 GEMM
// quantizes its activations (gemv.cpp's int8 GEMV, panel_gemm.cpp's greedy screen). kpad: a
// multiple of 16.
inline void quantize_u8(const void* x, int dtype, int64_t k, int64_t kpad, uint8_t* q,
                        float* scale, int32_t* zero) {
  const int64_t esz = dtype == kF32 ? 4 : 2;
  __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __m512 v = load16m(static_cast<const char*>(x) + i * esz, dtype, tail_mask(k - i));
    lo = _mm512_min_ps(lo, v);
    hi = _mm512_max_ps(hi, v);
  }
  const float mn = _mm512_reduce_min_ps(lo), mx = _mm512_reduce_max_ps(hi);
  float s = (mx - mn) / 255.0f;
  if (!(s > 0.0f)) s = 1.0f;  // an all-zero row: every value quantizes to the zero point
  int32_t z = static_cast<int32_t>(std::nearbyint(-mn / s));
  z = z < 0 ? 0 : z > 255 ? 255 : z;
  const __m512 inv = _mm512_set1_ps(1.0f / s);
  const __m512i vz = _mm512_set1_epi32(z), v0 = _mm512_setzero_si512(),
                v255 = _mm512_set1_epi32(255);
  for (int64_t i = 0; i < kpad; i += 16) {
    const __mmask16 m = i < k ? tail_mask(k - i) : 0;
    const __m512 v = load16m(static_cast<const char*>(x) + i * esz, dtype, m);
    __m512i r = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)), vz);
    r = _mm512_min_epi32(_mm512_max_epi32(r, v0), v255);
    r = _mm512_maskz_mov_epi32(m, r);  // padding stays 0, so it adds nothing to the dot
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(r));
  }
  *scale = s;
  *zero = z;
}

// The 16-bit patterns of v rounded to bfloat16 (nearest even; NaN stays a quiet NaN), in 32-bit
// lanes.
inline __m512i bf16_bits(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  return _mm512_srli_epi32(r, 16);
}

// 16 values rounded to bfloat16: VCVTNEPS2BF16 where the CPU has AVX512_BF16 (one instruction,
// the same bits as bf16_bits but for float32 denormals, which it flushes to zero), else bf16_bits.
inline __m256i to_bf16(__m512 v) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  return _mm512_cvtepi32_epi16(bf16_bits(v));
#endif
}

inline void store16m(void* p, __m512 v, int dtype, __mmask16 m) {
  if (dtype == kF32) {
    _mm512_mask_storeu_ps(p, m, v);
    return;
  }
  if (dtype == kFP8E5M2) {
    _mm_mask_storeu_epi8(p, m, _mm512_cvtepi32_epi8(e5m2_bits(v)));
    return;
  }
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// v as the model dtype would hold it: unchanged for float32, rounded to bfloat16 otherwise.
inline __m512 as_dtype(__m512 v, int dtype) {
  if (dtype == kF32) return v;
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

// silu(g) = g * sigmoid(g), with exp only of non-positive arguments (exp512's domain).
inline __m512 silu(__m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));  // exp(-|g|)
  __mmask16 pos = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
  __m512 num = _mm512_mask_blend_ps(pos, e, one);  // sigmoid = 1/(1+e) or e/(1+e)
  return _mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e)));
}

// out[0, 16) (masked) = silu(g) * u, g and u as the model dtype holds them: for bfloat16 SiLU
// rounded, then the product rounded, as the eager model rounds each op. to_bf16 is one
// instruction on AVX512_BF16 (the prefill SiLU ~25 % faster than rounding through bf16_bits, the
// same bits). fused_ops.cpp's SiLU * up and moe_experts.cpp's gate/up epilogue, so both give the
// same bits.
inline void store_silu_mul(void* out, __m512 g, __m512 u, int dtype, __mmask16 m) {
  if (dtype == kF32) {
    _mm512_mask_storeu_ps(out, m, _mm512_mul_ps(silu(g), u));
    return;
  }
  const __m512 s = widen_bf16(to_bf16(silu(g)));
  _mm256_mask_storeu_epi16(out, m, to_bf16(_mm512_mul_ps(s, u)));
}

// d values of src (in src_dtype) -> one int8 KV row at dst: q = round_half_even(x / scale) in
// [-127, 127], then the float32 scale (max|x| / 127; an all-zero row stores scale 0 and zeros).
inline void quantize_row(void* dst, const void* src, int src_dtype, int d) {
  const auto* x = static_cast<const char*>(src);
  const int64_t esz = dtype_size(src_dtype);
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < d; i += 16)
    amax = _mm512_max_ps(amax, _mm512_abs_ps(load16m(x + i * esz, src_dtype, tail_mask(d - i))));
  const float scale = _mm512_reduce_max_ps(amax) / 127.0f;
  const __m512 div = _mm512_set1_ps(scale > 0.0f ? scale : 1.0f);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  auto* q = static_cast<int8_t*>(dst);
  for (int i = 0; i < d; i += 16) {
    const __mmask16 m = tail_mask(d - i);
    __m512 v = _mm512_div_ps(load16m(x + i * esz, src_dtype, m), div);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    _mm_mask_storeu_epi8(q + i, m, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  std::memcpy(q + d, &scale, sizeof(float));
}

// The scale stored after an int8 row of d values.
inline float row_scale(const void* row, int d) {
  float s;
  std::memcpy(&s, static_cast<const char*>(row) + d, sizeof(float));
  return s;
}

}  // namespace
