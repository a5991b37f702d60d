// specjax CPU kernel: attention of a step's few query rows over paged K/V (read in place, no gather copy) and
// the step's own new K/V rows, in one softmax.
//
// XLA:CPU reads a sequence's pages for attention by first gathering them into a contiguous [K, B, S, H] copy
// (a decode step over 512 cached tokens of SmolLM2 copies 24 MB per sequence, per step).  This kernel walks the
// page table instead.  Sequence b's keys are its positions 0 .. L_b + T2 - 1: the first L_b = lengths[b] come
// from the pages, the next T2 are the step's own rows k_new / v_new (not in the pool yet: a forward only reads
// it), and query row t sees every cached position and the new rows visible[b, t, :] allows.  The positions are
// split into chunks of kChunk by their absolute position, each (KV head, sequence, chunk) is a work item (a
// batch-1 step has as many (KV head, sequence) pairs as KV heads, 3 for SmolLM2: too few to share between two
// threads evenly), and the thread finishing a pair's last chunk merges its partial softmaxes in chunk order and
// divides.  A row's arithmetic is the same whether a key is a cached row or a new one, and positions it does not
// see add exact zeros, so a row's result depends only on the keys it sees and their positions: a verification
// row over L cached rows plus the drafts before it is bit-identical to plain decoding's row over L + t cached
// rows, whatever the number of rows or sequences in the call.
//
// Shapes: q [B, T, N, H], k_pool / v_pool [K, P, Z, H], page_table [B, Pg] int32, lengths [B] int32, k_new /
// v_new [B, T2, K, H], visible [B, T, T2] int32; out [B, T, N, H].  H a multiple of 16 up to 256.  AVX-512F or
// AVX2 + FMA (simd.h).  Work items are claimed from the XLA:CPU intra-op thread pool's threads.
#include <algorithm>
#include <atomic>
#include <cmath>
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
  int64_t kv_heads, batch, steps, heads, head_dim, pages, page_size, table_width, new_rows, rows;  // rows = T x G
  float scale;
};

constexpr int64_t kChunk = 256;  // positions per work item: a pair's positions are split into such chunks

// Where the items of one call keep their partial softmaxes until the pair's last chunk merges them.
struct Parts {
  int64_t chunks;                      // chunks per pair: the most any pair has, at least 1
  std::vector<float> o, m, l;          // [pair, chunk, R, H], [pair, chunk, R] x 2
  std::vector<float> qt;               // [pair, H, rp]: each pair's q rows transposed and scaled
  std::vector<std::atomic<int64_t>> left;  // chunks of each pair not finished yet
  std::vector<int64_t> cached;         // [B] cached positions of each sequence (lengths, clamped to its table)
};

// The share of positions [s0, s1) of pair (kh, b) in the softmax of each of its rows: max, sum of p = exp(score -
// max) and sum of p v, into om / mm / lm.  Scores are kept transposed, st[s, r] (rows padded to whole vectors of
// kLanes), so that one vector holds kLanes query rows' scores for one position: a score is sum_h q[r, h] k[s, h]
// accumulated in h order in its own lane, the same arithmetic for every row whatever R is.  A position a row
// does not see scores kMask, so its p is exactly 0 (Exp) and it adds exact zeros to the row's sums.
void Chunk(const Args& a, const Parts& parts, int64_t kh, int64_t b, int64_t s0, int64_t s1, const float* qt,
           std::vector<float>& st, float* om, float* mm, float* lm) {
  const int64_t H = a.head_dim, R = a.rows, Z = a.page_size, nv = H / kLanes, rp = (R + kLanes - 1) / kLanes * kLanes;
  const int64_t n = s1 - s0, cached = parts.cached[b], G = a.heads / a.kv_heads, T2 = a.new_rows;
  std::fill(om, om + R * H, 0.0f);
  st.resize(n * rp);
  const int32_t* table = a.table + b * a.table_width;
  auto row = [&](const float* pool, const float* fresh, int64_t s) {  // position s's K or V row
    if (s >= cached) return fresh + ((b * T2 + s - cached) * a.kv_heads + kh) * H;
    return pool + kh * a.pages * Z * H + (static_cast<int64_t>(table[s / Z]) * Z + s % Z) * H;
  };
  constexpr int kS = 8;  // positions scored together: independent accumulators, one load of q per h
  for (int64_t i0 = 0; i0 < n; i0 += kS) {
    const int64_t cnt = n - i0 < kS ? n - i0 : kS;
    const float* kr[kS];
    for (int64_t i = 0; i < kS; ++i) kr[i] = row(a.k_pool, a.k_new, s0 + i0 + (i < cnt ? i : 0));
    for (int64_t rb = 0; rb < rp; rb += kLanes) {
      Vec acc[kS];
      for (int i = 0; i < kS; ++i) acc[i] = Zero();
      for (int64_t h = 0; h < H; ++h) {
        const Vec qv = Load(qt + h * rp + rb);
        for (int i = 0; i < kS; ++i) acc[i] = Fma(Set1(kr[i][h]), qv, acc[i]);
      }
      for (int64_t i = 0; i < cnt; ++i) Store(st.data() + (i0 + i) * rp + rb, acc[i]);
    }
  }
  const int32_t* vis = a.visible + b * a.steps * T2;
  for (int64_t s = std::max(s0, cached); s < s1; ++s) {  // new rows: hide them from the rows that do not see them
    for (int64_t r = 0; r < R; ++r)
      if (!vis[(r / G) * T2 + s - cached]) st[(s - s0) * rp + r] = kMask;
  }
  for (int64_t rb = 0; rb < rp; rb += kLanes) {  // per row: max, p = exp(score - max) in place, sum of p
    Vec mx = Set1(kMask);
    for (int64_t i = 0; i < n; ++i) mx = Max(mx, Load(st.data() + i * rp + rb));
    Vec sum = Zero();
    for (int64_t i = 0; i < n; ++i) {
      const Vec p = Exp(Sub(Load(st.data() + i * rp + rb), mx));
      Store(st.data() + i * rp + rb, p);
      sum = Add(sum, p);
    }
    float mv[kLanes], lv[kLanes];
    Store(mv, mx);
    Store(lv, sum);
    for (int64_t r = rb; r < rb + kLanes && r < R; ++r) {
      mm[r] = mv[r - rb];
      lm[r] = lv[r - rb];
    }
  }
  for (int64_t i = 0; i < n; ++i) {  // o[r] += p[s, r] v_s in s order: each V row read once
    const float* vr = row(a.v_pool, a.v_new, s0 + i);
    Vec vv[kMaxVec];
    for (int64_t j = 0; j < nv; ++j) vv[j] = Load(vr + kLanes * j);
    const float* ps = st.data() + i * rp;
    for (int64_t r = 0; r < R; ++r) {
      const Vec p = Set1(ps[r]);
      float* orow = om + r * H;
      for (int64_t j = 0; j < nv; ++j) Store(orow + kLanes * j, Fma(p, vv[j], Load(orow + kLanes * j)));
    }
  }
}

// Merge pair (kh, b)'s chunk partials in chunk order, out = o / l with m = max_c m_c, l = sum_c l_c e^(m_c - m),
// o = sum_c o_c e^(m_c - m).  A chunk whose positions a row does not see has m_c = kMask and weighs exactly 0.
// Rows of a pair without positions (no cached rows, no new rows) get 0.
void Merge(const Args& a, const Parts& parts, int64_t pair, int64_t chunks) {
  const int64_t H = a.head_dim, R = a.rows, G = a.heads / a.kv_heads, nv = H / kLanes;
  const int64_t kh = pair / a.batch, b = pair % a.batch;
  const float* om = parts.o.data() + pair * parts.chunks * R * H;
  const float* mm = parts.m.data() + pair * parts.chunks * R;
  const float* lm = parts.l.data() + pair * parts.chunks * R;
  for (int64_t r = 0; r < R; ++r) {
    float* dst = a.out + ((b * a.steps + r / G) * a.heads + kh * G + r % G) * H;
    float mx = kMask;
    for (int64_t c = 0; c < chunks; ++c) mx = std::max(mx, mm[c * R + r]);
    Vec acc[kMaxVec];
    for (int64_t j = 0; j < nv; ++j) acc[j] = Zero();
    float sum = 0.0f;
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

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pool,
                          ffi::Buffer<ffi::F32> v_pool, ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                          ffi::Buffer<ffi::S32> visible, float scale, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k_pool.dimensions(), td = page_table.dimensions(), nd = k_new.dimensions(),
             vd = visible.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 || nd.size() != 4 || vd.size() != 3 || kd[3] != qd[3] ||
      qd[2] % kd[0] != 0 || td[0] != qd[0] || lengths.dimensions().size() != 1 || lengths.dimensions()[0] != qd[0] ||
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
  const int64_t K = kd[0], G = qd[2] / K;
  Args a{q.typed_data(), k_pool.typed_data(), v_pool.typed_data(), k_new.typed_data(), v_new.typed_data(),
         page_table.typed_data(), lengths.typed_data(), visible.typed_data(), out->typed_data(),
         K, qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], td[1], nd[1], qd[1] * G, scale};
  const int64_t pairs = a.kv_heads * a.batch, R = a.rows, H = a.head_dim, rp = (R + kLanes - 1) / kLanes * kLanes;
  Parts parts;
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
  parts.qt.assign(pairs * H * rp, 0.0f);  // rows r = (t, g): query t, head kh * G + g; scaled: scores come scaled
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t kh = i / a.batch, b = i % a.batch;
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = a.q + ((b * a.steps + r / G) * a.heads + kh * G + r % G) * H;
      for (int64_t h = 0; h < H; ++h) parts.qt[(i * H + h) * rp + r] = qr[h] * a.scale;
    }
  }
  parts.left = std::vector<std::atomic<int64_t>>(pairs);
  std::vector<int64_t> first(pairs + 1, 0);  // work items: the chunks of pair i are first[i] .. first[i + 1) - 1
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t c = (parts.cached[i % a.batch] + a.new_rows + kChunk - 1) / kChunk;
    parts.left[i].store(c, std::memory_order_relaxed);
    first[i + 1] = first[i] + c;
    if (c == 0) Merge(a, parts, i, 0);  // no positions at all: zeros
  }
  const int64_t items = first[pairs];
  int64_t n = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), items));
  std::atomic<int64_t> next(0), pending(n - 1);
  auto work = [&a, &next, &parts, &first, items, R, H, rp] {
    std::vector<float> st;
    int64_t pair = 0;
    for (int64_t it = next.fetch_add(1); it < items; it = next.fetch_add(1)) {
      while (first[pair + 1] <= it) ++pair;  // items are claimed in increasing order
      const int64_t c = it - first[pair], b = pair % a.batch;
      const int64_t s0 = c * kChunk, s1 = std::min(parts.cached[b] + a.new_rows, s0 + kChunk);
      const int64_t slot = pair * parts.chunks + c;
      Chunk(a, parts, pair / a.batch, b, s0, s1, parts.qt.data() + pair * H * rp, st,
            parts.o.data() + slot * R * H, parts.m.data() + slot * R, parts.l.data() + slot * R);
      if (parts.left[pair].fetch_sub(1, std::memory_order_acq_rel) == 1) {  // the pair's last chunk: merge it
        Merge(a, parts, pair, first[pair + 1] - first[pair]);
      }
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
