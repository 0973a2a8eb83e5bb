// A model's layer-0 keys and values by token id: what a `t0+` cache reads
// instead of storing layer 0 (kv_cache.h).
//
// In a RoPE transformer, layer 0's key before RoPE and its value are
// functions of the token id alone (the token's embedding, normed, times
// Wk and Wv): a cache can hold layer 0 as token ids and read K and V from
// a table of the model's, exactly (fp16). The table is the model's, shared
// by every cache of it (vocab x 2 x kv_dim fp16: 64 KiB for stories260K,
// 262 MB for Llama-3.2-1B's 128K vocabulary); a saved cache names it by
// its digest and restores only against the same table.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "kvq/tensor.h"

namespace kvq {

class TokenTable {
 public:
  // k, v: vocab rows of n_kv_heads * head_dim floats (K before RoPE),
  // stored as fp16. Throws kvq::Error on a bad geometry, sizes that do not
  // match it, or a value that is not finite in fp16.
  TokenTable(int vocab, int n_kv_heads, int head_dim, std::span<const float> k, std::span<const float> v);
  int vocab() const { return vocab_; }
  int n_kv_heads() const { return n_kv_heads_; }
  int head_dim() const { return head_dim_; }
  int row() const { return n_kv_heads_ * head_dim_; }
  // fp16 rows of token id (no check: callers check 0 <= id < vocab).
  // (Each id's K row and V row lie side by side: one gather reads both.)
  const uint16_t* k(int id) const { return rows_.data_as<uint16_t>() + 2 * static_cast<size_t>(id) * Row(); }
  const uint16_t* v(int id) const { return k(id) + Row(); }
  // SHA-256 of the geometry and the fp16 rows (id by id, K then V): a saved cache's name for
  // the table it was written with.
  const std::array<uint8_t, 32>& digest() const { return digest_; }
  // The table's own bytes (the model's memory, not a cache's).
  uint64_t bytes() const { return rows_.nbytes(); }
  // Bytes a cache takes per token id: 2 when every id fits 16 bits, else 4.
  int id_bytes() const { return vocab_ <= 65536 ? 2 : 4; }

 private:
  size_t Row() const { return static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(head_dim_); }
  int vocab_, n_kv_heads_, head_dim_;
  Tensor rows_;  // (vocab, 2, row) fp16: K then V of each id (huge pages where the kernel offers them)
  std::array<uint8_t, 32> digest_{};
};

}  // namespace kvq
