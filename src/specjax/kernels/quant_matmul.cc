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
// The GGUF kinds also have an int8-activation variant (handlers *I8, llama.cpp's scheme): each token's activations
// are quantized per block of 32 (scale amax / 127, round to nearest even), a block's codes multiply them as bytes
// into int32 (AVX-512 VNNI vpdpbusd, else AVX2 vpmaddubsw + vpmaddwd; exact, Q4_0's offset of 8 included), and each
// block's sum is scaled by d * dx in float32; Q4_1's min term uses the exact float sums of x's blocks.  ~1e-3 of
// sum |w x| from the float32 product, and faster: 32 products per instruction instead of 8-16.  Their matrices are
// laid out with the rows interleaved 8 at a time (llama.cpp's repacked layout, made at load time by
// specjax.model.quant.interleave): for row group g and block b, vector j's 32-bit lane r holds row 8g + r's codes
// 4j .. 4j + 3 (Q4: low nibbles weights 4j.., high nibbles 16 + 4j..; Q8_0: 8 vectors of bytes), so vpdpbusd of a
// vector against a token's 4 activation bytes broadcast gives 8 rows' partial sums, and one convert / scale / FMA
// per block serves 8 rows: 1.2-1.6x the one-row-at-a-time tile on one core at M = 1-8 (docs/results/kflat.md).
// 256 bits wide on both builds.  A token's result still depends on nothing but its own activations.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "simd.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_simd;

enum Kind { kQ4_0, kQ4_1, kQ8_0, kBF16 };

struct Weights {
  const uint8_t* codes;
  const uint16_t* scales;  // float16 bits; not BF16
  const uint16_t* mins;    // Q4_1 only

  float Scale(int64_t blk) const { return _cvtsh_ss(scales[blk]); }
  float Min(int64_t blk) const { return _cvtsh_ss(mins[blk]); }
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

// A call's activations as the row tiles read them: float32, token-major [M, I] (row stride I); or (int8 variants)
// quantized per block: q [M, I] bytes in order, scale [M, B] (dx), Q4_1's sums [M, B] (the float sum of each block
// of x, for the min term) and Q4_0's bias [M, B] (-8 * the sum of the block's q: the codes' offset of 8, exact in the
// integer sum).
struct Acts {
  const float* xt;
  int64_t I;
  const int8_t* q;
  const float* scale;
  const float* sums;
  const int32_t* bias;
};

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

inline __m256i Load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

constexpr int64_t kAhead = 8;  // blocks of codes prefetched ahead of the one being multiplied

template <Kind K>
constexpr int64_t GroupBytes() { return K == kQ8_0 ? 256 : 128; }  // 8 interleaved rows' codes of one block

// Rows 8g .. 8g + 7 (interleaved) x TB tokens of an int8 product; rows past O (padding) are not written.  Per block,
// the codes as unsigned bytes u[j] (Q8_0: |w|, its sign moved onto x: |w| <= 128 keeps vpmaddubsw's pair sums
// unsaturated) are unpacked once for the TB tokens; each token's 4-byte groups of x are broadcast against them.
template <Kind K, int TB>
inline void Group8(const Weights& w, int64_t g, const Acts& a, int64_t t0, float* y, int64_t M, int64_t O) {
  static_assert(K != kBF16, "bfloat16 weights take float32 activations");
  constexpr int kJ = K == kQ8_0 ? 8 : 4;  // vectors of codes per block
  const int64_t B = w.blocks;
  __m256 acc[TB];
  for (int t = 0; t < TB; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t gb = g * B + b;
    const uint8_t* c = w.codes + gb * GroupBytes<K>();
    // The stream kAhead blocks on (contiguous across groups), asked for now: the hardware prefetchers alone left a
    // cold 3072-row Q4_1 product on one core at ~60% of the read bandwidth (65 -> 46 us at M = 1, 85 -> 78 at M = 4).
    for (int64_t o = 0; o < GroupBytes<K>(); o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(c) + kAhead * GroupBytes<K>() + o, _MM_HINT_T0);
    if (b % 4 == 0) {  // 4 blocks' 8 scales (and mins) per line
      _mm_prefetch(reinterpret_cast<const char*>(w.scales + (gb + kAhead) * 8), _MM_HINT_T0);
      if constexpr (K == kQ4_1) _mm_prefetch(reinterpret_cast<const char*>(w.mins + (gb + kAhead) * 8), _MM_HINT_T0);
    }
    __m256i u[8], sg[8];
    for (int j = 0; j < kJ; ++j) {
      const __m256i v = Load256(c + 32 * j);
      if constexpr (K == kQ8_0) {
        sg[j] = v;
        u[j] = _mm256_abs_epi8(v);
      } else {
        u[j] = _mm256_and_si256(v, low4);                          // weights 4j .. 4j + 3 of each row
        u[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);  // 16 + 4j .. 16 + 4j + 3
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales + gb * 8)));
    __m256 m = _mm256_setzero_ps();
    if constexpr (K == kQ4_1) m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mins + gb * 8)));
    for (int t = 0; t < TB; ++t) {
      const int64_t tb = (t0 + t) * B + b;
      const int8_t* x = a.q + tb * 32;  // the block's 32 bytes in order
      __m256i s = K == kQ4_0 ? _mm256_set1_epi32(a.bias[tb]) : _mm256_setzero_si256();
      auto xs = [x](int j) {  // x's bytes 4j .. 4j + 3 in every 32-bit lane
        int32_t four;
        std::memcpy(&four, x + 4 * j, 4);
        return _mm256_set1_epi32(four);
      };
      if constexpr (K != kQ8_0 && !kVnni) {
        // Without VNNI, Q4's codes (at most 15) let the 8 vpmaddubsw pair sums (|.| <= 2 * 15 * 127 each) add in
        // int16 lanes exactly (|.| <= 30480) before one vpmaddwd widens them: 17 multiplies and adds a block and
        // token instead of DotBytes' 24 (the 8 broadcasts of x either way), the same integer sums.
        __m256i s16 = _mm256_maddubs_epi16(u[0], xs(0));
        for (int j = 1; j < 8; ++j) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(u[j], xs(j)));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
      } else {
        for (int j = 0; j < 8; ++j) {
          __m256i xv = xs(j);
          if constexpr (K == kQ8_0) xv = _mm256_sign_epi8(xv, sg[j]);
          s = DotBytes(s, u[j], xv);
        }
      }
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(a.scale[tb])), acc[t]);
      if constexpr (K == kQ4_1) acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.sums[tb]), acc[t]);
    }
  }
  const int64_t valid = O - 8 * g < 8 ? O - 8 * g : 8;
  for (int t = 0; t < TB; ++t) {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[t]);
    for (int r = 0; r < valid; ++r) y[(8 * g + r) * M + t0 + t] = out[r];
  }
}

template <Kind K, bool Int8, int TB>
void RowsTB(const Weights& w, const Acts& a, int64_t t0, float* y, int64_t M, int64_t r0, int64_t r1) {
  if constexpr (Int8) {  // r0 is a multiple of 16, r1 too or O: the groups of 8 in [r0, r1), rows below r1 written
    for (int64_t g = r0 / 8; 8 * g < r1; ++g) Group8<K, TB>(w, g, a, t0, y, M, r1);
  } else {
    for (int64_t r = r0; r < r1; ++r) Tile<K, TB>(w, r, a, t0, y, M);
  }
}

constexpr int64_t kRowBlock = 16;  // rows whose codes one token tile after another reads: a thread's work item

// Rows [r0, r1): blocks of kRowBlock rows outer, token tiles of 4 inner, so a block's codes are read from memory once.
template <Kind K, bool Int8>
void Rows(const Weights& w, const Acts& a, float* y, int64_t M, int64_t r0, int64_t r1) {
  for (int64_t b = r0; b < r1; b += kRowBlock) {
    const int64_t e = b + kRowBlock < r1 ? b + kRowBlock : r1;
    for (int64_t t0 = 0; t0 < M; t0 += 4) {
      switch (M - t0 < 4 ? M - t0 : 4) {
        case 1: RowsTB<K, Int8, 1>(w, a, t0, y, M, b, e); break;
        case 2: RowsTB<K, Int8, 2>(w, a, t0, y, M, b, e); break;
        case 3: RowsTB<K, Int8, 3>(w, a, t0, y, M, b, e); break;
        default: RowsTB<K, Int8, 4>(w, a, t0, y, M, b, e); break;
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

template <Kind K, bool Int8>
void Work(Split& s, int64_t k, const Weights& w, const Acts& a, float* y, int64_t M, int64_t O) {
  const int64_t n = static_cast<int64_t>(s.ranges.size());
  int64_t done = 0;
  for (int64_t d = 0; d < n; ++d) {
    int64_t g;
    while (s.Take((k + d) % n, d == 0, &g)) {
      Rows<K, Int8>(w, a, y, M, g * kRowBlock, (g + 1) * kRowBlock < O ? (g + 1) * kRowBlock : O);
      ++done;
    }
  }
  if (done > 0) s.left.fetch_sub(done, std::memory_order_release);
}

// One token's block of 32 activations quantized: q's bytes 0..15 to lo, 16..31 to hi; -> dx, the float sum of x
// and the sum of q.  dx = amax / 127, q = round-to-nearest-even(x * (1 / dx)) (0 for an all-zero block).
inline float QuantizeBlock(const float* x, int8_t* lo, int8_t* hi, float* sum_x, int32_t* sum_q) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + 8 * k);
  const __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                    _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float dx = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))) / 127.0f;
  const __m256 inv = _mm256_set1_ps(dx > 0.0f ? 1.0f / dx : 0.0f);
  __m256i q[4];
  for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));  // MXCSR: nearest even
  const __m256i packed = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm256_castsi256_si128(packed));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm256_extracti128_si256(packed, 1));
  *sum_x = Sum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  *sum_q = SumInt8(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
  return dx;
}

// The int8 activations of a call (Acts), owned.
struct Int8Buffers {
  std::vector<int8_t, Aligned64<int8_t>> q;
  Floats scale, sums;
  std::vector<int32_t, Aligned64<int32_t>> bias;
};

// The int8 activations of x (token-major [M, I]) into `a`, backed by `buf`.
template <Kind K>
void QuantizeActs(const float* xt, int64_t I, int64_t M, Int8Buffers& buf, Acts& a) {
  const int64_t B = I / 32;
  buf.q.assign(M * I, 0);
  buf.scale.assign(M * B, 0.0f);
  if (K == kQ4_1) buf.sums.assign(M * B, 0.0f);
  if (K == kQ4_0) buf.bias.assign(M * B, 0);
  for (int64_t t = 0; t < M; ++t) {
    for (int64_t b = 0; b < B; ++b) {
      int8_t* q = buf.q.data() + (t * B + b) * 32;
      float sum_x;
      int32_t sum_q;
      buf.scale[t * B + b] = QuantizeBlock(xt + t * I + b * 32, q, q + 16, &sum_x, &sum_q);
      if (K == kQ4_1) buf.sums[t * B + b] = sum_x;
      if (K == kQ4_0) buf.bias[t * B + b] = -8 * sum_q;
    }
  }
  a.q = buf.q.data();
  a.scale = buf.scale.data();
  a.sums = buf.sums.data();
  a.bias = buf.bias.data();
}

template <Kind K, bool Int8>
ffi::Error Run(ffi::ThreadPool pool, const Weights& w, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const int64_t O = y->dimensions()[0], M = y->dimensions()[1], I = w.blocks * 32;
  if (x.dimensions()[0] != I || x.dimensions()[1] != M) {
    return ffi::Error::InvalidArgument("specjax quant matmul: x must be [I, M] with I = 32 * blocks");
  }
  const float* xt = x.typed_data();
  Floats scratch;
  if (M > 1 || reinterpret_cast<uintptr_t>(xt) % 64 != 0) {  // x [I, M] -> token-major [M, I], line-aligned
    scratch.resize(I * M);
    for (int64_t t = 0; t < M; ++t) {  // a token's row written in order (2.2x faster than i outer at M = 4)
      float* row = scratch.data() + t * I;
      for (int64_t i = 0; i < I; ++i) row[i] = xt[i * M + t];
    }
    xt = scratch.data();
  }
  Acts a{xt, I, nullptr, nullptr, nullptr, nullptr};
  Int8Buffers buf;
  if constexpr (Int8) QuantizeActs<K>(xt, I, M, buf, a);
  float* out = y->typed_data();
  int64_t n = pool.num_threads();
  if (n < 1) n = 1;
  if (n > O / 64) n = O / 64 > 0 ? O / 64 : 1;
  auto split = std::make_shared<Split>((O + kRowBlock - 1) / kRowBlock, n);
  specjax_workers_v3::Share(pool, M, static_cast<int>(n - 1),
                            [split, w, a, out, M, O](int k) { Work<K, Int8>(*split, k, w, a, out, M, O); });
  Work<K, Int8>(*split, 0, w, a, out, M, O);
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

template <bool Int8>
ffi::Error Q4_0(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::U16> scales,
                ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, int64_t layer) {
  if (!LayerInRange(codes, layer) || !LayerInRange(scales, layer)) return LayerError();
  Weights w{AtLayer(codes, layer), AtLayer(scales, layer), nullptr, BlocksPerRow(scales, layer)};
  return Run<kQ4_0, Int8>(pool, w, x, y);
}

template <bool Int8>
ffi::Error Q4_1(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::U16> scales,
                ffi::Buffer<ffi::U16> mins, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, int64_t layer) {
  if (!LayerInRange(codes, layer) || !LayerInRange(scales, layer) || !LayerInRange(mins, layer)) return LayerError();
  Weights w{AtLayer(codes, layer), AtLayer(scales, layer), AtLayer(mins, layer), BlocksPerRow(scales, layer)};
  return Run<kQ4_1, Int8>(pool, w, x, y);
}

template <bool Int8>
ffi::Error Q8_0(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::U16> scales,
                ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y, int64_t layer) {
  if (!LayerInRange(codes, layer) || !LayerInRange(scales, layer)) return LayerError();
  Weights w{reinterpret_cast<const uint8_t*>(AtLayer(codes, layer)), AtLayer(scales, layer), nullptr,
            BlocksPerRow(scales, layer)};
  return Run<kQ8_0, Int8>(pool, w, x, y);
}

ffi::Error BF16(ffi::ThreadPool pool, ffi::Buffer<ffi::U16> codes, ffi::Buffer<ffi::F32> x,
                ffi::ResultBuffer<ffi::F32> y, int64_t layer) {
  if (!LayerInRange(codes, layer)) return LayerError();
  Weights w{reinterpret_cast<const uint8_t*>(AtLayer(codes, layer)), nullptr, nullptr, BlocksPerRow(codes, layer)};
  return Run<kBF16, false>(pool, w, x, y);
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
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ4_0, Q4_0<false>, SPECJAX_Q4_0_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ4_1, Q4_1<false>, SPECJAX_Q4_1_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ8_0, Q8_0<false>, SPECJAX_Q8_0_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ4_0I8, Q4_0<true>, SPECJAX_Q4_0_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ4_1I8, Q4_1<true>, SPECJAX_Q4_1_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxQ8_0I8, Q8_0<true>, SPECJAX_Q8_0_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxBF16, BF16,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer"));
