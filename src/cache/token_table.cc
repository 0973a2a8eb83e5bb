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
  k_.resize(n);
  v_.resize(n);
  f32_to_f16(k, k_);
  f32_to_f16(v, v_);
  for (const std::vector<uint16_t>* x : {&k_, &v_}) {
    for (size_t i = 0; i < n; ++i) {
      KVQ_CHECK_ARG(std::isfinite(f16_to_f32_ref((*x)[i])), "token table: token ", i / static_cast<size_t>(row()),
                    "'s ", x == &k_ ? "K" : "V", " holds a value not finite in fp16: ",
                    (x == &k_ ? k : v)[i]);
    }
  }
  Sha256 h;
  h.update("kvq token table 1", 17);
  h.u32(static_cast<uint32_t>(vocab));
  h.u32(static_cast<uint32_t>(n_kv_heads));
  h.u32(static_cast<uint32_t>(head_dim));
  h.update(k_.data(), k_.size() * sizeof(uint16_t));
  h.update(v_.data(), v_.size() * sizeof(uint16_t));
  digest_ = h.final();
}

}  // namespace kvq
