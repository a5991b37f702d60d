// specjax CPU kernel: attention of a step's few query rows over paged K/V, read in place (no gather copy).
//
// XLA:CPU reads a sequence's pages for attention by first gathering them into a contiguous [K, B, S, H] copy
// (a decode step over 512 cached tokens of SmolLM2 copies 24 MB per sequence, per step).  This kernel walks the
// page table instead: for each (KV head, sequence) it scores the query rows against every visible cached row, then
// accumulates the value rows, reading each K and V row once.  It returns the cache's share of a softmax that the
// caller merges with the step's own rows (model/attention.py `paged_attention`):
//   m[k, b, r] = max_s score,  l[k, b, r] = sum_s exp(score - m),  o[k, b, r, :] = sum_s exp(score - m) v_s
// over the cached positions s < lengths[b] (m = kMask, l = 0, o = 0 when there are none).  A sequence's cached
// positions are split into chunks of kChunk, the work items spread over the threads (a batch-1 step has as many
// (KV head, sequence) pairs as KV heads, 3 for SmolLM2: too few to share between two threads evenly), and each
// pair's chunks are merged in chunk order by the thread that finishes its last one.  Every query row is computed
// on its own with the same order of operations whatever the number of rows or sequences in the call (the chunks
// depend on the row's own sequence length only), so the cache's share of a verification row is bit-identical to
// plain decoding's.
//
// Shapes: q [K, B, R, H] (R = query rows per KV head), k_pool / v_pool [K, P, Z, H], page_table [B, Pg] int32,
// lengths [B] int32; H a multiple of 16 up to 256.  AVX-512F or AVX2 + FMA (simd.h).  Work items are claimed from
// the XLA:CPU intra-op thread pool's threads.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace specjax_simd;

constexpr float kMask = -1e30f;  // model/layers.py MASK_VALUE
constexpr int kMaxVec = 256 / kLanes;  // H <= 256

struct Args {
  const float *q, *k_pool, *v_pool;
  const int32_t *table, *lengths;
  float *o, *m, *l;
  int64_t kv_heads, batch, rows, head_dim, pages, page_size, table_width;
  float scale;
};

constexpr int64_t kChunk = 256;  // cached positions per work item: a pair's positions are split into such chunks

// Where the items of one call keep their partial softmaxes until the pair's last chunk merges them.
struct Parts {
  int64_t chunks;                      // chunks per pair: ceil(max visible length / kChunk), at least 1
  Floats o, m, l;                      // [pair, chunk, R, H], [pair, chunk, R] x 2
  Floats qs;                           // [pair, R, H]: each pair's q rows, scaled
  std::vector<std::atomic<int64_t>> left;  // chunks of each pair not finished yet
};

// One block of the value sum: rows r < RG (of the rows' p, p[r * ps + i]) x vectors j < VG (of H, from column c)
// of o += p[r, s] v_s over the n cached rows in s order, the block's accumulators in registers (the V rows are read
// from cache once per block instead of o's rows from memory once per position); each output element is still one
// FMA per position in s order, so the sums are the same whatever the blocking.
template <int RG, int VG>
void PvBlock(const float* const* vrows, int64_t n, const float* p, int64_t ps, int64_t c, float* o, int64_t H) {
  Vec acc[RG][VG];
  for (int r = 0; r < RG; ++r)
    for (int j = 0; j < VG; ++j) acc[r][j] = Zero();
  for (int64_t i = 0; i < n; ++i) {
    Vec vv[VG];
    for (int j = 0; j < VG; ++j) vv[j] = Load(vrows[i] + c + kLanes * j);
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
using PvFn = void (*)(const float* const*, int64_t, const float*, int64_t, int64_t, float*, int64_t);
template <int... I>
constexpr std::array<PvFn, sizeof...(I)> PvTable(std::integer_sequence<int, I...>) {
  return {&PvBlock<I / kVecGroup + 1, I % kVecGroup + 1>...};
}
constexpr auto kPvBlocks = PvTable(std::make_integer_sequence<int, kRowGroup * kVecGroup>());

// The cache's share over cached positions [s0, s1) of one (KV head, sequence) pair: max, sum of p = exp(score -
// max) and sum of p v per query row, into om / mm / lm.  qs holds the pair's R query rows, scaled.  A score is the
// dot product of a query row and a K row: kLanes-lane products accumulated over H in order, then the lanes summed
// by SumEach's tree, kLanes cached positions at a time (a decoding step has 3 query rows per KV head on SmolLM2,
// so vectors over positions fill the lanes where vectors over rows used 3 of 16).  Scores are kept per row,
// st[r, i], a row's positions padded to whole vectors with kMask (their p is 0).  Every row's arithmetic is the
// same whatever R is.
void Chunk(const Args& a, int64_t kh, int64_t b, int64_t s0, int64_t s1, const float* qs, Floats& st,
           float* om, float* mm, float* lm) {
  const int64_t H = a.head_dim, R = a.rows, Z = a.page_size, nv = H / kLanes;
  const int64_t n = s1 - s0, ns = (n + kLanes - 1) / kLanes * kLanes;
  st.resize(R * ns);
  const int32_t* table = a.table + b * a.table_width;
  const float* kbase = a.k_pool + kh * a.pages * Z * H;
  const float* vbase = a.v_pool + kh * a.pages * Z * H;
  auto row = [&](const float* base, int64_t s) {
    return base + (static_cast<int64_t>(table[s / Z]) * Z + s % Z) * H;
  };
  for (int64_t i0 = 0; i0 < n; i0 += kLanes) {
    const float* kr[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) kr[i] = row(kbase, s0 + i0 + (i0 + i < n ? i : 0));
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = qs + r * H;
      Vec acc[kLanes];
      const Vec q0 = Load(qr);
      for (int i = 0; i < kLanes; ++i) acc[i] = Mul(q0, Load(kr[i]));
      for (int64_t j = 1; j < nv; ++j) {
        const Vec qv = Load(qr + kLanes * j);
        for (int i = 0; i < kLanes; ++i) acc[i] = Fma(qv, Load(kr[i] + kLanes * j), acc[i]);
      }
      Store(st.data() + r * ns + i0, SumEach(acc));
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // per row: max, p = exp(score - max) in place, sum of p
    float* sr = st.data() + r * ns;
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
  const float* vrows[kChunk];
  for (int64_t i = 0; i < n; ++i) vrows[i] = row(vbase, s0 + i);
  for (int64_t r0 = 0; r0 < R; r0 += kRowGroup) {  // o[r] += p[r, s] v_s in s order, a block of o in registers
    for (int64_t j0 = 0; j0 < nv; j0 += kVecGroup) {
      const int rg = R - r0 < kRowGroup ? static_cast<int>(R - r0) : kRowGroup;
      const int vg = nv - j0 < kVecGroup ? static_cast<int>(nv - j0) : kVecGroup;
      kPvBlocks[(rg - 1) * kVecGroup + vg - 1](vrows, n, st.data() + r0 * ns, ns, j0 * kLanes, om + r0 * H, H);
    }
  }
}

// Merge a pair's chunk partials in chunk order into the outputs: m = max_c m_c, l = sum_c l_c e^(m_c - m),
// o = sum_c o_c e^(m_c - m) (m = kMask, l = 0, o = 0 when the sequence has no cached rows).
void Merge(const Args& a, const Parts& parts, int64_t pair, int64_t chunks) {
  const int64_t H = a.head_dim, R = a.rows, nv = H / kLanes;
  float* o = a.o + pair * R * H;
  float* m = a.m + pair * R;
  float* l = a.l + pair * R;
  const float* om = parts.o.data() + pair * parts.chunks * R * H;
  const float* mm = parts.m.data() + pair * parts.chunks * R;
  const float* lm = parts.l.data() + pair * parts.chunks * R;
  for (int64_t r = 0; r < R; ++r) {
    float mx = kMask;
    for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, mm[c * R + r]);
    float sum = 0.0f;
    for (int64_t j = 0; j < nv; ++j) Store(o + r * H + kLanes * j, Zero());
    for (int64_t c = 0; c < chunks; ++c) {
      const float w = std::exp(mm[c * R + r] - mx);
      sum += lm[c * R + r] * w;
      const Vec wv = Set1(w);
      for (int64_t j = 0; j < nv; ++j) {
        float* dst = o + r * H + kLanes * j;
        Store(dst, Fma(wv, Load(om + (c * R + r) * H + kLanes * j), Load(dst)));
      }
    }
    m[r] = mx;  // kMask when there are no chunks
    l[r] = sum;
  }
}

// One call's shared state: its items (the chunks of pair i are first[i] .. first[i + 1] - 1), claimed in order
// from `next` by the caller and the pool threads helping it.
struct Call {
  Args a;
  Parts parts;
  std::vector<int64_t> first, visible;  // visible: cached rows each sequence attends to
  int64_t items = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> unmerged{0};  // pairs with chunks whose merge is not done: the caller returns at 0

  void Work() {
    Floats st;
    const int64_t R = a.rows, H = a.head_dim;
    int64_t pair = 0;
    for (int64_t it = next.fetch_add(1); it < items; it = next.fetch_add(1)) {
      while (first[pair + 1] <= it) ++pair;  // items are claimed in increasing order
      const int64_t c = it - first[pair], b = pair % a.batch;
      const int64_t s0 = c * kChunk, s1 = std::min(visible[b], s0 + kChunk);
      const int64_t slot = pair * parts.chunks + c;
      Chunk(a, pair / a.batch, b, s0, s1, parts.qs.data() + pair * R * H, st, parts.o.data() + slot * R * H,
            parts.m.data() + slot * R, parts.l.data() + slot * R);
      if (parts.left[pair].fetch_sub(1, std::memory_order_acq_rel) == 1) {  // the pair's last chunk: merge it
        Merge(a, parts, pair, first[pair + 1] - first[pair]);
        unmerged.fetch_sub(1, std::memory_order_release);
      }
    }
  }
};

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pool,
                          ffi::Buffer<ffi::F32> v_pool, ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> lengths, float scale, ffi::ResultBuffer<ffi::F32> o,
                          ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l) {
  const auto qd = q.dimensions(), kd = k_pool.dimensions(), td = page_table.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || kd[0] != qd[0] || kd[3] != qd[3] || td[0] != qd[1] ||
      lengths.dimensions()[0] != qd[1] || v_pool.dimensions().size() != 4 ||
      !std::equal(kd.begin(), kd.end(), v_pool.dimensions().begin())) {
    return ffi::Error::InvalidArgument("specjax paged attention: q [K, B, R, H], pools [K, P, Z, H], "
                                       "page_table [B, Pg], lengths [B]");
  }
  if (qd[3] % 16 != 0 || qd[3] > kLanes * kMaxVec) {
    return ffi::Error::InvalidArgument("specjax paged attention: head_dim must be a multiple of 16, at most 256");
  }
  Args a{q.typed_data(), k_pool.typed_data(), v_pool.typed_data(), page_table.typed_data(), lengths.typed_data(),
         o->typed_data(), m->typed_data(), l->typed_data(), qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], td[1], scale};
  const int64_t pairs = a.kv_heads * a.batch, R = a.rows, H = a.head_dim;
  std::vector<int64_t> visible(a.batch);  // cached rows each sequence attends to
  int64_t longest = 0;
  for (int64_t b = 0; b < a.batch; ++b) {
    visible[b] = std::min<int64_t>(std::max<int32_t>(a.lengths[b], 0), a.table_width * a.page_size);
    longest = std::max(longest, visible[b]);
  }
  // Everything a helper thread touches lives in `c`, held by the helpers (shared_ptr), so the caller returns as
  // soon as every pair is merged and never waits for a helper to start: a helper still queued when the call ends
  // (its pool threads busy, e.g. in another program's call of this kernel) finds no item left and touches nothing
  // else.  Waiting for the helpers themselves deadlocked two programs running at once, each spinning on a pool
  // thread for a helper queued behind the other (tests/model/test_paged_attention.py, concurrent programs).
  auto c = std::make_shared<Call>();
  c->a = a;
  Parts& parts = c->parts;
  parts.chunks = std::max<int64_t>(1, (longest + kChunk - 1) / kChunk);
  parts.o.resize(pairs * parts.chunks * R * H);
  parts.m.resize(pairs * parts.chunks * R);
  parts.l.resize(pairs * parts.chunks * R);
  parts.left = std::vector<std::atomic<int64_t>>(pairs);
  c->first.assign(pairs + 1, 0);
  int64_t unmerged = 0;
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t chunks = (visible[i % a.batch] + kChunk - 1) / kChunk;
    parts.left[i].store(chunks, std::memory_order_relaxed);
    c->first[i + 1] = c->first[i] + chunks;
    if (chunks == 0) {
      Merge(a, parts, i, 0);  // no cached rows: the empty share
    } else {
      ++unmerged;
    }
  }
  c->visible = std::move(visible);
  c->items = c->first[pairs];
  c->unmerged.store(unmerged, std::memory_order_relaxed);
  parts.qs.resize(pairs * R * H);  // q scaled: scores come out scaled
  for (int64_t i = 0; i < pairs * R * H; ++i) parts.qs[i] = a.q[i] * a.scale;
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), c->items));
  for (int64_t k = 1; k < n; ++k) pool.Schedule([c] { c->Work(); });
  c->Work();
  while (c->unmerged.load(std::memory_order_acquire) > 0) Pause();  // items other threads claimed, being run
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPagedAttention, PagedAttention,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale").Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
