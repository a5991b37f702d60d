// specjax CPU kernel: a step's new K/V rows written into the paged pools in place, every layer in one call.
//
// XLA:CPU writes the rows of a step layer by layer (a dynamic slice, a select and a dynamic update per pool: ~180
// thunks for SmolLM2's 60 pools), ~1 ms of a ~9 ms decode step with the default 1 GiB pool.  This handler takes
// every pool of the step at once and copies each row where its slot says (the pools are aliased to the results, so
// nothing else moves): pool[k, s // Z, s % Z, :] = rows[n, k, :] for every row n with slot s = slots[n] in
// [0, P * Z), for every KV head k; other slots (-1 = padding or beyond capacity) are dropped, as XLA's scatter
// with mode="drop" does (model/attention.py `write_pages`, the oracle).  A slot listed twice keeps its last row.
//
// Shapes: slots [N] int32; then the pools, each [K, P, Z, H] or every layer's [L, K, P, Z, H], and as many rows
// operands, [N, K, H] or [L, N, K, H], pool i taking rows i (same dtype); results: the pools, aliased to the pool
// operands.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteRows(ffi::Buffer<ffi::S32> slots, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const int64_t pools = static_cast<int64_t>(rets.size()), n = slots.element_count();
  if (static_cast<int64_t>(args.size()) != 2 * pools) {
    return ffi::Error::InvalidArgument("specjax kv write: expected one rows operand per pool");
  }
  const int32_t* slot = slots.typed_data();
  for (int64_t i = 0; i < pools; ++i) {
    auto pool = args.get<ffi::AnyBuffer>(i);
    auto rows = args.get<ffi::AnyBuffer>(pools + i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!pool.has_value() || !rows.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("specjax kv write: operands must be buffers");
    }
    const auto pd = pool->dimensions(), rd = rows->dimensions();
    const size_t lead = pd.size() == 5 ? 1 : 0;  // every layer's pool in one buffer, and every layer's rows
    if (pd.size() != 4 + lead || rd.size() != 3 + lead || (lead && rd[0] != pd[0]) || rd[lead] != n ||
        rd[lead + 1] != pd[lead] || rd[lead + 2] != pd[lead + 3] || pool->element_type() != rows->element_type() ||
        (*out)->size_bytes() != pool->size_bytes()) {
      return ffi::Error::InvalidArgument("specjax kv write: pools [K, P, Z, H] with rows [N, K, H] (or [L, K, P, Z, "
                                         "H] with [L, N, K, H]) of the same dtype");
    }
    const int64_t layers = lead ? pd[0] : 1, heads = pd[lead], capacity = pd[lead + 1] * pd[lead + 2],
                  row_bytes = pd[lead + 3] * (pool->size_bytes() / pool->element_count());
    auto* dst = static_cast<uint8_t*>((*out)->untyped_data());
    if (dst != pool->untyped_data()) {  // the caller's input_output_aliases make each result its pool's buffer
      return ffi::Error::InvalidArgument("specjax kv write: each pool must be aliased to its result");
    }
    const auto* src = static_cast<const uint8_t*>(rows->untyped_data());
    for (int64_t l = 0; l < layers; ++l) {
      uint8_t* layer_dst = dst + l * heads * capacity * row_bytes;
      const uint8_t* layer_src = src + l * n * heads * row_bytes;
      for (int64_t r = 0; r < n; ++r) {
        if (slot[r] < 0 || slot[r] >= capacity) continue;
        for (int64_t k = 0; k < heads; ++k) {
          std::memcpy(layer_dst + (k * capacity + slot[r]) * row_bytes, layer_src + (r * heads + k) * row_bytes,
                      row_bytes);
        }
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxWriteRows, WriteRows,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().RemainingArgs().RemainingRets());
