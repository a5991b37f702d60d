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
// scales d and (Q4_1) mins m as float32 [O, I/32] (none for BF16).  Rows are split over the XLA:CPU intra-op
// thread pool.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_simd;

enum Kind { kQ4_0, kQ4_1, kQ8_0, kBF16 };

struct Weights {
  const uint8_t* codes;
  const float* scales;  // not BF16
  const float* mins;    // Q4_1 only
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
    const Vec d = Set1(w.scales[blk]);
    for (int j = 0; j < kVecs; ++j) out[j] = Mul(ToFloat(I8ToI32(c + j * kLanes)), d);
  } else {  // a Q4 block: low nibbles are weights 0..15, high nibbles 16..31
    const Q4Values values = K == kQ4_0 ? Q4Values::Centered(w.scales[blk])
                                       : Q4Values::Affine(w.scales[blk], w.mins[blk]);
    constexpr int half = kVecs / 2;
    for (int j = 0; j < half; ++j) {
      const IVec v = U8ToI32(c + j * kLanes);
      out[j] = values.Low(v);
      out[j + half] = values.High(v);
    }
  }
}

// One row x TB tokens; xt is token-major [TB, I] (row stride I), y is [O, M] (row stride M).  Each token has one
// accumulator that takes the block's vectors in order: the same sums whatever TB is.  One row at a time: tiles of
// 2-4 rows (x loaded once for them) measured 1.1-2.4x slower on Zen 4 (a Q8_0 or BF16 matrix at M = 1, a 1536-wide
// Q4_1 one), and no faster anywhere (one core, every kind and M = 1, 2, 4).
template <Kind K, int TB>
inline void Tile(const Weights& w, int64_t r, const float* xt, int64_t I, float* y, int64_t M) {
  Vec acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = Zero();
  for (int64_t b = 0; b < w.blocks; ++b) {
    Vec wv[kVecs];
    Dequant<K>(w, r, b, wv);
    for (int j = 0; j < kVecs; ++j)
      for (int t = 0; t < TB; ++t) acc[t] = Fma(wv[j], Load(xt + t * I + b * 32 + j * kLanes), acc[t]);
  }
  for (int t = 0; t < TB; ++t) y[r * M + t] = Sum(acc[t]);
}

template <Kind K, int TB>
void RowsTB(const Weights& w, const float* xt, int64_t I, float* y, int64_t M, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) Tile<K, TB>(w, r, xt, I, y, M);
}

constexpr int64_t kRowBlock = 16;  // rows whose codes one token tile after another reads: a thread's work item

// Rows [r0, r1): blocks of kRowBlock rows outer, token tiles of 4 inner, so a block's codes are read from memory once.
template <Kind K>
void Rows(const Weights& w, const float* xt, int64_t I, float* y, int64_t M, int64_t r0, int64_t r1) {
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

// How one call's rows are shared between the threads: each thread owns a contiguous range of groups of kRowBlock
// rows, (front, back) in one atomic word, and takes its own groups from the front, then what is left of the others'
// ranges from their backs.  So a thread that starts late (a pool worker waking up: ~10 us of a ~70 us product on
// the 2-core VM, which the caller spent spinning when each thread had a fixed half) or runs slow (a stalled vCPU)
// leaves its rows to the others, and each thread still streams contiguous rows.  Held by every thread (shared_ptr):
// a worker that wakes after the call returned finds every group taken and touches nothing else of the call's.
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

template <Kind K>
void Work(Split& s, int64_t k, const Weights& w, const float* xt, int64_t I, float* y, int64_t M, int64_t O) {
  const int64_t n = static_cast<int64_t>(s.ranges.size());
  int64_t done = 0;
  for (int64_t d = 0; d < n; ++d) {
    int64_t g;
    while (s.Take((k + d) % n, d == 0, &g)) {
      Rows<K>(w, xt, I, y, M, g * kRowBlock, (g + 1) * kRowBlock < O ? (g + 1) * kRowBlock : O);
      ++done;
    }
  }
  if (done > 0) s.left.fetch_sub(done, std::memory_order_release);
}

template <Kind K>
ffi::Error Run(ffi::ThreadPool pool, const Weights& w, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t O = y->dimensions()[0], M = y->dimensions()[1], I = w.blocks * 32;
  if (x.dimensions()[0] != I || x.dimensions()[1] != M) {
    return ffi::Error::InvalidArgument("specjax quant matmul: x must be [I, M] with I = 32 * blocks");
  }
  const float* xt = x.typed_data();
  Floats scratch;
  if (M > 1 || reinterpret_cast<uintptr_t>(xt) % 64 != 0) {  // x [I, M] -> token-major [M, I], line-aligned
    scratch.resize(I * M);
    for (int64_t i = 0; i < I; ++i)
      for (int64_t t = 0; t < M; ++t) scratch[t * I + i] = xt[i * M + t];
    xt = scratch.data();
  }
  float* out = y->typed_data();
  int64_t n = pool.num_threads();
  if (n < 1) n = 1;
  if (n > O / 64) n = O / 64 > 0 ? O / 64 : 1;
  auto split = std::make_shared<Split>((O + kRowBlock - 1) / kRowBlock, n);
  for (int64_t k = 1; k < n; ++k) {
    pool.Schedule([split, k, w, xt, I, out, M, O] { Work<K>(*split, k, w, xt, I, out, M, O); });
  }
  Work<K>(*split, 0, w, xt, I, out, M, O);
  while (split->left.load(std::memory_order_acquire) > 0) Pause();
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

ffi::Error BF16(ffi::ThreadPool pool, ffi::Buffer<ffi::U16> codes, ffi::Buffer<ffi::F32> x,
                ffi::ResultBuffer<ffi::F32> y) {
  Weights w{reinterpret_cast<const uint8_t*>(codes.typed_data()), nullptr, nullptr, codes.dimensions()[1]};
  return Run<kBF16>(pool, w, x, y);
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
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxBF16, BF16,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
