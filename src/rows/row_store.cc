// The row store (src/rows/row_store.h): K and V codec rows per layer.
#include "src/rows/row_store.h"

#include <algorithm>
#include <cstring>

#include "kvq/affine.h"
#include "kvq/error.h"
#include "src/rows/row_scheme.h"

namespace kvq {
using schemes::TileCodes;
using schemes::SliceToTile;
namespace {
size_t RoundUp64(size_t n) { return (n + 63) / 64 * 64; }
}  // namespace

namespace {
// n_kv_heads * head_dim, checked before the product is formed (in 64 bits).
int RowLength(int n_kv_heads, int head_dim) {
  KVQ_CHECK_ARG(n_kv_heads > 0 && head_dim > 0 && int64_t{n_kv_heads} * head_dim <= (int64_t{1} << 20),
                "cache: expected n_kv_heads, head_dim >= 1 and n_kv_heads * head_dim <= 2^20, got ", n_kv_heads,
                " x ", head_dim);
  return n_kv_heads * head_dim;
}
}  // namespace

RowKvCache::RowKvCache(KvScheme scheme, int n_layers, int max_seq, int n_kv_heads, int head_dim)
    : codec_(scheme, RowLength(n_kv_heads, head_dim), head_dim),
      n_layers_(n_layers),
      max_seq_(max_seq),
      n_kv_heads_(n_kv_heads),
      head_dim_(head_dim) {
  KVQ_CHECK_ARG(n_layers > 0, "n_layers: expected > 0, got ", n_layers);
  KVQ_CHECK_ARG(max_seq > 0, "max_seq: expected > 0, got ", max_seq);
  KVQ_CHECK_ARG(n_kv_heads > 0, "n_kv_heads: expected > 0, got ", n_kv_heads);
  const size_t seq = static_cast<size_t>(max_seq);
  const size_t tiled_seq = (seq + kKTile - 1) / kKTile * kKTile;  // K and V tiles are whole
  header_region_ = RoundUp64(seq * codec_.header_bytes());
  slice_stride_ = RoundUp64(tiled_seq * codec_.slice_bytes());
  part_bytes_ = header_region_ + static_cast<size_t>(codec_.slices()) * slice_stride_;
  data_ = Tensor({static_cast<int64_t>(2 * static_cast<size_t>(n_layers) * part_bytes_)}, DType::U8);
}

size_t RowKvCache::PartOffset(int layer, int kv) const {
  return (2 * static_cast<size_t>(layer) + static_cast<size_t>(kv)) * part_bytes_;
}

KvRowsView RowKvCache::view(int layer, int64_t tokens) const {
  KVQ_CHECK_ARG(layer >= 0 && layer < n_layers_, "layer: expected 0..", n_layers_ - 1, ", got ", layer);
  KVQ_CHECK_ARG(tokens >= 0 && tokens <= max_seq_, "tokens: expected 0..", max_seq_, ", got ", tokens);
  KvRowsView v;
  v.scheme = scheme();
  v.n_kv_heads = n_kv_heads_;
  v.head_dim = head_dim_;
  v.k_header = data_.data_as<uint8_t>() + PartOffset(layer, 0);
  v.v_header = data_.data_as<uint8_t>() + PartOffset(layer, 1);
  v.header_bytes = codec_.header_bytes();
  v.k = v.k_header + header_region_;
  v.v = v.v_header + header_region_;
  v.slices = codec_.slices();
  v.slice_bytes = codec_.slice_bytes();
  v.slice_stride = slice_stride_;
  v.tokens = tokens;
  v.k_tile = codec_.k_tile();
  v.v_tile = codec_.v_tile();
  return v;
}

void RowKvCache::write(int layer, int pos, std::span<const float> k, std::span<const float> v) {
  KVQ_CHECK_ARG(layer >= 0 && layer < n_layers_, "layer: expected 0..", n_layers_ - 1, ", got ", layer);
  KVQ_CHECK_ARG(pos >= 0 && pos < max_seq_, "pos: expected 0..", max_seq_ - 1, ", got ", pos);
  const size_t n = static_cast<size_t>(codec_.row_len());
  KVQ_CHECK_ARG(k.size() == n && v.size() == n, "k, v: expected rows of ", n, " values, got ", k.size(), " and ",
                v.size());
  const int64_t bk = first_non_finite(k), bv = first_non_finite(v);
  KVQ_CHECK_ARG(bk < 0 && bv < 0, "k, v: expected finite values, found a non-finite value at ",
                bk >= 0 ? "k[" : "v[", bk >= 0 ? bk : bv, "] (layer ", layer, ", pos ", pos, ")");
  thread_local std::vector<uint8_t> rows;
  rows.resize(2 * codec_.row_bytes());
  codec_.encode(k.data(), rows.data());
  codec_.encode(v.data(), rows.data() + codec_.row_bytes());
  write_rows(layer, pos, rows.data(), rows.data() + codec_.row_bytes());
}

void RowKvCache::write_rows(int layer, int pos, const uint8_t* k_row, const uint8_t* v_row) {
  KVQ_CHECK_ARG(layer >= 0 && layer < n_layers_, "layer: expected 0..", n_layers_ - 1, ", got ", layer);
  KVQ_CHECK_ARG(pos >= 0 && pos < max_seq_, "pos: expected 0..", max_seq_ - 1, ", got ", pos);
  // Scatter the codec row's header and its head slices.
  const size_t hb = codec_.header_bytes(), sb = codec_.slice_bytes();
  const TileCodes def_tile = codec_.def().tile;
  for (int kv = 0; kv < 2; ++kv) {
    const uint8_t* row = kv == 0 ? k_row : v_row;
    uint8_t* part = data_.data_as<uint8_t>() + PartOffset(layer, kv);
    if (hb) std::memcpy(part + static_cast<size_t>(pos) * hb, row, hb);
    if (kv == 0 ? codec_.k_tile() : codec_.v_tile()) {
      const size_t tile = static_cast<size_t>(kKTile), p = static_cast<size_t>(pos);
      for (int s = 0; s < codec_.slices(); ++s) {
        SliceToTile(kv, def_tile, static_cast<size_t>(head_dim_), row + hb + static_cast<size_t>(s) * sb,
                    part + header_region_ + static_cast<size_t>(s) * slice_stride_ + p / tile * tile * sb,
                    static_cast<int>(p % tile));
      }
      continue;
    }
    for (int s = 0; s < codec_.slices(); ++s) {
      std::memcpy(part + header_region_ + static_cast<size_t>(s) * slice_stride_ + static_cast<size_t>(pos) * sb,
                  row + hb + static_cast<size_t>(s) * sb, sb);
    }
  }
}

void RowKvCache::read(int layer, int pos, int kv, std::span<float> out) const {
  KVQ_CHECK_ARG(layer >= 0 && layer < n_layers_ && pos >= 0 && pos < max_seq_, "layer/pos: expected 0..",
                n_layers_ - 1, " / 0..", max_seq_ - 1, ", got ", layer, " / ", pos);
  KVQ_CHECK_ARG(out.size() == static_cast<size_t>(codec_.row_len()), "out: expected ", codec_.row_len(), " values");
  thread_local std::vector<uint8_t> row;
  row.resize(codec_.row_bytes());
  view(layer, max_seq_).gather_row(kv, pos, row.data());
  codec_.decode(row.data(), out.data());
}

}  // namespace kvq
