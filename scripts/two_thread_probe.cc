// Is a two-thread run on this machine as steady as a one-thread run?  Each thread spins a fixed 256-bit FMA loop
// (~1.3-1.5 ms; AVX2 + FMA, so it builds wherever the kernels do); the run is timed 400 times, thread start and
// join included.  On the 2-vCPU VM of session 40 one thread gives p90 = median and two threads p90 = 1.9x median:
// the two vCPUs intermittently do not run at once, which is where the bimodal step times of every two-core
// measurement come from (docs/results/kflat.md).  Session 49 (Zen 3): one thread median 1.35 ms, two 1.90-2.65.
//   g++ -O2 -march=native -pthread scripts/two_thread_probe.cc -o /tmp/two_thread_probe
//   /tmp/two_thread_probe 1; /tmp/two_thread_probe 2
#include <thread>
#include <chrono>
#include <vector>
#include <algorithm>
#include <cstdio>
#include <atomic>
#include <immintrin.h>
static float work(int n, float x) { __m256 a=_mm256_set1_ps(x), b=_mm256_set1_ps(1.0001f), c[8]; for(int i=0;i<8;i++) c[i]=a;
  for (int i=0;i<n;i++) for(int j=0;j<8;j++) c[j]=_mm256_fmadd_ps(c[j],b,a); __m256 s=c[0]; for(int j=1;j<8;j++) s=_mm256_add_ps(s,c[j]);
  float o[8]; _mm256_storeu_ps(o, s); return o[0] + o[7];}
int main(int argc, char** argv) {
  int threads = atoi(argv[1]); const int N = 300000; std::vector<double> t; volatile float sink=0;
  for (int it=0; it<400; ++it) {
    auto t0=std::chrono::steady_clock::now();
    std::vector<std::thread> th; for(int k=1;k<threads;k++) th.emplace_back([&]{ sink += work(N, 1.0f); });
    sink += work(N, 2.0f); for (auto& x: th) x.join();
    t.push_back(std::chrono::duration<double,std::milli>(std::chrono::steady_clock::now()-t0).count());
  }
  std::sort(t.begin(), t.end()); printf("threads %d min %.2f med %.2f p90 %.2f max %.2f\n", threads, t[0], t[200], t[360], t[399]);
}
