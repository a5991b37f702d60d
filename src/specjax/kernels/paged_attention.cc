// specjax CPU kernel: attention of a step's few query rows over paged K/V, read in place (no gather copy), and over
// the step's own K/V rows.
//
// XLA:CPU reads a sequence's pages for attention by first gathering them into a contiguous [K, B, S, H] copy
// (a decode step over 512 cached tokens of SmolLM2 copies 24 MB per sequence, per step).  This kernel walks the
// page table instead: for each (KV head, sequence) it scores the query rows against every visible cached row and
// then against the step's own rows (not in the pool yet: model/attention.py), one softmax over both, and
// accumulates the value rows, reading each K and V row once:
//   out[b, t, n, :] = sum_s p_s v_s / sum_s p_s,  p_s = exp(score_s - max score),  score_s = scale q.k_s
// over the cached positions s < lengths[b] and the new rows j with visible[b, t, j] != 0, in that order (query
// head n uses KV head n / (N / K)).  A query row that sees nothing averages the new rows (finite, as the XLA
// path).  Every query row is computed on its own with the same order of operations whatever the number of rows or
// sequences in the call, so a verification row is bit-identical to plain decoding's.
//
// Shapes: q [B, T, N, H], k_pool / v_pool [K, P, Z, H], page_table [B, Pg] int32, lengths [B] int32, k_new / v_new
// [B, T2, K, H], visible [B, T, T2] int32 -> out [B, T, N, H]; H a multiple of 16 up to 256.  AVX-512F or AVX2 +
// FMA (simd.h).  (KV head, sequence) pairs are split over the XLA:CPU intra-op thread pool.
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
  const float *q, *k_pool, *v_pool, *k_new, *v_new;
  const int32_t *table, *lengths, *visible;
  float* out;
  int64_t kv_heads, batch, steps, heads, head_dim, pages, page_size, table_width, new_rows;
  float scale;
};

// One (KV head, sequence) pair: its R = T x G query rows (row r = query t = r / G, head kh * G + r % G).  Scores
// are kept transposed, st[s, r] (rows padded to whole vectors of kLanes), so that one vector holds kLanes query
// rows' scores for one key: a score is sum_h q[r, h] k[s, h] accumulated in h order in its own lane, the same
// arithmetic for every row whatever R is.
void Pair(const Args& a, int64_t kh, int64_t b, std::vector<float>& qt, std::vector<float>& st,
          std::vector<float>& lsum) {
  const int64_t H = a.head_dim, G = a.heads / a.kv_heads, R = a.steps * G, Z = a.page_size, T2 = a.new_rows;
  const int64_t nv = H / kLanes, rp = (R + kLanes - 1) / kLanes * kLanes;
  const int64_t n = std::min<int64_t>(std::max<int32_t>(a.lengths[b], 0), a.table_width * Z), total = n + T2;
  auto qrow = [&](int64_t r) {  // offset of row r of this pair in q and out, [B, T, N, H]
    return ((b * a.steps + r / G) * a.heads + kh * G + r % G) * H;
  };
  const int32_t* table = a.table + b * a.table_width;
  const float* kbase = a.k_pool + kh * a.pages * Z * H;
  const float* vbase = a.v_pool + kh * a.pages * Z * H;
  auto key = [&](const float* pool, const float* fresh, int64_t s) {  // cached position s, then new row s - n
    if (s < n) return pool + (static_cast<int64_t>(table[s / Z]) * Z + s % Z) * H;
    return fresh + ((b * T2 + (s - n)) * a.kv_heads + kh) * H;
  };
  qt.assign(H * rp, 0.0f);  // q transposed, [H, rp], scaled: scores come out scaled
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < H; ++h) qt[h * rp + r] = a.q[qrow(r) + h] * a.scale;
  st.resize(total * rp);
  constexpr int kS = 8;  // keys scored together: independent accumulators, one load of q per h
  for (int64_t s0 = 0; s0 < total; s0 += kS) {
    const int64_t cnt = total - s0 < kS ? total - s0 : kS;
    const float* kr[kS];
    for (int64_t i = 0; i < kS; ++i) kr[i] = key(kbase, a.k_new, s0 + (i < cnt ? i : 0));
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
  const int32_t* vis = a.visible + b * a.steps * T2;
  for (int64_t j = 0; j < T2; ++j)  // new rows a query may not see
    for (int64_t r = 0; r < R; ++r)
      if (!vis[(r / G) * T2 + j]) st[(n + j) * rp + r] = kMask;
  lsum.resize(rp);
  for (int64_t rb = 0; rb < rp; rb += kLanes) {  // per row: max, p = exp(score - max) in place, sum of p
    Vec mx = Set1(kMask);
    for (int64_t s = 0; s < total; ++s) mx = Max(mx, Load(st.data() + s * rp + rb));
    Vec sum = Zero();
    for (int64_t s = 0; s < total; ++s) {
      const Vec p = Exp(Sub(Load(st.data() + s * rp + rb), mx));
      Store(st.data() + s * rp + rb, p);
      sum = Add(sum, p);
    }
    Store(lsum.data() + rb, sum);
  }
  for (int64_t r = 0; r < R; ++r) std::fill(a.out + qrow(r), a.out + qrow(r) + H, 0.0f);
  for (int64_t s = 0; s < total; ++s) {  // out[r] += p[s, r] v_s in s order: each V row read once
    const float* vr = key(vbase, a.v_new, s);
    Vec vv[kMaxVec];
    for (int64_t j = 0; j < nv; ++j) vv[j] = Load(vr + kLanes * j);
    const float* ps = st.data() + s * rp;
    for (int64_t r = 0; r < R; ++r) {
      const Vec p = Set1(ps[r]);
      float* orow = a.out + qrow(r);
      for (int64_t j = 0; j < nv; ++j) Store(orow + kLanes * j, Fma(p, vv[j], Load(orow + kLanes * j)));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const Vec l = Set1(lsum[r]);
    float* orow = a.out + qrow(r);
    for (int64_t j = 0; j < nv; ++j) Store(orow + kLanes * j, Div(Load(orow + kLanes * j), l));
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pool,
                          ffi::Buffer<ffi::F32> v_pool, ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                          ffi::Buffer<ffi::S32> visible, float scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_pool.dimensions(), td = page_table.dimensions(), nd = k_new.dimensions(),
             vd = visible.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || nd.size() != 4 || vd.size() != 3 ||
      kd[3] != qd[3] || qd[2] % kd[0] != 0 || td[0] != qd[0] || lengths.dimensions()[0] != qd[0] ||
      v_pool.dimensions().size() != 4 || !std::equal(kd.begin(), kd.end(), v_pool.dimensions().begin()) ||
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
  Args a{q.typed_data(), k_pool.typed_data(), v_pool.typed_data(), k_new.typed_data(), v_new.typed_data(),
         page_table.typed_data(), lengths.typed_data(), visible.typed_data(), out->typed_data(),
         kd[0], qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], td[1], nd[1], scale};
  const int64_t pairs = a.kv_heads * a.batch;
  int64_t n = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), pairs));
  std::atomic<int64_t> next(0), pending(n - 1);
  auto work = [&a, &next, pairs] {
    std::vector<float> qt, st, lsum;
    for (int64_t i = next.fetch_add(1); i < pairs; i = next.fetch_add(1)) {
      Pair(a, i / a.batch, i % a.batch, qt, st, lsum);
    }
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
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());
