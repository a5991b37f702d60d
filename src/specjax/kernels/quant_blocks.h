// specjax CPU kernels: what the GGUF block products of quant_matmul.cc share: the views of a matrix's blocks and of
// a call's activations, and the activations' quantization to int8 or 16-bit integers per block of 32.
//
// Included by quant_matmul.cc alone, and everything here has internal linkage (an unnamed namespace): a second build
// of the kernels loaded in the same process (the AVX2 one beside the native one, specjax.kernels.isa_flags) must
// never bind to these definitions, which differ between the builds.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

using namespace specjax_simd;

enum Kind { kQ4_0, kQ4_1, kQ8_0, kBF16 };

struct Weights {
  const uint8_t* codes;
  const uint16_t* scales;  // float16 bits; not BF16
  const uint16_t* mins;    // Q4_1 only

  float Scale(int64_t blk) const { return _cvtsh_ss(scales[blk]); }
  float Min(int64_t blk) const { return _cvtsh_ss(mins[blk]); }
  int64_t blocks;       // I / 32
};

template <Kind K>
constexpr int64_t CodeBytes() { return K == kBF16 ? 64 : K == kQ8_0 ? 32 : 16; }

// A call's activations as the row tiles read them: float32, token-major [M, I] (row stride I); or (integer variants)
// quantized per block: q [M, I] bytes in order (int16: q and lo, the high and low bytes), scale [M, B] (dx), Q4_1's
// sums [M, B] (the float sum of each block of x, for the min term) and the bias [M, B] of codes stored with an
// offset (HasBias: -offset * the sum of the block's integers, exact in the integer sum).
struct Acts {
  const float* xt;
  int64_t I;
  const int8_t* q;   // int8: the codes; int16: each value's high byte (see QuantizeBlock16)
  const int8_t* lo;  // int16: each value's low byte; else unused
  const float* scale;
  const float* sums;
  const int32_t* bias;
};

// How a product takes its activations: float32, or quantized per block of 32 to int8 or to 16-bit integers.
enum Act { kF32, kI8, kI16 };

inline __m256i Load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i Load128(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

constexpr int64_t kAhead = 8;  // blocks of codes prefetched ahead of the one being multiplied

template <Kind K>
constexpr int64_t GroupBytes() { return K == kQ8_0 ? 256 : 128; }  // 8 interleaved rows' codes of one block

// Whether an integer product adds a per-block bias to its byte sums: the codes' offset (Q4_0's 8, Q8_0's 128 with
// VNNI) times the sum of the block's activation integers, exact in int32.
template <Kind K>
constexpr bool HasBias() { return K == kQ4_0 || (K == kQ8_0 && kVnni); }
template <Kind K>
constexpr int32_t CodeOffset() { return K == kQ4_0 ? 8 : 128; }

// The 32 activations of a block at x into v (4 x 8 lanes); -> their largest magnitude, and their float sum to sum_x.
inline float LoadBlock(const float* x, __m256* v, float* sum_x) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + 8 * k);
  const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                    _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
  *sum_x = Sum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// 4 x 8 int32 lanes in [-127, 127] as 32 bytes in order at out; -> their sum.
inline int32_t StoreBytes(const __m256i* q, int8_t* out) {
  const __m256i packed = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
  return SumInt8(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
}

// One token's block of 32 activations as int8: q = round-to-nearest-even(x * (1 / dx)), dx = amax / 127 (0 for an
// all-zero block), its bytes in order at q; -> dx, the float sum of x and the sum of q.
inline float QuantizeBlock(const float* x, int8_t* q, float* sum_x, int32_t* sum_q) {
  __m256 v[4];
  const float dx = LoadBlock(x, v, sum_x) / 127.0f;
  const __m256 inv = _mm256_set1_ps(dx > 0.0f ? 1.0f / dx : 0.0f);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));  // MXCSR: nearest even
  *sum_q = StoreBytes(i, q);
  return dx;
}

// One token's block of 32 activations as 16-bit integers X = round-to-nearest-even(x * (1 / dX)), dX = amax / 32512,
// each split as X = 255 hi + lo with hi = round(X / 255) and lo in [-127, 127] (both fit a signed byte, and the byte
// products stay exact: quant_rows.h): hi's bytes in order at hi, lo's at lo; -> dX, the float sum of x and the sum
// of X.  A value's error is at most dX / 2 = amax / 65024: 256 times finer than int8's.
inline float QuantizeBlock16(const float* x, int8_t* hi, int8_t* lo, float* sum_x, int32_t* sum_q) {
  __m256 v[4];
  const float dx = LoadBlock(x, v, sum_x) / 32512.0f;
  const __m256 inv = _mm256_set1_ps(dx > 0.0f ? 1.0f / dx : 0.0f);
  const __m256 inv255 = _mm256_set1_ps(1.0f / 255.0f);
  __m256i h[4], l[4], X[4];
  for (int k = 0; k < 4; ++k) {
    X[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));  // MXCSR: nearest even; |X| <= 32512
    // X / 255 is never within 0.002 of a half (255 is odd), far above this product's rounding: hi = round(X / 255)
    h[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(X[k]), inv255));
    l[k] = _mm256_sub_epi32(X[k], _mm256_mullo_epi32(h[k], _mm256_set1_epi32(255)));
  }
  StoreBytes(h, hi);
  StoreBytes(l, lo);
  *sum_q = SumInt8(_mm256_add_epi32(_mm256_add_epi32(X[0], X[1]), _mm256_add_epi32(X[2], X[3])));
  return dx;
}

// The integer activations of a call (Acts), owned.
struct IntBuffers {
  std::vector<int8_t, Aligned64<int8_t>> q, lo;
  Floats scale, sums;
  std::vector<int32_t, Aligned64<int32_t>> bias;
};

// The int8 or int16 activations of x (token-major [M, I]) into `a`, backed by `buf`.
template <Kind K, Act A>
void QuantizeActs(const float* xt, int64_t I, int64_t M, IntBuffers& buf, Acts& a) {
  const int64_t B = I / 32;
  buf.q.assign(M * I, 0);
  if (A == kI16) buf.lo.assign(M * I, 0);
  buf.scale.assign(M * B, 0.0f);
  if (K == kQ4_1) buf.sums.assign(M * B, 0.0f);
  if (HasBias<K>()) buf.bias.assign(M * B, 0);
  for (int64_t t = 0; t < M; ++t) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t tb = t * B + b;
      int8_t* q = buf.q.data() + tb * 32;
      float sum_x;
      int32_t sum_q;
      if constexpr (A == kI16) {
        buf.scale[tb] = QuantizeBlock16(xt + t * I + b * 32, q, buf.lo.data() + tb * 32, &sum_x, &sum_q);
      } else {
        buf.scale[tb] = QuantizeBlock(xt + t * I + b * 32, q, &sum_x, &sum_q);
      }
      if (K == kQ4_1) buf.sums[tb] = sum_x;
      if (HasBias<K>()) buf.bias[tb] = -CodeOffset<K>() * sum_q;
    }
  }
  a.q = buf.q.data();
  a.lo = buf.lo.data();
  a.scale = buf.scale.data();
  a.sums = buf.sums.data();
  a.bias = buf.bias.data();
}

// x [I, M] (feature-major, as the model runs) -> xt [M, I] (token-major, as the tiles read it): kLanes x kLanes tiles
// through registers, the last tile of tokens masked (I is a multiple of 32).  9x fewer instructions than a scalar
// copy, which took ~1.4 ms of a 16-token step of SmolLM2 (its ~120 products).
inline void TokenMajor(const float* x, int64_t I, int64_t M, float* xt) {
  for (int64_t t0 = 0; t0 < M; t0 += kLanes) {
    const int n = M - t0 < kLanes ? static_cast<int>(M - t0) : kLanes;
    for (int64_t i0 = 0; i0 < I; i0 += kLanes) {
      Vec r[kLanes];
      for (int i = 0; i < kLanes; ++i) r[i] = LoadN(x + (i0 + i) * M + t0, n);
      TransposeTile(r);
      for (int t = 0; t < n; ++t) Store(xt + (t0 + t) * I + i0, r[t]);
    }
  }
}

}  // namespace
