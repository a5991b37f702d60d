// How much lower-precision activations could take off a Q4_1 product on this CPU (issue #15): one thread, a
// 576-wide Q4_1 matrix of ~47 MB (streamed from memory, as a decoding step streams SmolLM2's layers), M = 1..4
// tokens, three inner loops over the same blocks:
//   f32   specjax's kernel today (kernels/quant_matmul.cc Tile<kQ4_1>): the block's weights rebuilt as float32
//         (Q4Values lookup), one FMA per 16 weights per token;
//   bf16  the rebuilt weights rounded to bfloat16 once per block, activations bfloat16, vdpbf16ps: 32 products
//         per instruction, float32 sums;
//   int8  llama.cpp's scheme: activations quantized per block of 32 to int8 (scale per block), the 4-bit codes
//         multiplied as bytes by vpdpbusd (64 products per instruction into int32), one float scale per block
//         pair and token; Q4_1's min term from the activations' exact block sums.
// Prints ns per row for each (loop, M), and each loop's largest relative error against a double dot product.
// With `bf16 [drafter]`: the DFlash drafter's bfloat16 matrices instead, today's loop (each weight widened to
// float32, FMA) against vdpbf16ps on bfloat16-rounded activations, over 70 MB streamed from memory or (`drafter`)
// the drafter's own 17.5 MB, which can stay in the last-level cache.
//
//   g++ -O3 -march=native -std=c++17 -Isrc/specjax/kernels scripts/q4_dot_proto.cc -o /tmp/q4_dot_proto
//   taskset -c 0 /tmp/q4_dot_proto [bf16 [drafter]]
// Needs AVX-512 with BF16 and VNNI (Zen 4, Sapphire Rapids); not built by specjax.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <random>
#include <vector>

#include "simd.h"

using namespace specjax_simd;

constexpr int64_t I = 576, B = I / 32, O = 163840;

struct Q4_1 {
  std::vector<uint8_t> codes;  // [O, B, 16]
  std::vector<float> d, m;     // [O, B]
};

template <int M>
void F32(const Q4_1& w, const float* x, float* y) {  // x [M, I]
  for (int64_t r = 0; r < O; ++r) {
    Vec acc[M];
    for (int t = 0; t < M; ++t) acc[t] = Zero();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t blk = r * B + b;
      const Q4Values v = Q4Values::Affine(w.d[blk], w.m[blk]);
      const IVec c = U8ToI32(w.codes.data() + blk * 16);
      const Vec lo = v.Low(c), hi = v.High(c);
      for (int t = 0; t < M; ++t) {
        acc[t] = Fma(lo, Load(x + t * I + b * 32), acc[t]);
        acc[t] = Fma(hi, Load(x + t * I + b * 32 + 16), acc[t]);
      }
    }
    for (int t = 0; t < M; ++t) y[r * M + t] = Sum(acc[t]);
  }
}

template <int M>
void BF16(const Q4_1& w, const __m512bh* xb, float* y) {  // xb [M, B]: a block's 32 activations as bfloat16
  for (int64_t r = 0; r < O; ++r) {
    __m512 acc[M];
    for (int t = 0; t < M; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t blk = r * B + b;
      const Q4Values v = Q4Values::Affine(w.d[blk], w.m[blk]);
      const IVec c = U8ToI32(w.codes.data() + blk * 16);
      const __m512bh wb = _mm512_cvtne2ps_pbh(v.High(c), v.Low(c));
      for (int t = 0; t < M; ++t) acc[t] = _mm512_dpbf16_ps(acc[t], wb, xb[t * B + b]);
    }
    for (int t = 0; t < M; ++t) y[r * M + t] = _mm512_reduce_add_ps(acc[t]);
  }
}

// int8 activations of one token, in the byte order of a block pair's unpacked codes: [x_b[0..15], x_b+1[0..15],
// x_b[16..31], x_b+1[16..31]]; scales per int32 lane of vpdpbusd's result (lanes 0-3 and 8-11 block b, the rest
// b + 1); exact float sums of each block's activations for the min term.
struct Int8Acts {
  std::vector<__m512i> q;    // [M, B / 2]
  std::vector<__m512> s;     // [M, B / 2]
  std::vector<float> sums;   // [M, B]
};

Int8Acts Quantize(const float* x, int M) {
  Int8Acts a;
  a.q.resize(M * B / 2);
  a.s.resize(M * B / 2);
  a.sums.resize(M * B);
  for (int t = 0; t < M; ++t) {
    float dx[B];
    int8_t xq[B][32];
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + t * I + b * 32;
      float amax = 0.0f, sum = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i])), sum += xb[i];
      dx[b] = amax / 127.0f;
      const float inv = dx[b] > 0 ? 1.0f / dx[b] : 0.0f;
      for (int i = 0; i < 32; ++i) xq[b][i] = static_cast<int8_t>(std::lrintf(xb[i] * inv));
      a.sums[t * B + b] = sum;
    }
    for (int64_t p = 0; p < B / 2; ++p) {
      alignas(64) int8_t bytes[64];
      for (int i = 0; i < 16; ++i) {
        bytes[i] = xq[2 * p][i];
        bytes[16 + i] = xq[2 * p + 1][i];
        bytes[32 + i] = xq[2 * p][16 + i];
        bytes[48 + i] = xq[2 * p + 1][16 + i];
      }
      a.q[t * B / 2 + p] = _mm512_load_si512(bytes);
      alignas(64) float sc[16];
      for (int l = 0; l < 16; ++l) sc[l] = dx[2 * p + ((l / 4) % 2)];
      a.s[t * B / 2 + p] = _mm512_load_ps(sc);
    }
  }
  return a;
}

template <int M>
void Int8(const Q4_1& w, const Int8Acts& a, float* y) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  for (int64_t r = 0; r < O; ++r) {
    __m512 acc[M];
    for (int t = 0; t < M; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < B / 2; ++p) {
      const int64_t blk = r * B + 2 * p;
      const __m256i c = _mm256_loadu_si256((const __m256i*)(w.codes.data() + blk * 16));
      const __m256i lo = _mm256_and_si256(c, low4), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
      const __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      const __m512 ws = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(
                                                        _mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)&w.d[blk]))));
      for (int t = 0; t < M; ++t) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, a.q[t * B / 2 + p]);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, a.s[t * B / 2 + p]), acc[t]);
      }
    }
    const float* mr = w.m.data() + r * B;
    for (int t = 0; t < M; ++t) {  // + sum_b m_b * sum(x_b), 16 blocks then the rest
      const float* sr = a.sums.data() + t * B;
      __m512 mins = _mm512_mul_ps(_mm512_loadu_ps(mr), _mm512_loadu_ps(sr));
      const __mmask16 rest = static_cast<__mmask16>((1u << (B - 16)) - 1);
      mins = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(rest, mr + 16), _mm512_maskz_loadu_ps(rest, sr + 16), mins);
      y[r * M + t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], mins));
    }
  }
}


// The drafter's bfloat16 matrices: [rows, B, 32] bfloat16 bits.
template <int M>
void Bf16Widen(const uint16_t* w, int64_t rows, const float* x, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    Vec acc[M];
    for (int t = 0; t < M; ++t) acc[t] = Zero();
    for (int64_t b = 0; b < B; ++b) {
      const uint16_t* c = w + (r * B + b) * 32;
      const Vec w0 = BF16ToFloat(c), w1 = BF16ToFloat(c + 16);
      for (int t = 0; t < M; ++t) {
        acc[t] = Fma(w0, Load(x + t * I + b * 32), acc[t]);
        acc[t] = Fma(w1, Load(x + t * I + b * 32 + 16), acc[t]);
      }
    }
    for (int t = 0; t < M; ++t) y[r * M + t] = Sum(acc[t]);
  }
}

template <int M>
void Bf16Dot(const uint16_t* w, int64_t rows, const __m512bh* xb, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    __m512 acc[M];
    for (int t = 0; t < M; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      const __m512bh wb = (__m512bh)_mm512_loadu_si512(w + (r * B + b) * 32);
      for (int t = 0; t < M; ++t) acc[t] = _mm512_dpbf16_ps(acc[t], wb, xb[t * B + b]);
    }
    for (int t = 0; t < M; ++t) y[r * M + t] = _mm512_reduce_add_ps(acc[t]);
  }
}

template <typename F>
double Best(F&& f, int reps) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

template <int M>
void Run(const Q4_1& w, const std::vector<float>& x) {
  std::vector<float> y32(O * M), yb(O * M), yi(O * M);
  std::vector<__m512bh> xb(M * B);
  for (int t = 0; t < M; ++t)
    for (int64_t b = 0; b < B; ++b)
      xb[t * B + b] = _mm512_cvtne2ps_pbh(Load(x.data() + t * I + b * 32 + 16), Load(x.data() + t * I + b * 32));
  const double tf = Best([&] { F32<M>(w, x.data(), y32.data()); }, 7);
  const double tb = Best([&] { BF16<M>(w, xb.data(), yb.data()); }, 7);
  const double qa = Best([&] { Quantize(x.data(), M); }, 7);
  const Int8Acts a = Quantize(x.data(), M);
  const double ti = Best([&] { Int8<M>(w, a, yi.data()); }, 7);
  double ef = 0, eb = 0, ei = 0;
  for (int64_t r = 0; r < O; r += 97) {
    for (int t = 0; t < M; ++t) {
      double exact = 0, mag = 0;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t blk = r * B + b;
        for (int i = 0; i < 32; ++i) {
          const uint8_t c = w.codes[blk * 16 + i % 16];
          const int q = i < 16 ? (c & 15) : (c >> 4);
          const double wv = static_cast<double>(q) * w.d[blk] + w.m[blk], xv = x[t * I + b * 32 + i];
          exact += wv * xv;
          mag += std::fabs(wv * xv);
        }
      }
      ef = std::max(ef, std::fabs(y32[r * M + t] - exact) / mag);
      eb = std::max(eb, std::fabs(yb[r * M + t] - exact) / mag);
      ei = std::max(ei, std::fabs(yi[r * M + t] - exact) / mag);
    }
  }
  std::printf("M=%d  ns/row: f32 %.2f  bf16 %.2f  int8 %.2f (+ quantizing x %.3f us)  | max |err| / sum|w x|: "
              "f32 %.1e  bf16 %.1e  int8 %.1e\n", M, tf / O * 1e9, tb / O * 1e9, ti / O * 1e9, qa * 1e6, ef, eb, ei);
}


template <int M>
void RunBf16(const std::vector<uint16_t>& w, int64_t rows, const std::vector<float>& x) {
  std::vector<float> y(rows * M);
  std::vector<__m512bh> xb(M * B);
  for (int t = 0; t < M; ++t)
    for (int64_t b = 0; b < B; ++b)
      xb[t * B + b] = _mm512_cvtne2ps_pbh(Load(x.data() + t * I + b * 32 + 16), Load(x.data() + t * I + b * 32));
  const double tw = Best([&] { Bf16Widen<M>(w.data(), rows, x.data(), y.data()); }, 9);
  const double td = Best([&] { Bf16Dot<M>(w.data(), rows, xb.data(), y.data()); }, 9);
  std::printf("M=%d  ns/row: widen + FMA %.2f  vdpbf16ps %.2f\n", M, tw / rows * 1e9, td / rows * 1e9);
}

int main(int argc, char** argv) {
  std::mt19937 rng(0);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(4 * I);
  for (auto& v : x) v = normal(rng);
  if (argc > 1 && std::string(argv[1]) == "bf16") {
    const int64_t rows = argc > 2 ? 15168 : 4 * 15168;  // the drafter's 8.74M weights, or 4x that
    std::vector<uint16_t> w(rows * I);
    for (auto& v : w) {
      const float f = normal(rng);
      uint32_t u;
      std::memcpy(&u, &f, 4);
      v = static_cast<uint16_t>(u >> 16);
    }
    std::printf("bfloat16 [%lld, %lld]: %.1f MB\n", (long long)rows, (long long)I, rows * I * 2 / 1e6);
    RunBf16<1>(w, rows, x);
    RunBf16<2>(w, rows, x);
    RunBf16<3>(w, rows, x);
    RunBf16<4>(w, rows, x);
    return 0;
  }
  Q4_1 w;
  w.codes.resize(O * B * 16);
  w.d.resize(O * B + 16);  // + 16: the int8 loop's masked loads stay inside
  w.m.resize(O * B + 16);
  for (auto& c : w.codes) c = static_cast<uint8_t>(byte(rng));
  for (int64_t i = 0; i < O * B; ++i) w.d[i] = 0.01f * (1.0f + 0.1f * normal(rng)), w.m[i] = -0.08f + 0.01f * normal(rng);
  std::printf("Q4_1 [%lld, %lld]: %.1f MB of codes and scales\n", (long long)O, (long long)I,
              (O * B * (16 + 8)) / 1e6);
  Run<1>(w, x);
  Run<2>(w, x);
  Run<3>(w, x);
  Run<4>(w, x);
}
