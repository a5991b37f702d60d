// specjax CPU kernels: the row tiles of the integer-activation block products (quant_matmul.cc): 8 interleaved rows
// in 256-bit vectors on both builds, 16 in 512-bit ones on AVX-512BW, times a tile of tokens.
//
// Included by quant_matmul.cc alone, with internal linkage (an unnamed namespace), as quant_blocks.h.
#pragma once

#include "quant_blocks.h"

namespace {

// The vector width of an integer product's row tile: Rows8 takes one group of 8 interleaved rows in 256-bit
// vectors (both builds); Rows16 (AVX-512BW) takes two adjacent groups, 16 rows, in 512-bit vectors: group g's codes
// in the low half and g + 1's in the high half (the layout stays the one of 8), so each instruction serves twice
// the rows.  `next` is the distance from a group's block to the next group's (codes: bytes; scales: halves).
struct Rows8 {
  static constexpr int kRows = 8;
  using I = __m256i;
  using F = __m256;
  static I Codes(const uint8_t* c, int64_t) { return Load256(c); }
  static F Halves(const uint16_t* h, int64_t) { return _mm256_cvtph_ps(Load128(h)); }
  static I Bcast(int32_t v) { return _mm256_set1_epi32(v); }
  static F Set1(float v) { return _mm256_set1_ps(v); }
  static I ZeroI() { return _mm256_setzero_si256(); }
  static F ZeroF() { return _mm256_setzero_ps(); }
  static I Low4(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I High4(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  static I Abs8(I v) { return _mm256_abs_epi8(v); }
  static I Offset8(I v) { return _mm256_xor_si256(v, _mm256_set1_epi8(-128)); }  // w + 128 as an unsigned byte
  static I Sign8(I x, I s) { return _mm256_sign_epi8(x, s); }  // x negated where s < 0 (zeroed where 0: u is 0)
  static I AddI(I a, I b) { return _mm256_add_epi32(a, b); }
  static I Times255(I v) { return _mm256_sub_epi32(_mm256_slli_epi32(v, 8), v); }
  static I Pairs(I u, I x) { return _mm256_maddubs_epi16(u, x); }
  static I Add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I Widen16(I v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }
  static I Dot(I acc, I u, I x) { return DotBytes(acc, u, x); }
  static F Float(I v) { return _mm256_cvtepi32_ps(v); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static void Store(float* out, F v) { _mm256_storeu_ps(out, v); }
};

#if defined(__AVX512BW__)
struct Rows16 {
  static constexpr int kRows = 16;
  using I = __m512i;
  using F = __m512;
  static I Codes(const uint8_t* c, int64_t next) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(Load256(c)), Load256(c + next), 1);
  }
  static F Halves(const uint16_t* h, int64_t next) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(Load128(h)), Load128(h + next), 1));
  }
  static I Bcast(int32_t v) { return _mm512_set1_epi32(v); }
  static F Set1(float v) { return _mm512_set1_ps(v); }
  static I ZeroI() { return _mm512_setzero_si512(); }
  static F ZeroF() { return _mm512_setzero_ps(); }
  static I Low4(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I High4(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
  static I Abs8(I v) { return _mm512_abs_epi8(v); }
  static I Offset8(I v) { return _mm512_xor_si512(v, _mm512_set1_epi8(-128)); }
  static I Sign8(I x, I s) { return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(s), _mm512_setzero_si512(), x); }
  static I AddI(I a, I b) { return _mm512_add_epi32(a, b); }
  static I Times255(I v) { return _mm512_sub_epi32(_mm512_slli_epi32(v, 8), v); }
  static I Pairs(I u, I x) { return _mm512_maddubs_epi16(u, x); }
  static I Add16(I a, I b) { return _mm512_add_epi16(a, b); }
  static I Widen16(I v) { return _mm512_madd_epi16(v, _mm512_set1_epi16(1)); }
  static I Dot(I acc, I u, I x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, x);
#else
    return _mm512_add_epi32(acc, Widen16(Pairs(u, x)));
#endif
  }
  static F Float(I v) { return _mm512_cvtepi32_ps(v); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static void Store(float* out, F v) { _mm512_storeu_ps(out, v); }
};
constexpr bool kRows16 = true;
#else
using Rows16 = Rows8;  // never used: Rows() takes pairs of groups only where kRows16
constexpr bool kRows16 = false;
#endif

// Tiles of at least this many tokens take Rows16 where it is built.  SmolLM2's whole product chain on Zen 5 against
// Rows8 alone: 1.1-1.2x slower at 1-2 tokens (bound by the weights' bytes, and read as two streams of codes per
// thread), about even at 4, 1.2-1.7x faster at 6-16.
constexpr int kMinTokens16 = 4;

// Rows 8g .. 8g + V::kRows - 1 (interleaved groups g, g + 1 with Rows16) x TB tokens of an integer-activation
// product; rows past O (padding) are not written.  Per block, the codes as unsigned bytes u[j] are unpacked once for
// the TB tokens; each token's 4-byte groups of x are broadcast against them.  Q8_0's signed codes: with VNNI
// w + 128 (vpdpbusd's byte products are exact up to 255 * 128; the offset comes off as the bias -128 sum(x), as
// Q4_0's 8 does), else |w| with its sign moved onto x (|w| <= 128 keeps vpmaddubsw's pair sums unsaturated).
// int16 activations (X = 255 hi + lo, both bytes in [-127, 127]) take two byte products per code vector, combined
// exactly in int32: sum(u X) = 255 sum(u hi) + sum(u lo).  A row's sums are the same in either width: its lane does
// the same integer and float operations.
template <class V, Kind K, Act A, int TB>
inline void Group(const Weights& w, int64_t g, const Acts& a, int64_t t0, float* y, int64_t M, int64_t O) {
  static_assert(K != kBF16 && A != kF32, "bfloat16 weights and float32 activations take Tile");
  using I = typename V::I;
  using F = typename V::F;
  constexpr int kJ = K == kQ8_0 ? 8 : 4;  // vectors of codes per block
  const int64_t B = w.blocks;
  const int64_t next = B * GroupBytes<K>();  // the next group's codes, for Rows16
  F acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = V::ZeroF();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t gb = g * B + b;
    const uint8_t* c = w.codes + gb * GroupBytes<K>();
    // The stream kAhead blocks on (contiguous across groups), asked for now: the hardware prefetchers alone left a
    // cold 3072-row Q4_1 product on one core at ~60% of the read bandwidth (65 -> 46 us at M = 1, 85 -> 78 at M = 4).
    for (int64_t o = 0; o < GroupBytes<K>(); o += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(c) + kAhead * GroupBytes<K>() + o, _MM_HINT_T0);
      if constexpr (V::kRows == 16)
        _mm_prefetch(reinterpret_cast<const char*>(c) + next + kAhead * GroupBytes<K>() + o, _MM_HINT_T0);
    }
    if (b % 4 == 0) {  // 4 blocks' 8 scales (and mins) per line
      for (int64_t h = 0; h < V::kRows / 8; ++h) {
        _mm_prefetch(reinterpret_cast<const char*>(w.scales + (gb + h * B + kAhead) * 8), _MM_HINT_T0);
        if constexpr (K == kQ4_1)
          _mm_prefetch(reinterpret_cast<const char*>(w.mins + (gb + h * B + kAhead) * 8), _MM_HINT_T0);
      }
    }
    I u[8], sg[8];
    for (int j = 0; j < kJ; ++j) {
      const I v = V::Codes(c + 32 * j, next);
      if constexpr (K == kQ8_0 && kVnni) {
        u[j] = V::Offset8(v);
      } else if constexpr (K == kQ8_0) {
        sg[j] = v;
        u[j] = V::Abs8(v);
      } else {
        u[j] = V::Low4(v);       // weights 4j .. 4j + 3 of each row
        u[j + 4] = V::High4(v);  // 16 + 4j .. 16 + 4j + 3
      }
    }
    const F d = V::Halves(w.scales + gb * 8, B * 8);
    F m = V::ZeroF();
    if constexpr (K == kQ4_1) m = V::Halves(w.mins + gb * 8, B * 8);
    // sum over the block of u * x for one byte plane x (32 bytes in order), a row in each 32-bit lane
    auto dot = [&](const int8_t* x) {
      auto xs = [x](int j) {  // x's bytes 4j .. 4j + 3 in every 32-bit lane
        int32_t four;
        std::memcpy(&four, x + 4 * j, 4);
        return V::Bcast(four);
      };
      if constexpr (K != kQ8_0 && !kVnni) {
        // Without VNNI, Q4's codes (at most 15) let the 8 vpmaddubsw pair sums (|.| <= 2 * 15 * 127 each) add in
        // int16 lanes exactly (|.| <= 30480) before one vpmaddwd widens them: 17 multiplies and adds a block and
        // token instead of DotBytes' 24 (the 8 broadcasts of x either way), the same integer sums.
        I s16 = V::Pairs(u[0], xs(0));
        for (int j = 1; j < 8; ++j) s16 = V::Add16(s16, V::Pairs(u[j], xs(j)));
        return V::Widen16(s16);
      } else {
        I s = V::ZeroI();
        for (int j = 0; j < 8; ++j) {
          I xv = xs(j);
          if constexpr (K == kQ8_0 && !kVnni) xv = V::Sign8(xv, sg[j]);
          s = V::Dot(s, u[j], xv);
        }
        return s;
      }
    };
    for (int t = 0; t < TB; ++t) {
      const int64_t tb = (t0 + t) * B + b;
      I s = dot(a.q + tb * 32);
      if constexpr (A == kI16) s = V::AddI(V::Times255(s), dot(a.lo + tb * 32));
      if constexpr (HasBias<K>()) s = V::AddI(s, V::Bcast(a.bias[tb]));
      acc[t] = V::Fma(V::Float(s), V::Mul(d, V::Set1(a.scale[tb])), acc[t]);
      if constexpr (K == kQ4_1) acc[t] = V::Fma(m, V::Set1(a.sums[tb]), acc[t]);
    }
  }
  const int64_t valid = O - 8 * g < V::kRows ? O - 8 * g : V::kRows;
  for (int t = 0; t < TB; ++t) {
    alignas(64) float out[V::kRows];
    V::Store(out, acc[t]);
    for (int r = 0; r < valid; ++r) y[(8 * g + r) * M + t0 + t] = out[r];
  }
}

}  // namespace
