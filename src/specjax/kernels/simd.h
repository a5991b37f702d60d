// specjax CPU kernels: the few float32 vector operations they use, for AVX-512F (16 lanes) or AVX2 + FMA (8 lanes).
//
// Built with -march=native, a kernel gets the widest of the two this CPU has (specjax.kernels checks the CPU
// flags before building).  Every operation is lane-wise and rounds as its scalar counterpart, so a kernel's
// arithmetic per output element is the same on both, except the horizontal sums (Sum) and whatever a kernel
// sums across lanes: results agree to rounding across the two builds, and are bit-identical across calls of
// one build.
#pragma once

#include <cstdint>

#include <immintrin.h>

namespace specjax_simd {

#if defined(__AVX512F__)

constexpr int kLanes = 16;
using Vec = __m512;
using IVec = __m512i;

inline Vec Zero() { return _mm512_setzero_ps(); }
inline Vec Set1(float x) { return _mm512_set1_ps(x); }
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, rounded once
inline float Sum(Vec v) { return _mm512_reduce_add_ps(v); }
// kLanes bytes at p, widened to int32 lanes (unsigned / signed), and back to float
inline IVec U8ToI32(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline IVec I8ToI32(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
inline IVec LowNibble(IVec v) { return _mm512_and_si512(v, _mm512_set1_epi32(0xF)); }
inline IVec HighNibble(IVec v) { return _mm512_srli_epi32(v, 4); }
inline Vec ToFloat(IVec v) { return _mm512_cvtepi32_ps(v); }
// kLanes bfloat16 values at p as float32 (exact: a bfloat16 is the top half of a float32)
inline Vec BF16ToFloat(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// exp(x) for x <= 0 (scores minus their maximum): Cody-Waite range reduction and a degree-6 Taylor polynomial
// (truncation below 1.3e-7 relative on the reduced range); arguments below -87 give 0.
inline Vec Exp(Vec x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), _mm512_scalef_ps(p, n));
}

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int kLanes = 8;
using Vec = __m256;
using IVec = __m256i;

inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Set1(float x) { return _mm256_set1_ps(x); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec Sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float Sum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline IVec U8ToI32(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline IVec I8ToI32(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline IVec LowNibble(IVec v) { return _mm256_and_si256(v, _mm256_set1_epi32(0xF)); }
inline IVec HighNibble(IVec v) { return _mm256_srli_epi32(v, 4); }
inline Vec ToFloat(IVec v) { return _mm256_cvtepi32_ps(v); }
inline Vec BF16ToFloat(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// The same exp as the AVX-512 build, lane for lane: 2^n is built in the exponent field (n >= -126 after the
// clamp, so it is a normal float) and p * 2^n rounds as scalef does.
inline Vec Exp(Vec x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_NLT_UQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

#else
#error "specjax kernels need AVX-512F or AVX2 + FMA (the caller falls back to XLA when this does not build)"
#endif

inline void Pause() { _mm_pause(); }

}  // namespace specjax_simd
