// Vector helpers shared by the native kernels: float32 / bfloat16 loads and stores on AVX-512,
// rounding as torch rounds (to nearest even), and an exp for the softmax and SiLU.
//
// Every kernel computes in float32. A bfloat16 tensor is widened on load and rounded on store;
// `as_dtype` rounds an intermediate where the eager PyTorch model would have rounded it (after
// each op on a bfloat16 tensor), so the fused kernels stay within bfloat16's usual tolerance of it.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "the native kernels need AVX-512 F/BW/VL (the loader falls back to the PyTorch path)"
#endif

namespace {

enum DType : int { kF32 = 0, kBF16 = 1 };

// ---- conversions -------------------------------------------------------------------------------
inline __m512 load16(const void* p, int dtype) {
  if (dtype == kF32) return _mm512_loadu_ps(p);
  __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline void store_row(void* dst, const float* src, int d, int dtype) {
  if (dtype == kF32) {
    std::memcpy(dst, src, sizeof(float) * d);
    return;
  }
  auto* o = static_cast<uint16_t*>(dst);
  for (int i = 0; i < d; ++i) o[i] = f32_to_bf16(src[i]);
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


// ---- masked forms, for rows whose length is not a multiple of 16 -------------------------------
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

inline __m512 load16m(const void* p, int dtype, __mmask16 m) {
  if (dtype == kF32) return _mm512_maskz_loadu_ps(m, p);
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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

inline void store16m(void* p, __m512 v, int dtype, __mmask16 m) {
  if (dtype == kF32) {
    _mm512_mask_storeu_ps(p, m, v);
    return;
  }
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// v as the model dtype would hold it: unchanged for float32, rounded to bfloat16 otherwise.
inline __m512 as_dtype(__m512 v, int dtype) {
  if (dtype == kF32) return v;
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

}  // namespace
