// specjax CPU kernel: attention of a step's few query rows over paged K/V, read in place (no gather copy).
//
// XLA:CPU reads a sequence's pages for attention by first gathering them into a contiguous [K, B, S, H] copy
// (a decode step over 512 cached tokens of SmolLM2 copies 24 MB per sequence, per step).  This kernel walks the
// page table instead: for each (KV head, sequence) it scores the query rows against every visible cached row, then
// accumulates the value rows, reading each K and V row once.  It returns the cache's share of a softmax that the
// caller merges with the step's own rows (model/attention.py `paged_attention`):
//   m[k, b, r] = max_s score,  l[k, b, r] = sum_s exp(score - m),  o[k, b, r, :] = sum_s exp(score - m) v_s
// over the cached positions s < lengths[b] (m = kMask, l = 0, o = 0 when there are none).  Every query row is
// computed on its own with the same order of operations whatever the number of rows or sequences in the call,
// so the cache's share of a verification row is bit-identical to plain decoding's.
//
// Shapes: q [K, B, R, H] (R = query rows per KV head), k_pool / v_pool [K, P, Z, H], page_table [B, Pg] int32,
// lengths [B] int32; H a multiple of 16 up to 256.  AVX-512F or AVX2 + FMA (simd.h).  (KV head, sequence) pairs are split over the XLA:CPU
// intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <cstdint>
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

// One (KV head, sequence) pair.  Scores are kept transposed, st[s, r] (rows padded to whole vectors of kLanes),
// so that one vector holds kLanes query rows' scores for one cached position: a score is sum_h q[r, h] k[s, h]
// accumulated in h order in its own lane, the same arithmetic for every row whatever R is.
void Pair(const Args& a, int64_t kh, int64_t b, std::vector<float>& qt, std::vector<float>& st) {
  const int64_t H = a.head_dim, R = a.rows, Z = a.page_size, nv = H / kLanes, rp = (R + kLanes - 1) / kLanes * kLanes;
  const int64_t n = std::min<int64_t>(std::max<int32_t>(a.lengths[b], 0), a.table_width * Z);
  const float* q = a.q + (kh * a.batch + b) * R * H;
  float* o = a.o + (kh * a.batch + b) * R * H;
  float* m = a.m + kh * a.batch * R + b * R;
  float* l = a.l + kh * a.batch * R + b * R;
  std::fill(o, o + R * H, 0.0f);
  if (n == 0) {
    std::fill(m, m + R, kMask);
    std::fill(l, l + R, 0.0f);
    return;
  }
  qt.assign(H * rp, 0.0f);  // q transposed, [H, rp], scaled: scores come out scaled
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) qt[h * rp + r] = q[r * H + h] * a.scale;
  st.resize(n * rp);
  const int32_t* table = a.table + b * a.table_width;
  const float* kbase = a.k_pool + kh * a.pages * Z * H;
  const float* vbase = a.v_pool + kh * a.pages * Z * H;
  auto row = [&](const float* base, int64_t s) {
    return base + (static_cast<int64_t>(table[s / Z]) * Z + s % Z) * H;
  };
  constexpr int kS = 8;  // cached positions scored together: independent accumulators, one load of q per h
  for (int64_t s0 = 0; s0 < n; s0 += kS) {
    const int64_t cnt = n - s0 < kS ? n - s0 : kS;
    const float* kr[kS];
    for (int64_t i = 0; i < kS; ++i) kr[i] = row(kbase, s0 + (i < cnt ? i : 0));
    for (int64_t rb = 0; rb < rp; rb += kLanes) {
      Vec acc[kS];
      for (int i = 0; i < kS; ++i) acc[i] = Zero();
      for (int64_t h = 0; h < H; ++h) {
        const Vec qv = Load(qt.data() + h * rp + rb);
        for (int i = 0; i < kS; ++i) acc[i] = Fma(Set1(kr[i][h]), qv, acc[i]);
      }
      for (int64_t i = 0; i < cnt; ++i) Store(st.data() + (s0 + i) * rp + rb, acc[i]);
    }
  }
  for (int64_t rb = 0; rb < rp; rb += kLanes) {  // per row: max, p = exp(score - max) in place, sum of p
    Vec mx = Set1(kMask);
    for (int64_t s = 0; s < n; ++s) mx = Max(mx, Load(st.data() + s * rp + rb));
    Vec sum = Zero();
    for (int64_t s = 0; s < n; ++s) {
      const Vec p = Exp(Sub(Load(st.data() + s * rp + rb), mx));
      Store(st.data() + s * rp + rb, p);
      sum = Add(sum, p);
    }
    float mv[kLanes], lv[kLanes];
    Store(mv, mx);
    Store(lv, sum);
    for (int64_t r = rb; r < rb + kLanes && r < R; ++r) {
      m[r] = mv[r - rb];
      l[r] = lv[r - rb];
    }
  }
  for (int64_t s = 0; s < n; ++s) {  // o[r] += p[s, r] v_s in s order: each cached V row read once
    const float* vr = row(vbase, s);
    Vec vv[kMaxVec];
    for (int64_t j = 0; j < nv; ++j) vv[j] = Load(vr + kLanes * j);
    const float* ps = st.data() + s * rp;
    for (int64_t r = 0; r < R; ++r) {
      const Vec p = Set1(ps[r]);
      float* orow = o + r * H;
      for (int64_t j = 0; j < nv; ++j) Store(orow + kLanes * j, Fma(p, vv[j], Load(orow + kLanes * j)));
    }
  }
}

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
  const int64_t pairs = a.kv_heads * a.batch;
  int64_t n = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), pairs));
  std::atomic<int64_t> next(0), pending(n - 1);
  auto work = [&a, &next, pairs] {
    std::vector<float> qt, st;
    for (int64_t i = next.fetch_add(1); i < pairs; i = next.fetch_add(1)) Pair(a, i / a.batch, i % a.batch, qt, st);
  };
  for (int64_t k = 1; k < n; ++k) {
    pool.Schedule([&work, &pending] {
      work();
      pending.fetch_sub(1, std::memory_order_release);
    });
  }
  work();
  while (pending.load(std::memory_order_acquire) > 0) Pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxPagedAttention, PagedAttention,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale").Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
