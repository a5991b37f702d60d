// specjax CPU kernel: attention of a step's few query rows over paged K/V (read in place, no gather copy) and the
// step's own new K/V rows, in one softmax.
//
// XLA:CPU reads a sequence's pages for attention by first gathering them into a contiguous [K, B, S, H] copy
// (a decode step over 512 cached tokens of SmolLM2 copies 24 MB per sequence, per step).  This kernel walks the
// page table instead.  Sequence b's keys are its positions 0 .. L_b + T2 - 1: the first L_b = lengths[b] come from
// the pages, the next T2 are the step's own rows k_new / v_new (not in the pool yet: a forward only reads it), and
// query row t sees every cached position and the new rows visible[b, t, :] allows.  For each (KV head, sequence)
// it scores the query rows against every key, then accumulates the value rows, reading each K and V row once.  The
// positions are split into chunks of kChunk by their absolute position, the work items spread over the threads (a
// batch-1 step has as many (KV head, sequence) pairs as KV heads, 3 for SmolLM2: too few to share between two
// threads evenly), and the thread that finishes a pair's last chunk merges its partial softmaxes in chunk order and
// divides.  A row's arithmetic is the same whether a key is cached or new, and keys it does not see add exact
// zeros, so a row's result depends only on the keys it sees and their positions: a verification row over L cached
// rows and the drafts before it is bit-identical to plain decoding's row over L + t cached rows, whatever the
// number of rows or sequences in the call.
//
// The K/V rows are float32, float16 or bfloat16 (the pools and the new rows alike: a KV cache stored at 16 bits
// reads half the bytes); each is widened to float32 exactly as it is read, and everything after is float32.
//
// Shapes: q [B, T, N, H] float32, k_pool / v_pool [K, P, Z, H] (attribute layer = -1) or every layer's pools
// [L, K, P, Z, H] (layer = the one read), page_table [B, Pg] int32, lengths [B] int32, k_new / v_new [B, T2, K, H],
// visible [B, T, T2] int32; out [B, T, N, H] float32.  H a multiple of 16 up to 256.
// AVX-512F or AVX2 + FMA (simd.h).  Work items are claimed by the caller and the kernels' helper threads
// (workers.h).
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_simd;

constexpr float kMask = -1e30f;  // model/layers.py MASK_VALUE
constexpr int kMaxVec = 256 / kLanes;  // H <= 256

// The stored element types of K/V rows, and each one's float32 load of kLanes values.
struct F16 {
  uint16_t bits;
};
struct BF16 {
  uint16_t bits;
};
inline Vec LoadRow(const float* p) { return Load(p); }
inline Vec LoadRow(const F16* p) { return F16ToFloat(&p->bits); }
inline Vec LoadRow(const BF16* p) { return BF16ToFloat(&p->bits); }

enum class Stored { kF32, kF16, kBF16 };

struct Args {
  const float* q;
  const void *k_pool, *v_pool, *k_new, *v_new;  // all of `stored` type
  Stored stored;
  const int32_t *table, *lengths, *visible;
  float* out;
  int64_t kv_heads, batch, steps, heads, head_dim, pages, page_size, table_width, new_rows, rows;  // rows = T x G
  float scale;
};

constexpr int64_t kChunk = 256;  // positions per work item: a pair's positions are split into such chunks

// Where the items of one call keep their partial softmaxes until the pair's last chunk merges them.
struct Parts {
  int64_t chunks;                      // chunks per pair: the most any pair has, at least 1
  Floats o, m, l;                      // [pair, chunk, R, H], [pair, chunk, R] x 2
  Floats qs;                           // [pair, R, H]: each pair's q rows (r = t * G + g), scaled
  std::vector<int64_t> cached;         // [B] cached positions of each sequence (lengths, clamped to its table)
  std::vector<std::atomic<int64_t>> left;  // chunks of each pair not finished yet
};

// One block of the value sum: rows r < RG (of the rows' p, p[r * ps + i]) x vectors j < VG (of H, from column c)
// of o += p[r, s] v_s over the n cached rows in s order, the block's accumulators in registers (the V rows are read
// from cache once per block instead of o's rows from memory once per position); each output element is still one
// FMA per position in s order, so the sums are the same whatever the blocking.
template <class T, int RG, int VG>
void PvBlock(const T* const* vrows, int64_t n, const float* p, int64_t ps, int64_t c, float* o, int64_t H) {
  Vec acc[RG][VG];
  for (int r = 0; r < RG; ++r)
    for (int j = 0; j < VG; ++j) acc[r][j] = Zero();
  for (int64_t i = 0; i < n; ++i) {
    Vec vv[VG];
    for (int j = 0; j < VG; ++j) vv[j] = LoadRow(vrows[i] + c + kLanes * j);
    for (int r = 0; r < RG; ++r) {
      const Vec pv = Set1(p[r * ps + i]);
      for (int j = 0; j < VG; ++j) acc[r][j] = Fma(pv, vv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int j = 0; j < VG; ++j) Store(o + r * H + c + kLanes * j, acc[r][j]);
}

// A PvBlock's rows x vectors: 16 accumulators in AVX-512's 32 registers, 8 in AVX2's 16.
constexpr int kRowGroup = kLanes == 16 ? 4 : 2, kVecGroup = 4;
template <class T>
using PvFn = void (*)(const T* const*, int64_t, const float*, int64_t, int64_t, float*, int64_t);
template <class T, int... I>
constexpr std::array<PvFn<T>, sizeof...(I)> PvTable(std::integer_sequence<int, I...>) {
  return {&PvBlock<T, I / kVecGroup + 1, I % kVecGroup + 1>...};
}
template <class T>
constexpr auto kPvBlocks = PvTable<T>(std::make_integer_sequence<int, kRowGroup * kVecGroup>());

// One query row's scaled scores against kLanes K rows, a lane each: kLanes-lane products accumulated over H in
// order, then the lanes summed by SumEach's tree.  A K row is read whole before the next: the rows stream in
// order (one core over rows not in cache: 1.2-1.35x faster than vector j of every row, then j + 1); the arithmetic
// of each lane is the same either way.
template <int NV>
inline Vec ScoresOf(const float* q, const float* const* kr) {
  Vec qv[NV], acc[kLanes];
  for (int j = 0; j < NV; ++j) qv[j] = Load(q + kLanes * j);
  for (int i = 0; i < kLanes; ++i) {
    Vec x = Mul(qv[0], Load(kr[i]));
    for (int j = 1; j < NV; ++j) x = Fma(qv[j], Load(kr[i] + kLanes * j), x);
    acc[i] = x;
  }
  return SumEach(acc);
}

inline Vec Scores(const float* q, const float* const* kr, int64_t nv) {
  switch (nv) {  // H / kLanes: 4 or 8 for head_dim 64 or 128 on AVX-512
    case 4: return ScoresOf<4>(q, kr);
    case 8: return ScoresOf<8>(q, kr);
    default: break;
  }
  Vec acc[kLanes];
  const Vec q0 = Load(q);
  for (int i = 0; i < kLanes; ++i) acc[i] = Mul(q0, Load(kr[i]));
  for (int64_t j = 1; j < nv; ++j) {
    const Vec qv = Load(q + kLanes * j);
    for (int i = 0; i < kLanes; ++i) acc[i] = Fma(qv, Load(kr[i] + kLanes * j), acc[i]);
  }
  return SumEach(acc);
}

// The share of positions [s0, s1) of pair (kh, b) in the softmax of each of its rows: max, sum of p = exp(score -
// max) and sum of p v, into om / mm / lm.  qs holds the pair's R query rows, scaled.  A score is the dot product
// of a query row and a K row: kLanes-lane products accumulated over H in order, then the lanes summed by SumEach's
// tree, kLanes positions at a time (a decoding step has 3 query rows per KV head on SmolLM2, so vectors over
// positions fill the lanes where vectors over rows used 3 of 16).  Scores are kept per row, st[r, i], a row's
// positions padded to whole vectors with kMask; a new row a query does not see scores kMask too, so its p is
// exactly 0 (Exp) and it adds exact zeros to the row's sums.  Every row's arithmetic is the same whatever R is.
// 16-bit K rows are widened into kt, kLanes rows at a time, once for all R query rows (V rows as they are read).
template <class T>
void Chunk(const Args& a, const Parts& parts, int64_t kh, int64_t b, int64_t s0, int64_t s1, const float* qs,
           Floats& st, Floats& kt, float* om, float* mm, float* lm) {
  const int64_t H = a.head_dim, R = a.rows, Z = a.page_size, nv = H / kLanes, G = a.heads / a.kv_heads;
  const int64_t n = s1 - s0, ns = (n + kLanes - 1) / kLanes * kLanes, cached = parts.cached[b], T2 = a.new_rows;
  st.resize(R * ns);
  const int32_t* table = a.table + b * a.table_width;
  auto row = [&](const void* pool, const void* fresh, int64_t s) -> const T* {  // position s's K or V row
    if (s >= cached) return static_cast<const T*>(fresh) + ((b * T2 + s - cached) * a.kv_heads + kh) * H;
    return static_cast<const T*>(pool) + kh * a.pages * Z * H + (static_cast<int64_t>(table[s / Z]) * Z + s % Z) * H;
  };
  if constexpr (!std::is_same_v<T, float>) kt.resize(kLanes * H);
  for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
    const float* kr[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) {
      const T* k = row(a.k_pool, a.k_new, s0 + i0 + (i0 + i < n ? i : 0));
      if constexpr (std::is_same_v<T, float>) {
        kr[i] = k;
      } else {
        for (int64_t j = 0; j < nv; ++j) Store(kt.data() + i * H + kLanes * j, LoadRow(k + kLanes * j));
        kr[i] = kt.data() + i * H;
      }
    }
    for (int64_t r = 0; r < R; ++r) Store(st.data() + r * ns + i0, Scores(qs + r * H, kr, nv));
  }
  const int32_t* vis = a.visible + b * a.steps * T2;
  for (int64_t r = 0; r < R; ++r) {  // per row: hide what it does not see, max, p = exp(score - max), sum of p
    float* sr = st.data() + r * ns;
    for (int64_t s = std::max(s0, cached); s < s1; ++s)
      if (!vis[(r / G) * T2 + s - cached]) sr[s - s0] = kMask;
    for (int64_t i = n; i < ns; ++i) sr[i] = kMask;
    Vec mx = Set1(kMask);
    for (int64_t i0 = 0; i0 < ns; i0 += kLanes) mx = Max(mx, Load(sr + i0));
    const float m = MaxOf(mx);
    const Vec mv = Set1(m);
    Vec sum = Zero();
    for (int64_t i0 = 0; i0 < ns; i0 += kLanes) {
      const Vec p = Exp(Sub(Load(sr + i0), mv));
      Store(sr + i0, p);
      sum = Add(sum, p);
    }
    mm[r] = m;
    lm[r] = Sum(sum);
  }
  const T* vrows[kChunk];
  for (int64_t i = 0; i < n; ++i) vrows[i] = row(a.v_pool, a.v_new, s0 + i);
  for (int64_t r0 = 0; r0 < R; r0 += kRowGroup) {  // o[r] += p[r, s] v_s in s order, a block of o in registers
    for (int64_t j0 = 0; j0 < nv; j0 += kVecGroup) {
      const int rg = R - r0 < kRowGroup ? static_cast<int>(R - r0) : kRowGroup;
      const int vg = nv - j0 < kVecGroup ? static_cast<int>(nv - j0) : kVecGroup;
      kPvBlocks<T>[(rg - 1) * kVecGroup + vg - 1](vrows, n, st.data() + r0 * ns, ns, j0 * kLanes, om + r0 * H, H);
    }
  }
}

// Merge pair (kh, b)'s chunk partials in chunk order, out = o / l with m = max_c m_c, l = sum_c l_c e^(m_c - m),
// o = sum_c o_c e^(m_c - m).  A chunk whose positions a row does not see has m_c = kMask and weighs exactly 0.
// Rows of a pair without positions get 0.
void Merge(const Args& a, const Parts& parts, int64_t pair, int64_t chunks) {
  const int64_t H = a.head_dim, R = a.rows, nv = H / kLanes, G = a.heads / a.kv_heads;
  const int64_t kh = pair / a.batch, b = pair % a.batch;
  const float* om = parts.o.data() + pair * parts.chunks * R * H;
  const float* mm = parts.m.data() + pair * parts.chunks * R;
  const float* lm = parts.l.data() + pair * parts.chunks * R;
  for (int64_t r = 0; r < R; ++r) {
    float* dst = a.out + ((b * a.steps + r / G) * a.heads + kh * G + r % G) * H;
    float mx = kMask;
    for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, mm[c * R + r]);
    float sum = 0.0f;
    Vec acc[kMaxVec];
    for (int64_t j = 0; j < nv; ++j) acc[j] = Zero();
    for (int64_t c = 0; c < chunks; ++c) {
      const float w = std::exp(mm[c * R + r] - mx);
      sum += lm[c * R + r] * w;
      const Vec wv = Set1(w);
      for (int64_t j = 0; j < nv; ++j) acc[j] = Fma(wv, Load(om + (c * R + r) * H + kLanes * j), acc[j]);
    }
    const Vec den = Set1(chunks ? sum : 1.0f);
    for (int64_t j = 0; j < nv; ++j) Store(dst + kLanes * j, Div(acc[j], den));
  }
}

// One call's shared state: its items (the chunks of pair i are first[i] .. first[i + 1] - 1), claimed in order
// from `next` by the caller and the helper threads (workers.h).
struct Call {
  Args a;
  Parts parts;
  std::vector<int64_t> first;
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> unmerged{0};  // pairs with chunks whose merge is not done: the caller returns at 0

  void Work() {
    switch (a.stored) {
      case Stored::kF32: return WorkOn<float>();
      case Stored::kF16: return WorkOn<F16>();
      case Stored::kBF16: return WorkOn<BF16>();
    }
  }

  template <class T>
  void WorkOn() {
    Floats st, kt;
    const int64_t R = a.rows, H = a.head_dim;
    int64_t pair = 0;
    for (int64_t it = next.fetch_add(1); it < items; it = next.fetch_add(1)) {
      while (first[pair + 1] <= it) ++pair;  // items are claimed in increasing order
      const int64_t c = it - first[pair], b = pair % a.batch;
      const int64_t s0 = c * kChunk, s1 = std::min(parts.cached[b] + a.new_rows, s0 + kChunk);
      const int64_t slot = pair * parts.chunks + c;
      Chunk<T>(a, parts, pair / a.batch, b, s0, s1, parts.qs.data() + pair * R * H, st, kt,
               parts.o.data() + slot * R * H, parts.m.data() + slot * R, parts.l.data() + slot * R);
      if (parts.left[pair].fetch_sub(1, std::memory_order_acq_rel) == 1) {  // the pair's last chunk: merge it
        Merge(a, parts, pair, first[pair + 1] - first[pair]);
        unmerged.fetch_sub(1, std::memory_order_release);
      }
    }
  }
};

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pool,
                          ffi::AnyBuffer v_pool, ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> lengths,
                          ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> visible, float scale,
                          int64_t layer, ffi::ResultBuffer<ffi::F32> out) {
  // layer >= 0: the pools hold every layer's ([L, K, P, Z, H], model/target.py KVPages) and this call reads `layer`
  const auto qd = q.dimensions(), pd = k_pool.dimensions(), td = page_table.dimensions(), nd = k_new.dimensions(),
             vd = visible.dimensions();
  const size_t lead = layer >= 0 ? 1 : 0;
  if (pd.size() != 4 + lead || v_pool.dimensions().size() != pd.size() ||
      !std::equal(pd.begin(), pd.end(), v_pool.dimensions().begin()) || (lead && layer >= pd[0])) {
    return ffi::Error::InvalidArgument("specjax paged attention: pools [K, P, Z, H] (or [L, K, P, Z, H] with a layer "
                                       "in range)");
  }
  const int64_t kd[4] = {pd[lead], pd[lead + 1], pd[lead + 2], pd[lead + 3]};
  if (qd.size() != 4 || td.size() != 2 || nd.size() != 4 || vd.size() != 3 || kd[3] != qd[3] ||
      qd[2] % kd[0] != 0 || td[0] != qd[0] || lengths.dimensions().size() != 1 || lengths.dimensions()[0] != qd[0] ||
      nd[0] != qd[0] || nd[2] != kd[0] || nd[3] != qd[3] || v_new.dimensions().size() != 4 ||
      !std::equal(nd.begin(), nd.end(), v_new.dimensions().begin()) || vd[0] != qd[0] || vd[1] != qd[1] ||
      vd[2] != nd[1]) {
    return ffi::Error::InvalidArgument("specjax paged attention: q [B, T, N, H], pools [K, P, Z, H], "
                                       "page_table [B, Pg], lengths [B], k_new / v_new [B, T2, K, H], "
                                       "visible [B, T, T2]");
  }
  if (qd[3] % 16 != 0 || qd[3] > kLanes * kMaxVec) {
    return ffi::Error::InvalidArgument("specjax paged attention: head_dim must be a multiple of 16, at most 256");
  }
  const ffi::DataType kv = k_pool.element_type();
  if ((kv != ffi::DataType::F32 && kv != ffi::DataType::F16 && kv != ffi::DataType::BF16) ||
      v_pool.element_type() != kv || k_new.element_type() != kv || v_new.element_type() != kv) {
    return ffi::Error::InvalidArgument("specjax paged attention: the pools and new K/V rows must all be float32, all "
                                       "float16 or all bfloat16");
  }
  const Stored stored = kv == ffi::DataType::F32 ? Stored::kF32 : kv == ffi::DataType::F16 ? Stored::kF16
                                                                                         : Stored::kBF16;
  const int64_t K = kd[0], G = qd[2] / K;
  const int64_t layer_bytes = lead ? static_cast<int64_t>(k_pool.size_bytes() / pd[0]) * layer : 0;
  Args a{q.typed_data(), static_cast<const uint8_t*>(k_pool.untyped_data()) + layer_bytes,
         static_cast<const uint8_t*>(v_pool.untyped_data()) + layer_bytes, k_new.untyped_data(), v_new.untyped_data(),
         stored, page_table.typed_data(), lengths.typed_data(), visible.typed_data(), out->typed_data(),
         K, qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], td[1], nd[1], qd[1] * G, scale};
  const int64_t pairs = a.kv_heads * a.batch, R = a.rows, H = a.head_dim;
  // Everything a helper thread touches lives in `c`, held by the helpers (shared_ptr), so the caller returns as
  // soon as every pair is merged and never waits for a helper to start: a helper still queued when the call ends
  // (busy, e.g. with another program's call of this kernel) finds no item left and touches nothing
  // else.  Waiting for the helpers themselves deadlocked two programs running at once, each spinning on an XLA
  // pool thread for a helper queued behind the other (tests/model/test_paged_attention.py, concurrent programs).
  auto c = std::make_shared<Call>();
  c->a = a;
  Parts& parts = c->parts;
  parts.cached.resize(a.batch);
  int64_t longest = 0;
  for (int64_t b = 0; b < a.batch; ++b) {
    parts.cached[b] = std::min<int64_t>(std::max<int32_t>(a.lengths[b], 0), a.table_width * a.page_size);
    longest = std::max(longest, parts.cached[b] + a.new_rows);
  }
  parts.chunks = std::max<int64_t>(1, (longest + kChunk - 1) / kChunk);
  parts.o.resize(pairs * parts.chunks * R * H);
  parts.m.resize(pairs * parts.chunks * R);
  parts.l.resize(pairs * parts.chunks * R);
  parts.left = std::vector<std::atomic<int64_t>>(pairs);
  c->first.assign(pairs + 1, 0);
  int64_t unmerged = 0;
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t chunks = (parts.cached[i % a.batch] + a.new_rows + kChunk - 1) / kChunk;
    parts.left[i].store(chunks, std::memory_order_relaxed);
    c->first[i + 1] = c->first[i] + chunks;
    if (chunks == 0) {
      Merge(a, parts, i, 0);  // no positions at all: zeros
    } else {
      ++unmerged;
    }
  }
  c->items = c->first[pairs];
  c->unmerged.store(unmerged, std::memory_order_relaxed);
  parts.qs.resize(pairs * R * H);  // rows r = (t, g): query t, head kh * G + g; scaled: scores come out scaled
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t kh = i / a.batch, b = i % a.batch;
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = a.q + ((b * a.steps + r / G) * a.heads + kh * G + r % G) * H;
      for (int64_t h = 0; h < H; ++h) parts.qs[(i * R + r) * H + h] = qr[h] * a.scale;
    }
  }
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), c->items));
  specjax_workers_v4::Share(pool, a.batch * a.steps, static_cast<int>(n - 1), [c](int) { c->Work(); });
  c->Work();
  while (c->unmerged.load(std::memory_order_acquire) > 0) Pause();  // items other threads claimed, being run
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPagedAttention, PagedAttention,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Attr<float>("scale").Attr<int64_t>("layer")
                                  .Ret<ffi::Buffer<ffi::F32>>());
