// How fast can the block kernels' arithmetic go at many tokens?  y[r, t] = sum_i W[r, i] x[t, i] on float32 weights
// already rebuilt (no dequantization), in the kernels' dot form: each (row, token) accumulated in vector lanes along
// the row, in order, summed across lanes at the end (the order that makes a token's result independent of how many
// tokens share a call).  A: RB x TB tiles over the whole row (the rows-panel variant, docs/results/kernels/
// panel-kernel.diff); B: the same tiles over chunks of KC weights with the accumulators carried in memory between
// chunks (same order, operands L1-resident).  SmolLM2's gate_up shape, 3072 x 576; one thread.  Compare with XLA's
// float32 dot of the same shape (the Python snippet at the end of docs/results/kernels/dot-gemm-probe.txt).
//   g++ -O3 -march=native -std=c++17 -ffp-contract=off -Isrc/specjax/kernels scripts/dot_gemm_probe.cc -o /tmp/p
//   taskset -c 0 /tmp/p 64
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include "simd.h"
using namespace specjax_simd;

// A: stream full I per tile (RB x TB), like the panel path
template <int RB, int TB>
void tileA(const float* w, const float* x, int64_t I, float* y, int64_t M) {
  Vec acc[RB][TB];
  for (int r = 0; r < RB; ++r) for (int t = 0; t < TB; ++t) acc[r][t] = Zero();
  for (int64_t v = 0; v < I; v += kLanes) {
    Vec wv[RB];
    for (int r = 0; r < RB; ++r) wv[r] = Load(w + r * I + v);
    for (int t = 0; t < TB; ++t) { Vec xv = Load(x + t * I + v); for (int r = 0; r < RB; ++r) acc[r][t] = Fma(wv[r], xv, acc[r][t]); }
  }
  for (int r = 0; r < RB; ++r) for (int t = 0; t < TB; ++t) y[r * M + t] = Sum(acc[r][t]);
}
template <int RB, int TB>
void gemmA(const float* W, const float* X, int64_t R, int64_t I, int64_t M, float* Y) {
  const int64_t TBLK = std::max<int64_t>(4, (192 * 1024) / (I * 4) / 4 * 4);
  for (int64_t t0 = 0; t0 < M; t0 += TBLK) {
    int64_t t1 = std::min(M, t0 + TBLK);
    for (int64_t r = 0; r + RB <= R; r += RB)
      for (int64_t t = t0; t + TB <= t1; t += TB) tileA<RB, TB>(W + r * I, X + t * I, I, Y + r * M + t, M);
  }
}
// B: k-blocked, accumulators carried in memory across chunks (same order per (r, t))
template <int RB, int TB>
inline void tileB(const float* w, const float* x, int64_t I, int64_t k0, int64_t k1, Vec* accmem) {
  Vec acc[RB][TB];
  for (int r = 0; r < RB; ++r) for (int t = 0; t < TB; ++t) acc[r][t] = accmem[r * TB + t];
  for (int64_t v = k0; v < k1; v += kLanes) {
    Vec wv[RB];
    for (int r = 0; r < RB; ++r) wv[r] = Load(w + r * I + v);
    for (int t = 0; t < TB; ++t) { Vec xv = Load(x + t * I + v); for (int r = 0; r < RB; ++r) acc[r][t] = Fma(wv[r], xv, acc[r][t]); }
  }
  for (int r = 0; r < RB; ++r) for (int t = 0; t < TB; ++t) accmem[r * TB + t] = acc[r][t];
}
template <int RB, int TB>
void gemmB(const float* W, const float* X, int64_t R, int64_t I, int64_t M, float* Y, int64_t KC, int64_t RBLK, int64_t TBLK) {
  std::vector<Vec> accs((RBLK / RB) * (TBLK / TB) * RB * TB);
  for (int64_t r0 = 0; r0 < R; r0 += RBLK) {
    int64_t r1 = std::min(R, r0 + RBLK);
    for (int64_t t0 = 0; t0 < M; t0 += TBLK) {
      int64_t t1 = std::min(M, t0 + TBLK);
      for (auto& a : accs) a = Zero();
      for (int64_t k0 = 0; k0 < I; k0 += KC) {
        int64_t k1 = std::min(I, k0 + KC);
        Vec* am = accs.data();
        for (int64_t r = r0; r + RB <= r1; r += RB)
          for (int64_t t = t0; t + TB <= t1; t += TB, am += RB * TB) tileB<RB, TB>(W + r * I, X + t * I, I, k0, k1, am);
      }
      Vec* am = accs.data();
      for (int64_t r = r0; r + RB <= r1; r += RB)
        for (int64_t t = t0; t + TB <= t1; t += TB, am += RB * TB)
          for (int rr = 0; rr < RB; ++rr) for (int tt = 0; tt < TB; ++tt) Y[(r + rr) * M + t + tt] = Sum(am[rr * TB + tt]);
    }
  }
}
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  int64_t R = 3072, I = 576, M = atoi(argv[1]);
  std::vector<float> W(R * I), X(M * I), Y(R * M), Y2(R * M);
  for (auto& v : W) v = (rand() % 1000) / 1000.0f - 0.5f;
  for (auto& v : X) v = (rand() % 1000) / 1000.0f - 0.5f;
  double flop = 2.0 * R * I * M;
  auto run = [&](const char* name, auto f) {
    f(); double best = 1e9;
    for (int i = 0; i < 7; ++i) { double t = now(); f(); best = std::min(best, now() - t); }
    printf("M=%ld %-28s %7.2f ms %6.1f GFLOP/s\n", M, name, best * 1e3, flop / best / 1e9);
  };
  run("A rows 3 x tokens 4", [&] { gemmA<3, 4>(W.data(), X.data(), R, I, M, Y.data()); });
  run("A rows 4 x tokens 4", [&] { gemmA<4, 4>(W.data(), X.data(), R, I, M, Y2.data()); });
  run("A rows 6 x tokens 4", [&] { gemmA<6, 4>(W.data(), X.data(), R, I, M, Y2.data()); });
  run("A rows 2 x tokens 8", [&] { gemmA<2, 8>(W.data(), X.data(), R, I, M, Y2.data()); });
  run("A rows 8 x tokens 2", [&] { gemmA<8, 2>(W.data(), X.data(), R, I, M, Y2.data()); });
  for (int64_t kc : {128, 256}) for (int64_t rb : {24, 48}) for (int64_t tb : {16, 64}) {
    char name[64]; snprintf(name, 64, "B 3x4 kc%ld rows%ld tokens%ld", kc, rb, tb);
    run(name, [&] { gemmB<3, 4>(W.data(), X.data(), R, I, M, Y2.data(), kc, rb, tb); });
  }
  int64_t diff = 0; for (int64_t r = 0; r < R - R % 3; ++r) for (int64_t t = 0; t < M; ++t) diff += Y[r * M + t] != Y2[r * M + t];
  printf("results of the last B differing from A 3x4's (rows 0..%ld): %ld\n", R - R % 3 - 1, diff);
}
