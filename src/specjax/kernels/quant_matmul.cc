// specjax CPU kernels: y[O, M] = W[O, I] @ x[I, M] with W kept in GGUF block formats (Q4_0, Q4_1, Q8_0), or as
// bfloat16 (a bfloat16 drafter's matrices: exactly its float32 values in half the bytes).
//
// Decoding on a CPU is bound by the bytes of weights it reads per step.  XLA:CPU can only multiply float32
// weights (a float32 x int8 product first copies the whole weight to float32), so a Q4_1 model is read as 4
// bytes per weight instead of 0.625.  These kernels stream the blocks, rebuild each weight in registers with
// the same float32 operations as specjax.model.gguf_file.dequantize (bit-identical weights; build with
// -ffp-contract=off; a Q4 block's 16 possible values once, then a lookup per weight, where that is faster), and
// multiply it into up to 4 tokens at a time (AVX-512F or AVX2 + FMA: simd.h).  Only the
// summation order differs from a float32 dot, and it is the same for every M: a token's result does not depend on
// how many tokens share the call (verification and plain decoding round alike).
//
// Layout (prepared at load time by specjax.model.quant): codes [O, I/32, bytes of one block's codes]
// (Q4: 16 bytes, low nibbles = weights 0..15 of the block, high nibbles = 16..31; Q8: 32 int8; BF16: 32 uint16),
// scales d and (Q4_1) mins m as GGUF stores them, float16 bits [O, I/32] (none for BF16; converted exactly, F16C:
// float32 copies made a Q4_1 block 24 bytes instead of 20, and decoding streams every block).  Rows are split between
// the caller and helper threads (workers.h: as many threads in all as XLA:CPU's intra-op pool has).
//
// The GGUF kinds also have an int8-activation variant (handlers *I8, llama.cpp's scheme): each token's activations
// are quantized per block of 32 (scale amax / 127, round to nearest even), a block's codes multiply them as bytes
// into int32 (AVX-512 VNNI vpdpbusd, else AVX2 vpmaddubsw + vpmaddwd; exact, Q4_0's offset of 8 included), and each
// block's sum is scaled by d * dx in float32; Q4_1's min term uses the exact float sums of x's blocks.  ~1e-3 of
// sum |w x| from the float32 product, and faster: 32 products per instruction instead of 8-16.  Their matrices are
// laid out with the rows interleaved 8 at a time (llama.cpp's repacked layout, made at load time by
// specjax.model.quant.interleave): for row group g and block b, vector j's 32-bit lane r holds row 8g + r's codes
// 4j .. 4j + 3 (Q4: low nibbles weights 4j.., high nibbles 16 + 4j..; Q8_0: 8 vectors of bytes), so vpdpbusd of a
// vector against a token's 4 activation bytes broadcast gives 8 rows' partial sums, and one convert / scale / FMA
// per block serves 8 rows: 1.2-1.6x the one-row-at-a-time tile on one core at M = 1-8 (docs/results/kflat.md).
// 256 bits wide on both builds.  A token's result still depends on nothing but its own activations.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "simd.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

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

constexpr int kVecs = 32 / kLanes;  // vectors per block of 32 weights

// Block b of row r as float32 weights: out[j] holds weights j * kLanes .. (j + 1) * kLanes - 1.
template <Kind K>
inline void Dequant(const Weights& w, int64_t r, int64_t b, Vec* out) {
  const int64_t blk = r * w.blocks + b;
  const uint8_t* c = w.codes + blk * CodeBytes<K>();
  if constexpr (K == kBF16) {
    for (int j = 0; j < kVecs; ++j) out[j] = BF16ToFloat(reinterpret_cast<const uint16_t*>(c) + j * kLanes);
  } else if constexpr (K == kQ8_0) {
    const Vec d = Set1(w.Scale(blk));
    for (int j = 0; j < kVecs; ++j) out[j] = Mul(ToFloat(I8ToI32(c + j * kLanes)), d);
  } else {  // a Q4 block: low nibbles are weights 0..15, high nibbles 16..31
    const Q4Values values = K == kQ4_0 ? Q4Values::Centered(w.Scale(blk)) : Q4Values::Affine(w.Scale(blk), w.Min(blk));
    constexpr int half = kVecs / 2;
    for (int j = 0; j < half; ++j) {
      const IVec v = U8ToI32(c + j * kLanes);
      out[j] = values.Low(v);
      out[j + half] = values.High(v);
    }
  }
}

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

// One row x TB tokens (t0 .. t0 + TB - 1), y is [O, M] (row stride M).  Each token has one accumulator that takes
// the block's vectors in order: the same sums whatever TB is.  One row at a time: tiles of 2-4 rows (x loaded once
// for them) measured 1.1-2.4x slower on Zen 4 (a Q8_0 or BF16 matrix at M = 1, a 1536-wide Q4_1 one), and no faster
// anywhere (one core, every kind and M = 1, 2, 4).
template <Kind K, int TB>
inline void Tile(const Weights& w, int64_t r, const Acts& a, int64_t t0, float* y, int64_t M) {
  const float* xt = a.xt + t0 * a.I;
  Vec acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = Zero();
  for (int64_t b = 0; b < w.blocks; ++b) {
    Vec wv[kVecs];
    Dequant<K>(w, r, b, wv);
    for (int j = 0; j < kVecs; ++j)
      for (int t = 0; t < TB; ++t) acc[t] = Fma(wv[j], Load(xt + t * a.I + b * 32 + j * kLanes), acc[t]);
  }
  for (int t = 0; t < TB; ++t) y[r * M + t0 + t] = Sum(acc[t]);
}

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
// Q4_0's 8 does), else |w| with its sign moved onto x (|w| <= 128 keeps vpmaddubsw's pair sums unsaturated).  int16 activations (X = 255 hi + lo, both bytes in
// [-127, 127]) take two byte products per code vector, combined exactly in int32: sum(u X) = 255 sum(u hi) +
// sum(u lo).  A row's sums are the same in either width: its lane does the same integer and float operations.
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

template <Kind K, Act A, int TB>
void RowsTB(const Weights& w, const Acts& a, int64_t t0, float* y, int64_t M, int64_t r0, int64_t r1) {
  if constexpr (A != kF32) {  // r0 is a multiple of 16, r1 too or O: the groups of 8 in [r0, r1), rows below r1 written
    int64_t g = r0 / 8;
    if constexpr (kRows16 && TB >= kMinTokens16) {  // two groups at once while [r0, r1) holds both
      for (; 8 * (g + 1) < r1; g += 2) Group<Rows16, K, A, TB>(w, g, a, t0, y, M, r1);
    }
    for (; 8 * g < r1; ++g) Group<Rows8, K, A, TB>(w, g, a, t0, y, M, r1);
  } else {
    for (int64_t r = r0; r < r1; ++r) Tile<K, TB>(w, r, a, t0, y, M);
  }
}

constexpr int64_t kRowBlock = 16;  // rows whose codes one token tile after another reads: a thread's work item

// Tokens per tile: an integer product's tile unpacks a block's codes once for all its tokens, so a wider tile takes
// more rows a step for the same unpacking (the 5th token once cost ~2.5x the 2nd-4th, as a second tile of one); 8
// accumulators and 8 vectors of codes fit AVX-512's 32 registers.  A float32 tile keeps 4.
template <Act A>
constexpr int MaxTile() { return A == kF32 ? 4 : kRows16 ? 16 : 8; }

// Rows [r0, r1): blocks of kRowBlock rows outer, token tiles inner, so a block's codes are read from memory once.
template <Kind K, Act A>
void Rows(const Weights& w, const Acts& a, float* y, int64_t M, int64_t r0, int64_t r1) {
  constexpr int64_t T = MaxTile<A>();
  for (int64_t b = r0; b < r1; b += kRowBlock) {
    const int64_t e = b + kRowBlock < r1 ? b + kRowBlock : r1;
    for (int64_t t0 = 0; t0 < M; t0 += T) {
      switch (M - t0 < T ? M - t0 : T) {
        case 1: RowsTB<K, A, 1>(w, a, t0, y, M, b, e); break;
        case 2: RowsTB<K, A, 2>(w, a, t0, y, M, b, e); break;
        case 3: RowsTB<K, A, 3>(w, a, t0, y, M, b, e); break;
        case 4: RowsTB<K, A, 4>(w, a, t0, y, M, b, e); break;
        case 5: RowsTB<K, A, MaxTile<A>() < 5 ? 1 : 5>(w, a, t0, y, M, b, e); break;
        case 6: RowsTB<K, A, MaxTile<A>() < 6 ? 1 : 6>(w, a, t0, y, M, b, e); break;
        case 7: RowsTB<K, A, MaxTile<A>() < 7 ? 1 : 7>(w, a, t0, y, M, b, e); break;
        case 8: RowsTB<K, A, MaxTile<A>() < 8 ? 1 : 8>(w, a, t0, y, M, b, e); break;
        case 9: RowsTB<K, A, MaxTile<A>() < 9 ? 1 : 9>(w, a, t0, y, M, b, e); break;
        case 10: RowsTB<K, A, MaxTile<A>() < 10 ? 1 : 10>(w, a, t0, y, M, b, e); break;
        case 11: RowsTB<K, A, MaxTile<A>() < 11 ? 1 : 11>(w, a, t0, y, M, b, e); break;
        case 12: RowsTB<K, A, MaxTile<A>() < 12 ? 1 : 12>(w, a, t0, y, M, b, e); break;
        case 13: RowsTB<K, A, MaxTile<A>() < 13 ? 1 : 13>(w, a, t0, y, M, b, e); break;
        case 14: RowsTB<K, A, MaxTile<A>() < 14 ? 1 : 14>(w, a, t0, y, M, b, e); break;
        case 15: RowsTB<K, A, MaxTile<A>() < 15 ? 1 : 15>(w, a, t0, y, M, b, e); break;
        default: RowsTB<K, A, MaxTile<A>()>(w, a, t0, y, M, b, e); break;
      }
    }
  }
}

// How one call's rows are shared between the threads: each thread owns a contiguous range of groups of kRowBlock
// rows, (front, back) in one atomic word, and takes its own groups from the front, then what is left of the others'
// ranges from their backs.  So a thread that starts late (a helper waking up: ~10 us of a ~70 us product on the
// 2-core VM, which the caller spent spinning when each thread had a fixed half; a helper busy with another call)
// or runs slow (a stalled vCPU) leaves its rows to the others, and each thread still streams contiguous rows.  Held
// by every thread (shared_ptr): a helper that starts after the call returned finds every group taken and touches
// nothing else of the call's.
struct Split {
  Split(int64_t groups, int64_t n) : ranges(n), left(groups) {
    for (int64_t k = 0; k < n; ++k)
      ranges[k].fb.store(static_cast<uint64_t>(groups * (k + 1) / n) << 32 | static_cast<uint64_t>(groups * k / n));
  }
  // A group of thread k's range (its first left if front, else its last left) into *g; false when none is left.
  bool Take(int64_t k, bool front, int64_t* g) {
    std::atomic<uint64_t>& r = ranges[k].fb;
    uint64_t v = r.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t f = v & 0xffffffffu, b = v >> 32;
      if (f >= b) return false;
      const uint64_t next = front ? (b << 32 | (f + 1)) : ((b - 1) << 32 | f);
      if (r.compare_exchange_weak(v, next, std::memory_order_relaxed)) {
        *g = static_cast<int64_t>(front ? f : b - 1);
        return true;
      }
    }
  }
  struct alignas(64) Range {  // a cache line each: the threads' claims do not contend for one line
    std::atomic<uint64_t> fb;
  };
  std::vector<Range> ranges;
  alignas(64) std::atomic<int64_t> left;  // groups not finished yet: the caller returns when none is
};

template <Kind K, Act A>
void Work(Split& s, int64_t k, const Weights& w, const Acts& a, float* y, int64_t M, int64_t O) {
  const int64_t n = static_cast<int64_t>(s.ranges.size());
  int64_t done = 0;
  for (int64_t d = 0; d < n; ++d) {
    int64_t g;
    while (s.Take((k + d) % n, d == 0, &g)) {
      Rows<K, A>(w, a, y, M, g * kRowBlock, (g + 1) * kRowBlock < O ? (g + 1) * kRowBlock : O);
      ++done;
    }
  }
  if (done > 0) s.left.fetch_sub(done, std::memory_order_release);
}

// One token's block of 32 activations quantized: q's bytes 0..15 to lo, 16..31 to hi; -> dx, the float sum of x
// and the sum of q.  dx = amax / 127, q = round-to-nearest-even(x * (1 / dx)) (0 for an all-zero block).
inline float QuantizeBlock(const float* x, int8_t* lo, int8_t* hi, float* sum_x, int32_t* sum_q) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + 8 * k);
  const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                    _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float dx = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))) / 127.0f;
  const __m256 inv = _mm256_set1_ps(dx > 0.0f ? 1.0f / dx : 0.0f);
  __m256i q[4];
  for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));  // MXCSR: nearest even
  const __m256i packed = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm256_castsi256_si128(packed));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm256_extracti128_si256(packed, 1));
  *sum_x = Sum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  *sum_q = SumInt8(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
  return dx;
}

// One token's block of 32 activations as 16-bit integers X = round-to-nearest-even(x * (1 / dX)), dX = amax / 32512,
// each split as X = 255 hi + lo with hi = round(X / 255) and lo in [-127, 127] (both fit a signed byte, and the byte
// products stay exact: see Group8): hi's bytes in order to hi, lo's to lo; -> dX, the float sum of x and the sum of X.
// A value's error is at most dX / 2 = amax / 65024: 256 times finer than int8's.
inline float QuantizeBlock16(const float* x, int8_t* hi, int8_t* lo, float* sum_x, int32_t* sum_q) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + 8 * k);
  const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                    _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float dx = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))) / 32512.0f;
  const __m256 inv = _mm256_set1_ps(dx > 0.0f ? 1.0f / dx : 0.0f);
  const __m256 inv255 = _mm256_set1_ps(1.0f / 255.0f);
  __m256i h[4], l[4], X[4];
  for (int k = 0; k < 4; ++k) {
    X[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));  // MXCSR: nearest even; |X| <= 32512
    // X / 255 is never within 0.002 of a half (255 is odd), far above this product's rounding: hi = round(X / 255)
    h[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(X[k]), inv255));
    l[k] = _mm256_sub_epi32(X[k], _mm256_mullo_epi32(h[k], _mm256_set1_epi32(255)));
  }
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  auto bytes = [&order](const __m256i* q, int8_t* out) {  // 32 int32 lanes in [-127, 127] -> 32 bytes in order
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
  };
  bytes(h, hi);
  bytes(l, lo);
  *sum_x = Sum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
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
        buf.scale[tb] = QuantizeBlock(xt + t * I + b * 32, q, q + 16, &sum_x, &sum_q);
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

template <Kind K, Act A>
ffi::Error Run(ffi::ThreadPool pool, const Weights& w, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t O = y->dimensions()[0], M = y->dimensions()[1], I = w.blocks * 32;
  if (x.dimensions()[0] != I || x.dimensions()[1] != M) {
    return ffi::Error::InvalidArgument("specjax quant matmul: x must be [I, M] with I = 32 * blocks");
  }
  const float* xt = x.typed_data();
  Floats scratch;
  if (M > 1 || reinterpret_cast<uintptr_t>(xt) % 64 != 0) {  // x [I, M] -> token-major [M, I], line-aligned
    scratch.resize(I * M);
    TokenMajor(xt, I, M, scratch.data());
    xt = scratch.data();
  }
  Acts a{xt, I, nullptr, nullptr, nullptr, nullptr, nullptr};
  IntBuffers buf;
  if constexpr (A != kF32) QuantizeActs<K, A>(xt, I, M, buf, a);
  float* out = y->typed_data();
  int64_t n = pool.num_threads();
  if (n < 1) n = 1;
  if (n > O / 64) n = O / 64 > 0 ? O / 64 : 1;
  auto split = std::make_shared<Split>((O + kRowBlock - 1) / kRowBlock, n);
  specjax_workers_v4::Share(pool, M, static_cast<int>(n - 1),
                            [split, w, a, out, M, O](int k) { Work<K, A>(*split, k, w, a, out, M, O); });
  Work<K, A>(*split, 0, w, a, out, M, O);
  while (split->left.load(std::memory_order_acquire) > 0) Pause();
  return ffi::Error::Success();
}

// A matrix stacked with the other layers' ([L, ...]: model/stack.py) is read at `layer`; layer < 0: the buffer is
// the matrix itself.  Rows per block group and blocks per row are then the dimensions after the layer's.
template <ffi::DataType T>
const ffi::NativeType<T>* AtLayer(const ffi::Buffer<T>& b, int64_t layer) {
  if (layer < 0) return b.typed_data();
  return b.typed_data() + layer * static_cast<int64_t>(b.element_count() / b.dimensions()[0]);
}

template <ffi::DataType T>
int64_t BlocksPerRow(const ffi::Buffer<T>& b, int64_t layer) {
  return b.dimensions()[layer < 0 ? 1 : 2];
}

template <ffi::DataType T>
bool LayerInRange(const ffi::Buffer<T>& b, int64_t layer) {
  return layer < 0 || (b.dimensions().size() >= 3 && layer < b.dimensions()[0]);
}

ffi::Error LayerError() {
  return ffi::Error::InvalidArgument("specjax quant matmul: layer out of range of the stacked weights");
}

template <Act A>
ffi::Error Q4_0(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::U16> scales,
                ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, int64_t layer) {
  if (!LayerInRange(codes, layer) || !LayerInRange(scales, layer)) return LayerError();
  Weights w{AtLayer(codes, layer), AtLayer(scales, layer), nullptr, BlocksPerRow(scales, layer)};
  return Run<kQ4_0, A>(pool, w, x, y);
}

template <Act A>
ffi::Error Q4_1(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::U16> scales,
                ffi::Buffer<ffi::U16> mins, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, int64_t layer) {
  if (!LayerInRange(codes, layer) || !LayerInRange(scales, layer) || !LayerInRange(mins, layer)) return LayerError();
  Weights w{AtLayer(codes, layer), AtLayer(scales, layer), AtLayer(mins, layer), BlocksPerRow(scales, layer)};
  return Run<kQ4_1, A>(pool, w, x, y);
}

template <Act A>
ffi::Error Q8_0(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::U16> scales,
                ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, int64_t layer) {
  if (!LayerInRange(codes, layer) || !LayerInRange(scales, layer)) return LayerError();
  Weights w{reinterpret_cast<const uint8_t*>(AtLayer(codes, layer)), AtLayer(scales, layer), nullptr,
            BlocksPerRow(scales, layer)};
  return Run<kQ8_0, A>(pool, w, x, y);
}

ffi::Error BF16(ffi::ThreadPool pool, ffi::Buffer<ffi::U16> codes, ffi::Buffer<ffi::F32> x,
                ffi::ResultBuffer<ffi::F32> y, int64_t layer) {
  if (!LayerInRange(codes, layer)) return LayerError();
  Weights w{reinterpret_cast<const uint8_t*>(AtLayer(codes, layer)), nullptr, nullptr, BlocksPerRow(codes, layer)};
  return Run<kBF16, kF32>(pool, w, x, y);
}

}  // namespace

#define SPECJAX_Q4_0_BINDING                                                                                   \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::U16>>()                \
      .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<int64_t>("layer")
#define SPECJAX_Q4_1_BINDING                                                                                   \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::U16>>()                \
      .Arg<ffi::Buffer<ffi::U16>>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<int64_t>("layer")
#define SPECJAX_Q8_0_BINDING                                                                                   \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::S8>>().Arg<ffi::Buffer<ffi::U16>>()                \
      .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<int64_t>("layer")
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ4_0, Q4_0<kF32>, SPECJAX_Q4_0_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ4_1, Q4_1<kF32>, SPECJAX_Q4_1_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ8_0, Q8_0<kF32>, SPECJAX_Q8_0_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ4_0I8, Q4_0<kI8>, SPECJAX_Q4_0_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ4_1I8, Q4_1<kI8>, SPECJAX_Q4_1_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ8_0I8, Q8_0<kI8>, SPECJAX_Q8_0_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ4_0I16, Q4_0<kI16>, SPECJAX_Q4_0_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ4_1I16, Q4_1<kI16>, SPECJAX_Q4_1_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ8_0I16, Q8_0<kI16>, SPECJAX_Q8_0_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxBF16, BF16,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer"));
