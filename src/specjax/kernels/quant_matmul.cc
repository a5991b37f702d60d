// specjax CPU kernels: y[O, M] = W[O, I] @ x[I, M] with W kept in GGUF block formats (Q4_0, Q4_1, Q8_0).
//
// Decoding on a CPU is bound by the bytes of weights it reads per step.  XLA:CPU can only multiply float32
// weights (a float32 x int8 product first copies the whole weight to float32), so a Q4_1 model is read as 4
// bytes per weight instead of 0.625.  These kernels stream the blocks, rebuild each weight in registers with
// the same float32 operations as specjax.model.gguf_file.dequantize (bit-identical weights; build with
// -ffp-contract=off), and multiply it into up to 4 tokens held in registers.  Only the summation order
// differs from a float32 dot, and it is the same for every M: a token's result does not depend on how many
// tokens share the call (verification and plain decoding round alike).
//
// Layout (prepared at load time by specjax.model.quant): codes [O, I/32, bytes of one block's codes]
// (Q4: 16 bytes, low nibbles = weights 0..15 of the block, high nibbles = 16..31; Q8: 32 int8), scales d and
// (Q4_1) mins m as float32 [O, I/32].  Rows are split over the XLA:CPU intra-op thread pool.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"

#if !defined(__AVX512F__)
#error "specjax kernels need AVX-512F (the caller falls back to XLA when this does not build)"
#endif

namespace ffi = xla::ffi;

namespace {

enum Kind { kQ4_0, kQ4_1, kQ8_0 };

struct Weights {
  const uint8_t* codes;
  const float* scales;
  const float* mins;  // Q4_1 only
  int64_t blocks;     // I / 32
};

template <Kind K>
constexpr int64_t CodeBytes() { return K == kQ8_0 ? 32 : 16; }

// The 32 weights of block b of row r as two float32 vectors (weights 0..15 and 16..31).
template <Kind K>
inline void Dequant(const Weights& w, int64_t r, int64_t b, __m512& lo, __m512& hi) {
  const int64_t blk = r * w.blocks + b;
  const uint8_t* c = w.codes + blk * CodeBytes<K>();
  const __m512 d = _mm512_set1_ps(w.scales[blk]);
  if constexpr (K == kQ8_0) {
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)c))), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + 16)))), d);
  } else {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)c));
    __m512 ql = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
    __m512 qh = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    if constexpr (K == kQ4_0) {  // (q - 8) * d
      lo = _mm512_mul_ps(_mm512_sub_ps(ql, _mm512_set1_ps(8.0f)), d);
      hi = _mm512_mul_ps(_mm512_sub_ps(qh, _mm512_set1_ps(8.0f)), d);
    } else {  // q * d + m, rounded twice like the numpy dequantization
      const __m512 m = _mm512_set1_ps(w.mins[blk]);
      lo = _mm512_add_ps(_mm512_mul_ps(ql, d), m);
      hi = _mm512_add_ps(_mm512_mul_ps(qh, d), m);
    }
  }
}

// RB rows x TB tokens; xt is token-major [TB, I] (row stride I), y is [O, M] (row stride M).
template <Kind K, int RB, int TB>
inline void Tile(const Weights& w, int64_t r0, const float* xt, int64_t I, float* y, int64_t M) {
  __m512 acc[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512 xlo[TB], xhi[TB];
    for (int t = 0; t < TB; ++t) {
      xlo[t] = _mm512_loadu_ps(xt + t * I + b * 32);
      xhi[t] = _mm512_loadu_ps(xt + t * I + b * 32 + 16);
    }
    for (int r = 0; r < RB; ++r) {
      __m512 lo, hi;
      Dequant<K>(w, r0 + r, b, lo, hi);
      for (int t = 0; t < TB; ++t) acc[r][t] = _mm512_fmadd_ps(hi, xhi[t], _mm512_fmadd_ps(lo, xlo[t], acc[r][t]));
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) y[(r0 + r) * M + t] = _mm512_reduce_add_ps(acc[r][t]);
}

template <Kind K, int TB>
void RowsTB(const Weights& w, const float* xt, int64_t I, float* y, int64_t M, int64_t r0, int64_t r1) {
  constexpr int RB = TB <= 2 ? 4 : 2;  // accumulators + x vectors stay within the 32 zmm registers
  int64_t r = r0;
  for (; r + RB <= r1; r += RB) Tile<K, RB, TB>(w, r, xt, I, y, M);
  for (; r < r1; ++r) Tile<K, 1, TB>(w, r, xt, I, y, M);
}

// Rows [r0, r1): blocks of 16 rows outer, token tiles of 4 inner, so a block's codes are read from memory once.
template <Kind K>
void Rows(const Weights& w, const float* xt, int64_t I, float* y, int64_t M, int64_t r0, int64_t r1) {
  constexpr int64_t kRowBlock = 16;
  for (int64_t b = r0; b < r1; b += kRowBlock) {
    const int64_t e = b + kRowBlock < r1 ? b + kRowBlock : r1;
    for (int64_t t0 = 0; t0 < M; t0 += 4) {
      const float* xs = xt + t0 * I;
      float* ys = y + t0;
      switch (M - t0 < 4 ? M - t0 : 4) {
        case 1: RowsTB<K, 1>(w, xs, I, ys, M, b, e); break;
        case 2: RowsTB<K, 2>(w, xs, I, ys, M, b, e); break;
        case 3: RowsTB<K, 3>(w, xs, I, ys, M, b, e); break;
        default: RowsTB<K, 4>(w, xs, I, ys, M, b, e); break;
      }
    }
  }
}

template <Kind K>
ffi::Error Run(ffi::ThreadPool pool, const Weights& w, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t O = y->dimensions()[0], M = y->dimensions()[1], I = w.blocks * 32;
  if (x.dimensions()[0] != I || x.dimensions()[1] != M) {
    return ffi::Error::InvalidArgument("specjax quant matmul: x must be [I, M] with I = 32 * blocks");
  }
  const float* xt = x.typed_data();
  std::vector<float> scratch;
  if (M > 1) {  // x [I, M] -> token-major [M, I] (at most 16 x I floats)
    scratch.resize(I * M);
    for (int64_t i = 0; i < I; ++i)
      for (int64_t t = 0; t < M; ++t) scratch[t * I + i] = xt[i * M + t];
    xt = scratch.data();
  }
  float* out = y->typed_data();
  int64_t n = pool.num_threads();
  if (n < 1) n = 1;
  if (n > O / 64) n = O / 64 > 0 ? O / 64 : 1;
  const int64_t per = ((O + n - 1) / n + 15) / 16 * 16;
  std::atomic<int64_t> pending(n - 1);
  for (int64_t k = 1; k < n; ++k) {
    const int64_t r0 = k * per < O ? k * per : O, r1 = (k + 1) * per < O ? (k + 1) * per : O;
    pool.Schedule([=, &w, &pending] {
      Rows<K>(w, xt, I, out, M, r0, r1);
      pending.fetch_sub(1, std::memory_order_release);
    });
  }
  Rows<K>(w, xt, I, out, M, 0, per < O ? per : O);
  while (pending.load(std::memory_order_acquire) > 0) _mm_pause();
  return ffi::Error::Success();
}

ffi::Error Q4_0(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scales,
                ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  Weights w{codes.typed_data(), scales.typed_data(), nullptr, scales.dimensions()[1]};
  return Run<kQ4_0>(pool, w, x, y);
}

ffi::Error Q4_1(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scales,
                ffi::Buffer<ffi::F32> mins, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  Weights w{codes.typed_data(), scales.typed_data(), mins.typed_data(), scales.dimensions()[1]};
  return Run<kQ4_1>(pool, w, x, y);
}

ffi::Error Q8_0(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::F32> scales,
                ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  Weights w{reinterpret_cast<const uint8_t*>(codes.typed_data()), scales.typed_data(), nullptr,
            scales.dimensions()[1]};
  return Run<kQ8_0>(pool, w, x, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ4_0, Q4_0,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ4_1, Q4_1,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ8_0, Q8_0,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
