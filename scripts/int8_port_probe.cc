// How many of the int8 products' vector operations does one core retire a cycle?  The AVX2 path of
// kernels/quant_matmul.cc (no VNNI) spends, per Q4 block of 32 weights x 8 interleaved rows and per token, 8
// vpmaddubsw, 7 vpaddw, 1 vpmaddwd and 4 float operations, plus 12 operations per block to unpack the codes: at
// M = 4 that is 92 vector operations for 1024 multiply-adds.  This probe times 10 independent chains of each
// operation (throughput) and one dependent chain of vpaddw (1 cycle each: the clock), and prints operations per
// cycle, so the kernel's floor on this core follows: cycles per block >= 36 multiplies / (multiplies a cycle) and
// >= 92 / (mixed operations a cycle).  Session 51 (AMD EPYC Zen 3, AVX2): docs/results/kflat.md.
//   g++ -O2 -march=native scripts/int8_port_probe.cc -o /tmp/int8_port_probe && taskset -c 0 /tmp/int8_port_probe
#include <immintrin.h>

#include <chrono>
#include <cstdio>

#define TEN(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9)
#define KEEP asm volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), \
                          "+x"(a8), "+x"(a9))

constexpr long kIters = 50000000;

template <class F>
double NsPerIter(F f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / kIters;
}

int main() {
#define DECL(i) __m256i a##i = _mm256_set1_epi8(i + 1);
  TEN(DECL)
  __m256i b = _mm256_set1_epi8(3);
  asm volatile("" : "+x"(b));  // not a constant the compiler could fold chains of adds into
  // The clock: a chain of dependent vpaddw, 10 an iteration, one cycle each.
  const double cycle = NsPerIter([&] {
    for (long n = 0; n < kIters; ++n) {
      for (int i = 0; i < 10; ++i) {
        a0 = _mm256_add_epi16(a0, b);
        asm volatile("" : "+x"(a0));
      }
    }
  }) / 10;
  auto ops_per_cycle = [&](double ns_per_iter) { return 10 * cycle / ns_per_iter; };
  const double maddubs = NsPerIter([&] {
    for (long n = 0; n < kIters; ++n) {
#define MU(i) a##i = _mm256_maddubs_epi16(a##i, b);
      TEN(MU)
      KEEP;
    }
  });
  const double paddw = NsPerIter([&] {
    for (long n = 0; n < kIters; ++n) {
#define AD(i) a##i = _mm256_add_epi16(a##i, b);
      TEN(AD)
      KEEP;
    }
  });
  const double mix = NsPerIter([&] {
    for (long n = 0; n < kIters; ++n) {
#define MX(i) a##i = (i % 2) ? _mm256_maddubs_epi16(a##i, b) : _mm256_add_epi16(a##i, b);
      TEN(MX)
      KEEP;
    }
  });
  const double widen = NsPerIter([&] {
    for (long n = 0; n < kIters; ++n) {
#define MD(i) a##i = (i % 2) ? _mm256_maddubs_epi16(a##i, b) : _mm256_madd_epi16(a##i, b);
      TEN(MD)
      KEEP;
    }
  });
  std::printf("clock %.2f GHz (dependent vpaddw)\n", 1.0 / cycle);
  std::printf("vpmaddubsw           %.2f a cycle\n", ops_per_cycle(maddubs));
  std::printf("vpaddw               %.2f a cycle\n", ops_per_cycle(paddw));
  std::printf("vpmaddubsw + vpaddw  %.2f a cycle (1:1)\n", ops_per_cycle(mix));
  std::printf("vpmaddubsw + vpmaddwd %.2f a cycle (1:1)\n", ops_per_cycle(widen));
  const double floor_cycles = 36 / ops_per_cycle(widen) > 92 / ops_per_cycle(mix) ? 36 / ops_per_cycle(widen)
                                                                                  : 92 / ops_per_cycle(mix);
  std::printf("Q4 block x 8 rows x 4 tokens (1024 multiply-adds): >= %.1f cycles = %.2f ns / 8 weights at M = 4\n",
              floor_cycles, floor_cycles * cycle / 32);
  int sink = 0;
#define SUM(i) sink += _mm256_extract_epi16(a##i, 0);
  TEN(SUM)
  return sink == 123456789;
}
