// Internal: the row store behind kvq::KvCache's row family
// (src/cache/row_family.cc): every layer's K and V codec rows in the layout
// kvq::KvRowsView describes (kvq/kv_scheme.h), read by the row kernel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvq/kv_scheme.h"
#include "kvq/tensor.h"

namespace kvq {

// K and V rows of n_layers layers for positions [0, max_seq), stored in one
// scheme and in the layout above: the stored bytes are the only copy
// (attention reads the codes through view()). Memory is allocated once, at
// construction, 64-byte aligned.
class RowKvCache {
 public:
  RowKvCache(KvScheme scheme, int n_layers, int max_seq, int n_kv_heads, int head_dim);

  KvScheme scheme() const { return codec_.scheme(); }
  const KvRowCodec& codec() const { return codec_; }
  int max_seq() const { return max_seq_; }
  int n_layers() const { return n_layers_; }
  int n_kv_heads() const { return n_kv_heads_; }
  int head_dim() const { return head_dim_; }

  // Stores the K and V rows of `layer` at `pos`. Throws kvq::Error on an out
  // of range layer/pos, a wrong row length or a non-finite value.
  void write(int layer, int pos, std::span<const float> k, std::span<const float> v);
  // Places one token's encoded K and V codec rows (header | payload, as
  // KvRowCodec::encode writes them) at `pos`: what write() does after
  // encoding (restoring a saved cache). Throws on a bad layer or pos.
  void write_rows(int layer, int pos, const uint8_t* k_row, const uint8_t* v_row);
  // The first `tokens` stored rows of `layer`.
  KvRowsView view(int layer, int64_t tokens) const;
  // Decode one stored row from its bytes.
  void read_k(int layer, int pos, std::span<float> out) const { read(layer, pos, 0, out); }
  void read_v(int layer, int pos, std::span<float> out) const { read(layer, pos, 1, out); }

  // Exact stored bytes for one token (K and V, all layers) and for `tokens`.
  size_t bytes_per_token() const { return 2 * codec_.row_bytes() * static_cast<size_t>(n_layers_); }
  size_t bytes(int64_t tokens) const { return bytes_per_token() * static_cast<size_t>(tokens); }
  double bits_per_element() const { return codec_.bits_per_element(); }

 private:
  void read(int layer, int pos, int kv, std::span<float> out) const;
  size_t PartOffset(int layer, int kv) const;  // byte offset of (layer, K or V) in data_
  KvRowCodec codec_;
  int n_layers_;
  int max_seq_;
  int n_kv_heads_;
  int head_dim_;
  size_t header_region_ = 0, slice_stride_ = 0, part_bytes_ = 0;
  Tensor data_;  // U8, [layer][K | V][headers | slices], 64-byte aligned
};

}  // namespace kvq
