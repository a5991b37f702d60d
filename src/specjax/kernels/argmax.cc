// specjax CPU kernel: the greedy token of each row of a head's vocab-major logits, x [V, M] float32 -> [M] int32.
//
// What sampling.first_argmax(x, axis=0) computes (the oracle): per column, the smallest row index holding the
// column's maximum, or the first NaN's row if the column has one.  XLA:CPU takes ~0.2 ms for one column of
// SmolLM2's 49,152 logits (a max, a compare-select and a min: three passes it does not vectorise well) and ~0.45-0.7
// ms for four, where transposing the vocab-major product first or reducing over its rows as they lie cost the
// same.  This reads x once, in memory order, 8 floats a vector: with S = M / gcd(8, M) vectors a step (8 S floats,
// whole rows), each lane of each of the S streams always holds the same column, so a stream keeps, per lane, the
// largest value so far and its flat index (strictly greater replaces: the first occurrence stays); the lanes of a
// column are merged at the end (largest value, then smallest index).  NaN is rare: if x holds one, each column is
// scanned for its first.  The elements past the last whole step are read one by one.  One thread: 39 / 62 / 73 us
// a call for 1 / 4 / 8 columns of 49,152 (jit dispatch included; XLA 258 / 512 / 825 us; kflat.md; 2026-12-06, commit 54f38b1).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Streams s0 .. s0 + U - 1 of x's first `whole` floats (steps of `step` floats, stream s at offset 8 s of each):
// per lane the largest value and its flat index into b / i [8 (s0 + u) + lane]; any NaN sets *nan.  U independent
// chains in registers (one chain would wait on its compare and blend: ~4 cycles a vector).
template <int U>
void Pass(const float* p, int64_t whole, int64_t step, int64_t s0, float* b, int32_t* i, bool* nan) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 bv[U];
  __m256i iv[U];
  __m256 unordered = _mm256_setzero_ps();
  for (int u = 0; u < U; ++u) {  // the first step's values and indices start each lane
    bv[u] = _mm256_loadu_ps(p + 8 * (s0 + u));
    iv[u] = _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int32_t>(8 * (s0 + u))));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(bv[u], bv[u], _CMP_UNORD_Q));
  }
  for (int64_t f = step; f < whole; f += step) {
    const __m256i base = _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int32_t>(f + 8 * s0)));
    for (int u = 0; u < U; ++u) {
      const __m256 v = _mm256_loadu_ps(p + f + 8 * (s0 + u));
      const __m256 gt = _mm256_cmp_ps(v, bv[u], _CMP_GT_OQ);  // false for NaN either side: the first maximum stays
      const __m256i idx = _mm256_add_epi32(base, _mm256_set1_epi32(8 * u));
      bv[u] = _mm256_blendv_ps(bv[u], v, gt);
      iv[u] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(iv[u]), _mm256_castsi256_ps(idx), gt));
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
  }
  for (int u = 0; u < U; ++u) {
    _mm256_storeu_ps(b + 8 * (s0 + u), bv[u]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(i + 8 * (s0 + u)), iv[u]);
  }
  if (_mm256_movemask_ps(unordered) != 0) *nan = true;
}

using PassFn = void (*)(const float*, int64_t, int64_t, int64_t, float*, int32_t*, bool*);
constexpr PassFn kPasses[8] = {Pass<1>, Pass<2>, Pass<3>, Pass<4>, Pass<5>, Pass<6>, Pass<7>, Pass<8>};

ffi::Error Argmax(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto d = x.dimensions();
  if (d.size() != 2 || out->dimensions().size() != 1 || out->dimensions()[0] != d[1] || d[0] < 1 ||
      d[0] * d[1] > INT32_MAX) {
    return ffi::Error::InvalidArgument("specjax argmax: x [V, M] with V >= 1 and V * M < 2^31, out [M]");
  }
  const int64_t V = d[0], M = d[1], n = V * M;
  const int64_t S = M / std::gcd<int64_t>(8, M);  // vectors a step needs for each lane to keep one column
  const int64_t T = S * std::max<int64_t>(1, 4 / S), step = 8 * T;  // at least 4 chains
  const float* p = x.typed_data();
  int32_t* result = out->typed_data();
  std::vector<float> best(M, -INFINITY);
  std::vector<int64_t> at(M, -1);
  auto merge = [&](int64_t c, float v, int64_t flat) {  // a column's candidates, in any order: the largest, first
    if (!std::isnan(v) && (at[c] < 0 || v > best[c] || (v == best[c] && flat < at[c]))) {
      best[c] = v;
      at[c] = flat;
    }
  };
  const int64_t whole = n / step * step;
  bool nan = false;
  if (whole > 0) {
    std::vector<float> b(8 * T);
    std::vector<int32_t> i(8 * T);
    for (int64_t s0 = 0; s0 < T; s0 += 8)  // 8 streams a pass over x at most (16 registers on AVX2)
      kPasses[std::min<int64_t>(8, T - s0) - 1](p, whole, step, s0, b.data(), i.data(), &nan);
    for (int64_t k = 0; k < 8 * T; ++k) merge(k % M, b[k], i[k]);
  }
  for (int64_t f = whole; f < n; ++f) {
    nan = nan || std::isnan(p[f]);
    merge(f % M, p[f], f);
  }
  for (int64_t c = 0; c < M; ++c) {
    for (int64_t r = 0; nan && r < V; ++r) {  // rare: the first NaN of each column wins
      if (std::isnan(p[r * M + c])) {
        at[c] = r * M + c;
        break;
      }
    }
    result[c] = static_cast<int32_t>(at[c] < 0 ? 0 : at[c] / M);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxArgmax, Argmax,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());
