// One thread, no XLA: the block products of kernels/quant_matmul.cc (its source is #included) timed on matrices of
// 30-110 MB (and one that stays in L2), so a change to the inner loop shows without a call's dispatch and thread
// handoff around it.  Built and
// run by scripts/kernel_tile_bench.py; prints one JSON object: per (kind, shape, M) the best of 7 passes in ms and
// ns per kLanes weights.
#include "quant_matmul.cc"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

template <Kind K, bool Int8>
void Case(const char* name, int64_t O, int64_t I, bool first) {
  const int64_t blocks = I / 32;
  std::vector<uint8_t> codes(O * blocks * CodeBytes<K>());
  std::vector<uint16_t> d(O * blocks), m(O * blocks);
  srand(1);
  for (auto& c : codes) c = static_cast<uint8_t>(rand() & (K == kBF16 ? 0x3f : 0xff));  // finite bfloat16s
  for (auto& v : d) v = _cvtss_sh(static_cast<float>(rand() % 1000) * 1e-5f, 0);
  for (auto& v : m) v = _cvtss_sh(-static_cast<float>(rand() % 100) * 1e-3f, 0);
  const Weights w{codes.data(), d.data(), m.data(), blocks};
  for (int64_t M : {1, 2, 4, 8}) {
    // activations on a cache line boundary, as the kernel's own scratch is (any revision's, the same input)
    float* x = static_cast<float*>(std::aligned_alloc(64, (M * I * sizeof(float) + 63) / 64 * 64));
    for (int64_t i = 0; i < M * I; ++i) x[i] = static_cast<float>(rand() % 1000) * 1e-3f - 0.5f;
    std::vector<float> y(O * M);
    Acts a{x, I, nullptr, nullptr, nullptr, nullptr};
    Int8Buffers buf;
    if constexpr (Int8) QuantizeActs<K>(x, I, M, buf, a);
    double best = 1e30;
    const int passes = O * I < (1 << 22) ? 201 : 7;  // a matrix that stays in L2: many passes, all hot
    for (int pass = 0; pass < passes; ++pass) {
      const auto t0 = std::chrono::steady_clock::now();
      Rows<K, Int8>(w, a, y.data(), M, 0, O);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = s < best ? s : best;
    }
    printf("%s{\"kind\": \"%s%s\", \"rows\": %ld, \"cols\": %ld, \"m\": %ld, \"ms\": %.4f, \"ns_per_vector\": %.3f}",
           first && M == 1 ? "" : ",\n ", name, Int8 ? "_I8" : "", static_cast<long>(O), static_cast<long>(I),
           static_cast<long>(M), best * 1e3, best * 1e9 / (static_cast<double>(O) * I / kLanes));
    std::free(x);
  }
}

}  // namespace

int main() {
  printf("{\"lanes\": %d, \"cases\": [", kLanes);
  Case<kQ4_1, true>("Q4_1", 92160, 576, true);   // 30 layers' gate_up rows, int8 activations (the runtime's)
  Case<kQ4_1, true>("Q4_1", 34560, 1536, false);  // 60 down projections' rows
  Case<kQ4_1, true>("Q4_1", 1024, 576, false);    // hot: 369 KB of blocks, in L2 (the arithmetic alone)
  Case<kQ8_0, true>("Q8_0", 49152, 576, false);   // SmolLM2's head
  Case<kQ4_1, false>("Q4_1", 92160, 576, false);  // float32 activations
  Case<kBF16, false>("BF16", 24576, 576, false);  // a bfloat16 drafter's matrices
  printf("]}\n");
  return 0;
}
