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
// The GGUF kinds also have integer-activation variants: int16 (handlers *I16, the default) and int8 (*I8, llama.cpp's
// scheme).  Each token's activations are quantized per block of 32 (scale amax / 32512 or amax / 127, round to
// nearest even; int16 values split into two signed bytes, QuantizeBlock16), a block's codes multiply them as bytes
// into int32 (AVX-512 VNNI vpdpbusd, else vpmaddubsw + vpmaddwd; exact, the codes' offsets included), and each
// block's sum is scaled by d * dx in float32; Q4_1's min term uses the exact float sums of x's blocks.  int8: ~1e-3
// of sum |w x| from the float32 product (enough to flip a small model's near-ties), int16: ~5e-5 at most, 256 times
// finer; both faster than float32 activations: 32 byte products per 256-bit instruction instead of 8 FMAs.  Their matrices are
// laid out with the rows interleaved 8 at a time (llama.cpp's repacked layout, made at load time by
// specjax.model.quant.interleave): for row group g and block b, vector j's 32-bit lane r holds row 8g + r's codes
// 4j .. 4j + 3 (Q4: low nibbles weights 4j.., high nibbles 16 + 4j..; Q8_0: 8 vectors of bytes), so vpdpbusd of a
// vector against a token's 4 activation bytes broadcast gives 8 rows' partial sums, and one convert / scale / FMA
// per block serves 8 rows: 1.2-1.6x the one-row-at-a-time tile on one core at M = 1-8 (docs/results/kflat.md).
// 256 bits wide on both builds, and two groups (16 rows) per 512-bit vector on AVX-512BW for tiles of 4 tokens or
// more (Rows16).  A token's result still depends on nothing but its own activations.
//
// Here: the float32 tile, how a call's rows and tokens are tiled and shared between threads, and the FFI handlers;
// quant_blocks.h: the blocks' and activations' views and the activations' quantization; quant_rows.h: the integer
// row tiles.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "quant_blocks.h"
#include "quant_rows.h"
#include "simd.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_simd;

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
// more tokens a step for the same unpacking (with tiles of 4, the 5th token of a verification cost ~2.5x the 2nd-4th:
// a second tile of one; SmolLM2's product chain at 16 tokens: 12.7 -> 7.9 ms int8, 14.7 -> 11.5 int16 with tiles of
// 16, Zen 5).  16 accumulators and 8 vectors of codes fit AVX-512's 32 registers, 8 and 8 AVX2's 16.  A float32
// tile keeps 4.
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
