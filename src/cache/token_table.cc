// A model's layer-0 keys and values by token id (see kvq/token_table.h).
#include "kvq/token_table.h"

#include <cmath>

#include "kvq/error.h"
#include "kvq/half.h"
#include "kvq/sha256.h"

namespace kvq {

TokenTable::TokenTable(int vocab, int n_kv_heads, int head_dim, std::span<const float> k, std::span<const float> v)
    : vocab_(vocab), n_kv_heads_(n_kv_heads), head_dim_(head_dim) {
  KVQ_CHECK_ARG(vocab >= 1 && vocab <= (1 << 30) && n_kv_heads >= 1 && head_dim >= 2 && head_dim % 2 == 0 &&
                    int64_t{n_kv_heads} * head_dim <= (int64_t{1} << 20),
                "token table: expected vocab 1..2^30, n_kv_heads >= 1 and an even head_dim with at most 2^20 values ",
                "a row, got ", vocab, ", ", n_kv_heads, ", ", head_dim);
  const size_t n = static_cast<size_t>(vocab) * static_cast<size_t>(row());
  KVQ_CHECK_ARG(k.size() == n && v.size() == n, "token table: expected ", vocab, " rows of ", row(),
                " values for K and V, got ", k.size(), " and ", v.size());
  rows_ = Tensor::Uninitialized({vocab, 2, row()}, DType::F16);
  const size_t r = Row();
  for (size_t id = 0; id < static_cast<size_t>(vocab); ++id) {
    uint16_t* out = rows_.data_as<uint16_t>() + 2 * id * r;
    f32_to_f16(k.subspan(id * r, r), {out, r});
    f32_to_f16(v.subspan(id * r, r), {out + r, r});
    for (size_t i = 0; i < 2 * r; ++i) {
      KVQ_CHECK_ARG(std::isfinite(f16_to_f32_ref(out[i])), "token table: token ", id, "'s ", i < r ? "K" : "V",
                    " holds a value not finite in fp16: ", i < r ? k[id * r + i] : v[id * r + i - r]);
    }
  }
  Sha256 h;
  h.update("kvq token table 2", 17);
  h.u32(static_cast<uint32_t>(vocab));
  h.u32(static_cast<uint32_t>(n_kv_heads));
  h.u32(static_cast<uint32_t>(head_dim));
  h.update(rows_.data(), rows_.nbytes());
  digest_ = h.final();
}

}  // namespace kvq
