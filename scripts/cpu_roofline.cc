// The CPU's ceilings for a decode / verify step (scripts/cpu_roofline.py builds and runs this):
//   fma    float32 multiply-adds per second (12 independent accumulator chains of vector FMAs per thread)
//   dot    byte multiply-adds per second of the integer kernels' instruction (vpdpbusd on the widest vectors the
//          build has, else vpmaddubsw + vpmaddwd; 12 chains)
//   read   bytes per second streamed from memory (a buffer far larger than the caches, summed with vector loads)
// each with 1 thread and with every thread the machine has.  Prints one JSON object.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "simd.h"  // the kernels' vector operations (src/specjax/kernels): AVX-512F or AVX2 + FMA

using namespace specjax_simd;

static double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// 12 chains x iters FMAs of kLanes lanes; returns a value so the work is not optimized away
static float FmaLoop(int64_t iters) {
  Vec a[12];
  for (int i = 0; i < 12; ++i) a[i] = Set1(1.0f + i * 1e-3f);
  const Vec m = Set1(0.9999999f), c = Set1(1e-7f);
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < 12; ++i) a[i] = Fma(a[i], m, c);
  Vec s = a[0];
  for (int i = 1; i < 12; ++i) s = Add(s, a[i]);
  return Sum(s);
}

// 12 chains x iters byte dot products of kDotBytes bytes; returns a value so the work is not optimized away
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kDotBytes = 64;
static int32_t DotLoop(int64_t iters) {
  __m512i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  const __m512i u = _mm512_set1_epi8(3), x = _mm512_set1_epi8(-2);
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], u, x);
  for (int i = 1; i < 12; ++i) a[0] = _mm512_add_epi32(a[0], a[i]);
  return _mm512_reduce_add_epi32(a[0]);
}
#else
constexpr int kDotBytes = 32;
static int32_t DotLoop(int64_t iters) {
  __m256i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_epi32(i);
  const __m256i u = _mm256_set1_epi8(3), x = _mm256_set1_epi8(-2);
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < 12; ++i) a[i] = DotBytes(a[i], u, x);
  for (int i = 1; i < 12; ++i) a[0] = _mm256_add_epi32(a[0], a[i]);
  return SumInt8(a[0]);
}
#endif

static float ReadLoop(const float* p, int64_t n, int reps) {
  Vec s0 = Set1(0), s1 = Set1(0), s2 = Set1(0), s3 = Set1(0);
  for (int r = 0; r < reps; ++r)
    for (int64_t i = 0; i < n; i += 4 * kLanes) {
      s0 = Add(s0, Load(p + i));
      s1 = Add(s1, Load(p + i + kLanes));
      s2 = Add(s2, Load(p + i + 2 * kLanes));
      s3 = Add(s3, Load(p + i + 3 * kLanes));
    }
  return Sum(Add(Add(s0, s1), Add(s2, s3)));
}

// median over `trials` of the rate (units per second) of fn run on `threads` threads at once
template <class F>
static double Rate(int threads, int trials, double units_per_thread, F fn) {
  std::vector<double> rates;
  for (int t = 0; t < trials; ++t) {
    std::vector<std::thread> pool;
    const double t0 = Now();
    for (int k = 0; k < threads; ++k) pool.emplace_back([&, k] { fn(k); });
    for (auto& th : pool) th.join();
    rates.push_back(threads * units_per_thread / (Now() - t0));
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

int main() {
  const int all = std::max(1u, std::thread::hardware_concurrency());
  const int64_t iters = 200000000 / kLanes;
  volatile float sink = 0;
  const double flop = 2.0 * 12 * kLanes * iters;  // one FMA = 2 flops per lane
  const double fma1 = Rate(1, 5, flop, [&](int) { sink = sink + FmaLoop(iters); });
  const double fmaN = Rate(all, 5, flop, [&](int) { sink = sink + FmaLoop(iters); });
  const int64_t dot_iters = 200000000 / kDotBytes;
  const double dot_macs = 12.0 * kDotBytes * dot_iters;
  const double dot1 = Rate(1, 5, dot_macs, [&](int) { sink = sink + DotLoop(dot_iters); });
  const double dotN = Rate(all, 5, dot_macs, [&](int) { sink = sink + DotLoop(dot_iters); });
  const int64_t n = (int64_t)1 << 26;  // 256 MiB of float32 per thread
  std::vector<float*> bufs(all);
  for (int k = 0; k < all; ++k) {
    bufs[k] = static_cast<float*>(std::aligned_alloc(64, n * sizeof(float)));
    for (int64_t i = 0; i < n; ++i) bufs[k][i] = 1.0f;
  }
  const double bytes = 4.0 * n * 2;
  const double read1 = Rate(1, 5, bytes, [&](int k) { sink = sink + ReadLoop(bufs[k], n, 2); });
  const double readN = Rate(all, 5, bytes, [&](int k) { sink = sink + ReadLoop(bufs[k], n, 2); });
  std::printf("{\"lanes\": %d, \"threads\": %d, \"fma_gflops_1\": %.1f, \"fma_gflops_all\": %.1f, "
              "\"dot_bytes\": %d, \"dot_gmacs_1\": %.1f, \"dot_gmacs_all\": %.1f, "
              "\"read_gbs_1\": %.2f, \"read_gbs_all\": %.2f}\n",
              kLanes, all, fma1 / 1e9, fmaN / 1e9, kDotBytes, dot1 / 1e9, dotN / 1e9, read1 / 1e9, readN / 1e9);
  for (auto* b : bufs) std::free(b);
  return 0;
}
