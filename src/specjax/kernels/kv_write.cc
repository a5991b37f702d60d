// specjax CPU kernel: a step's new K/V rows written into the paged pools in place, every layer in one call.
//
// XLA:CPU writes the rows of a step layer by layer (a dynamic slice, a select and a dynamic update per pool: ~180
// thunks for SmolLM2's 60 pools), ~1 ms of a ~9 ms decode step with the default 1 GiB pool.  This handler takes
// every pool of the step at once and copies each row where its slot says (the pools are aliased to the results, so
// nothing else moves): pool[k, s // Z, s % Z, :] = rows[n, k, :] for every row n with slot s = slots[n] in
// [0, P * Z), for every KV head k; other slots (-1 = padding or beyond capacity) are dropped, as XLA's scatter
// with mode="drop" does (model/attention.py `write_pages`, the oracle).  A slot listed twice keeps its last row.
//
// Shapes: slots [N] int32; then the L pools [K, P, Z, H] and the L rows [N, K, H], pool i taking rows i (same
// dtype); results: the L pools, aliased to the pool operands.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteRows(ffi::Buffer<ffi::S32> slots, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const int64_t layers = static_cast<int64_t>(rets.size()), n = slots.element_count();
  if (static_cast<int64_t>(args.size()) != 2 * layers) {
    return ffi::Error::InvalidArgument("specjax kv write: expected one rows operand per pool");
  }
  const int32_t* slot = slots.typed_data();
  for (int64_t i = 0; i < layers; ++i) {
    auto pool = args.get<ffi::AnyBuffer>(i);
    auto rows = args.get<ffi::AnyBuffer>(layers + i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!pool.has_value() || !rows.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("specjax kv write: operands must be buffers");
    }
    const auto pd = pool->dimensions(), rd = rows->dimensions();
    if (pd.size() != 4 || rd.size() != 3 || rd[0] != n || rd[1] != pd[0] || rd[2] != pd[3] ||
        pool->element_type() != rows->element_type() || (*out)->size_bytes() != pool->size_bytes()) {
      return ffi::Error::InvalidArgument("specjax kv write: pools [K, P, Z, H], rows [N, K, H] of the same dtype");
    }
    const int64_t heads = pd[0], capacity = pd[1] * pd[2], row_bytes = pd[3] * (pool->size_bytes() /
                                                                                 pool->element_count());
    auto* dst = static_cast<uint8_t*>((*out)->untyped_data());
    if (dst != pool->untyped_data()) {  // the caller's input_output_aliases make each result its pool's buffer
      return ffi::Error::InvalidArgument("specjax kv write: each pool must be aliased to its result");
    }
    const auto* src = static_cast<const uint8_t*>(rows->untyped_data());
    for (int64_t r = 0; r < n; ++r) {
      if (slot[r] < 0 || slot[r] >= capacity) continue;
      for (int64_t k = 0; k < heads; ++k) {
        std::memcpy(dst + (k * capacity + slot[r]) * row_bytes, src + (r * heads + k) * row_bytes, row_bytes);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxWriteRows, WriteRows,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().RemainingArgs().RemainingRets());
