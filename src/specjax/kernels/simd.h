// specjax CPU kernels: the few float32 vector operations they use, for AVX-512F (16 lanes) or AVX2 + FMA (8 lanes).
//
// Built with -march=native, a kernel gets the widest of the two this CPU has (specjax.kernels checks the CPU
// flags before building).  Every operation is lane-wise and rounds as its scalar counterpart, so a kernel's
// arithmetic per output element is the same on both, except the horizontal sums (Sum) and whatever a kernel
// sums across lanes: results agree to rounding across the two builds, and are bit-identical across calls of
// one build.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <new>
#include <vector>

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
inline Vec Div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
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
// kLanes IEEE float16 values at p as float32 (exact: every float16 is a float32)
inline Vec F16ToFloat(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// Lane i of the result = the sum of v[i]'s lanes, for kLanes vectors: a transposing tree of adds (pairs of lanes
// within 128-bit quarters, then quarters), the same tree for every i, so each sum's order depends on nothing else.
inline Vec SumEach(const Vec* v) {
  Vec a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // [x0+x2, y0+y2, x1+x3, y1+y3] per quarter, x = v[2i], y = v[2i+1]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // [v0, v1, v2, v3] of 4 consecutive vectors per quarter, partial over quarters
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // quarters 0 + 2 and 1 + 3 of two such
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}
inline float MaxOf(Vec v) { return _mm512_reduce_max_ps(v); }

// The first n <= kLanes floats at p (the rest 0), and kLanes rows of a kLanes x kLanes tile transposed in registers
// (row i's lane j to row j's lane i): unpacks of 32- and 64-bit pairs, then two rounds of 128-bit quarters.
inline Vec LoadN(const float* p, int n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
inline void TransposeTile(Vec* r) {
  Vec t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i)
    for (int h = 0; h < 2; ++h) {
      const __m512d a = _mm512_castps_pd(t[4 * i + h]), b = _mm512_castps_pd(t[4 * i + 2 + h]);
      r[4 * i + 2 * h] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[4 * i + 2 * h + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  for (int i = 0; i < 2; ++i)
    for (int c = 0; c < 4; ++c) {
      t[8 * i + c] = _mm512_shuffle_f32x4(r[8 * i + c], r[8 * i + 4 + c], 0x88);
      t[8 * i + 4 + c] = _mm512_shuffle_f32x4(r[8 * i + c], r[8 * i + 4 + c], 0xDD);
    }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xDD);
  }
}

// The pieces of Exp (below) that differ between the instruction sets.
using Mask = __mmask16;
inline Vec Fnma(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, rounded once
inline Mask Less(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline Vec ZeroWhere(Mask m, Vec v) { return _mm512_maskz_mov_ps(static_cast<__mmask16>(~m), v); }
inline Vec RoundNearest(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec ScalePow2(Vec p, Vec n) { return _mm512_scalef_ps(p, n); }  // p * 2^n for integral n

// The float32 weights of a Q4 block's 4-bit codes (lanes of zero-extended code bytes): q * d + m (Q4_1) or
// (q - 8) * d (Q4_0), rounded as written there (numpy's dequantization).  Here the 16 values a code can stand for
// are computed once per block and each code looks its value up (vpermps reads a lane's low 4 bits): 8-15% faster
// products than rebuilding each weight (one core, Zen 4, M = 1-4), and the same weights bit for bit.
class Q4Values {
 public:
  static Q4Values Affine(float d, float m) { return Q4Values(Add(Mul(Iota(), Set1(d)), Set1(m))); }
  static Q4Values Centered(float d) { return Q4Values(Mul(Sub(Iota(), Set1(8.0f)), Set1(d))); }
  Vec Low(IVec codes) const { return _mm512_permutexvar_ps(codes, lut_); }  // each lane's bits 0-3
  Vec High(IVec codes) const { return _mm512_permutexvar_ps(HighNibble(codes), lut_); }  // its bits 4-7

 private:
  explicit Q4Values(Vec lut) : lut_(lut) {}
  static Vec Iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  Vec lut_;
};

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
inline Vec Div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
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
inline Vec F16ToFloat(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// Lane i of the result = the sum of v[i]'s lanes, for kLanes vectors (the same transposing tree for every i).
inline Vec SumEach(const Vec* v) {
  Vec a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
inline float MaxOf(Vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline Vec LoadN(const float* p, int n) {
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline void TransposeTile(Vec* r) {
  Vec t[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i)
    for (int h = 0; h < 2; ++h) {
      const __m256d a = _mm256_castps_pd(t[4 * i + h]), b = _mm256_castps_pd(t[4 * i + 2 + h]);
      r[4 * i + 2 * h] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, b));
      r[4 * i + 2 * h + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, b));
    }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x20);
    t[4 + c] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x31);
  }
  for (int c = 0; c < 8; ++c) r[c] = t[c];
}

using Mask = __m256;  // all-ones lanes where true
inline Vec Fnma(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline Mask Less(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
inline Vec ZeroWhere(Mask m, Vec v) { return _mm256_andnot_ps(m, v); }
inline Vec RoundNearest(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^n built in the exponent field: Exp's clamp keeps n >= -126, a normal float, so p * 2^n rounds as scalef does
inline Vec ScalePow2(Vec p, Vec n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The float32 weights of a Q4 block's codes, as above; with 8 lanes a lookup of 16 values takes two permutes and a
// blend, so each weight is rebuilt from its code instead (the same operations, so the same weights).
class Q4Values {
 public:
  static Q4Values Affine(float d, float m) { return Q4Values(Set1(d), Set1(m), true); }
  static Q4Values Centered(float d) { return Q4Values(Set1(d), Set1(8.0f), false); }
  Vec Low(IVec codes) const { return Rebuild(ToFloat(LowNibble(codes))); }
  Vec High(IVec codes) const { return Rebuild(ToFloat(HighNibble(codes))); }

 private:
  Q4Values(Vec d, Vec c, bool affine) : d_(d), c_(c), affine_(affine) {}
  Vec Rebuild(Vec q) const { return affine_ ? Add(Mul(q, d_), c_) : Mul(Sub(q, c_), d_); }
  Vec d_, c_;
  bool affine_;
};

#else
#error "specjax kernels need AVX-512F or AVX2 + FMA (the caller falls back to XLA when this does not build)"
#endif

inline void Pause() { _mm_pause(); }

// 256-bit helpers of the int8-activation products, the same on both builds (an AVX-512 CPU has AVX2).
inline float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline int32_t SumInt8(__m256i v) {  // the sum of 8 int32 lanes
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;  // vpdpbusd on 256-bit vectors
#else
constexpr bool kVnni = false;
#endif
// acc + the sums of 4 adjacent products of unsigned bytes u and signed bytes s, per int32 lane, exact where no
// pair of products exceeds int16 (|u| <= 128, |s| <= 127): vpdpbusd with AVX-512 VNNI, else vpmaddubsw + vpmaddwd.
inline __m256i DotBytes(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Kernel scratch on 64-byte boundaries (a cache line): a vector load that straddles two lines costs two, and
// malloc's 16-byte alignment made most of a 4-token product's activation loads straddle (up to ~20% of it on Zen 4).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <class U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
using Floats = std::vector<float, Aligned64<float>>;

// exp(x) for x <= 0 (scores minus their maximum): Cody-Waite range reduction and a degree-6 Taylor polynomial
// (truncation below 1.3e-7 relative on the reduced range); arguments below -87 give 0.  The same operations on
// both instruction sets, lane for lane.
inline Vec Exp(Vec x) {
  const Vec lo = Set1(-87.0f);
  const Mask under = Less(x, lo);
  x = Max(x, lo);
  const Vec n = RoundNearest(Mul(x, Set1(1.44269504088896341f)));
  Vec r = Fnma(n, Set1(0.693359375f), x);
  r = Fnma(n, Set1(-2.12194440e-4f), r);
  Vec p = Set1(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = Fma(p, r, Set1(c));
  return ZeroWhere(under, ScalePow2(p, n));
}

}  // namespace specjax_simd
