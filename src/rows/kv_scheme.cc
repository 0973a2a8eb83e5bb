#include "kvq/kv_scheme.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <sstream>

#include "kvq/affine.h"
#include "kvq/error.h"
#include "kvq/ggml_quants.h"
#include "src/rows/row_scheme.h"

namespace kvq {
namespace {
using schemes::RowSchemeDef;
using schemes::TileCodes;

size_t RoundUp64(size_t n) { return (n + 63) / 64 * 64; }

// The registry's definition of a valid scheme value.
const RowSchemeDef& Def(KvScheme s) {
  const RowSchemeDef* d = schemes::find_row_scheme(s);
  KVQ_CHECK_ARG(d != nullptr, "scheme: unknown KV scheme value ", static_cast<int>(s));
  return *d;
}

// K and V tiles (layouts in kv_scheme.h): one head slice's payload in codec
// order <-> lane `lane` of its tile. Each element's code has a place in both:
// a byte, or a nibble of one (q4_0); block scales are copied whole. Only the
// tile code format matters here, not the scheme.
constexpr size_t kTileScaleBytes = 2 * kKTile;  // one block's fp16 scales for all lanes
constexpr size_t kTileGroupBytes = 4 * kKTile;  // one 4-byte word per lane

struct CodePlace {
  size_t byte;
  int shift;  // -1: the whole byte; 0 or 4: a nibble
};

size_t BlockBytes(TileCodes t) { return t == TileCodes::kQ8 ? sizeof(ggml::BlockQ8_0) : sizeof(ggml::BlockQ4_0); }

CodePlace SlicePlace(TileCodes t, size_t e) {
  if (!schemes::IsBlockTile(t)) return {e, -1};
  const size_t base = BlockBytes(t) * (e / ggml::kBlock) + 2, j = e % ggml::kBlock;
  if (t == TileCodes::kQ8) return {base + j, -1};
  return {base + j % 16, j < 16 ? 0 : 4};  // ggml: low nibbles = j < 16
}

// which: 0 K tile, 1 V tile.
CodePlace TilePlace(int which, TileCodes t, size_t hd, size_t e, int lane) {
  const size_t codes = schemes::IsBlockTile(t) ? kTileScaleBytes * (hd / ggml::kBlock) : 0;
  const size_t l = static_cast<size_t>(lane);
  if (which == 1) {  // unit (x or b, quad l / 4), byte l % 4 of element e's lane
    const size_t at = codes + 4 * (e % 16) + l % 4, r = l / 4;
    if (t == TileCodes::kQ4) return {at + kTileGroupBytes * (4 * (e / 32) + r), e % 32 < 16 ? 0 : 4};
    return {at + kTileGroupBytes * (4 * (e / 16) + r), -1};
  }
  if (t == TileCodes::kQ4) return {codes + kTileGroupBytes * (e / 8) + 4 * l + e % 4, e % 8 < 4 ? 0 : 4};
  return {codes + kTileGroupBytes * (e / 4) + 4 * l + e % 4, -1};
}

uint8_t GetCode(const uint8_t* p, CodePlace x) { return x.shift < 0 ? p[x.byte] : (p[x.byte] >> x.shift) & 0x0F; }
void PutCode(uint8_t* p, CodePlace x, uint8_t v) {
  p[x.byte] = x.shift < 0 ? v : static_cast<uint8_t>((p[x.byte] & ~(0x0F << x.shift)) | (v << x.shift));
}

void SliceToTile(int which, TileCodes t, size_t hd, const uint8_t* src, uint8_t* tile, int lane) {
  for (size_t b = 0; schemes::IsBlockTile(t) && b < hd / ggml::kBlock; ++b) {
    std::memcpy(tile + kTileScaleBytes * b + 2 * static_cast<size_t>(lane), src + BlockBytes(t) * b, 2);
  }
  for (size_t e = 0; e < hd; ++e) PutCode(tile, TilePlace(which, t, hd, e, lane), GetCode(src, SlicePlace(t, e)));
}

void TileToSlice(int which, TileCodes t, size_t hd, const uint8_t* tile, int lane, uint8_t* dst) {
  for (size_t b = 0; schemes::IsBlockTile(t) && b < hd / ggml::kBlock; ++b) {
    std::memcpy(dst + BlockBytes(t) * b, tile + kTileScaleBytes * b + 2 * static_cast<size_t>(lane), 2);
  }
  for (size_t e = 0; e < hd; ++e) PutCode(dst, SlicePlace(t, e), GetCode(tile, TilePlace(which, t, hd, e, lane)));
}

std::string ValidNames() {
  std::string s;
  for (const RowSchemeDef* d : schemes::row_schemes()) s += (s.empty() ? "" : ", ") + std::string(d->name);
  return s;
}
}  // namespace

const std::vector<KvScheme>& all_kv_schemes() {
  static const std::vector<KvScheme> all = [] {
    std::vector<KvScheme> v;
    for (const RowSchemeDef* d : schemes::row_schemes()) v.push_back(d->id);
    return v;
  }();
  return all;
}

const char* kv_scheme_name(KvScheme s) {
  const RowSchemeDef* d = schemes::find_row_scheme(s);
  return d ? d->name : "unknown";
}

KvScheme parse_kv_scheme(const std::string& name, const char* arg) {
  for (const RowSchemeDef* d : schemes::row_schemes()) {
    if (name == d->name) return d->id;
  }
  Fail(arg, ": unknown KV scheme '", name, "'; expected one of: ", ValidNames());
}

std::vector<KvScheme> parse_kv_scheme_list(const std::string& list, const char* arg) {
  if (list == "all") return all_kv_schemes();
  std::vector<KvScheme> out;
  std::stringstream ss(list);
  std::string item;
  while (std::getline(ss, item, ',')) {
    KVQ_CHECK_ARG(!item.empty(), arg, ": empty scheme name in '", list, "'");
    const KvScheme s = parse_kv_scheme(item, arg);
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  }
  KVQ_CHECK_ARG(!out.empty(), arg, ": expected 'all' or a comma-separated list of: ", ValidNames());
  return out;
}

KvRowCodec::KvRowCodec(KvScheme scheme, int row_len, int head_dim)
    : scheme_(scheme), row_len_(row_len), head_dim_(head_dim) {
  const RowSchemeDef& d = Def(scheme);
  def_ = &d;
  KVQ_CHECK_ARG(row_len > 0, "row_len: expected > 0, got ", row_len);
  KVQ_CHECK_ARG(head_dim > 0 && row_len % head_dim == 0, "head_dim: expected a positive divisor of row_len ",
                row_len, ", got ", head_dim);
  const bool blocks = schemes::IsBlockTile(d.tile);
  KVQ_CHECK_ARG(!blocks || row_len % ggml::kBlock == 0, "row_len: scheme ", d.name,
                " needs a multiple of 32 values per row, got ", row_len);
  const size_t n = static_cast<size_t>(row_len), hd = static_cast<size_t>(head_dim);
  row_bytes_ = d.row_bytes(n, hd);
  header_bytes_ = d.header_bytes(n, hd);
  // Payloads split per head unless a ggml block would straddle two heads.
  slices_ = blocks && head_dim % ggml::kBlock != 0 ? 1 : row_len / head_dim;
  const bool int8 = d.tile == TileCodes::kInt8;
  if ((int8 && head_dim % 4 == 0) || (blocks && head_dim % ggml::kBlock == 0)) k_tile_ = kKTile;
  if ((int8 && head_dim % 16 == 0) || (blocks && head_dim % ggml::kBlock == 0)) v_tile_ = kKTile;
}

void KvRowCodec::encode(const float* row, uint8_t* dst) const {
  def_->encode(row, static_cast<size_t>(row_len_), static_cast<size_t>(head_dim_), dst);
}

void KvRowCodec::decode(const uint8_t* src, float* out) const {
  def_->decode(src, static_cast<size_t>(row_len_), static_cast<size_t>(head_dim_), out);
}

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

KvRowsView KvRowsView::subview(int64_t t0, int64_t t1) const {
  KVQ_CHECK_ARG(t0 >= 0 && t0 <= t1 && t1 <= tokens, "subview: expected 0 <= t0 <= t1 <= ", tokens, ", got [", t0,
                ", ", t1, ")");
  KvRowsView r = *this;
  const size_t at = static_cast<size_t>(t0);
  // Tiled payloads start at the tile holding t0, rows at row t0.
  const size_t lane = static_cast<size_t>(tile_first) + at, tile = static_cast<size_t>(kKTile);
  r.k = k_tile ? k + lane / tile * tile * slice_bytes : k + at * slice_bytes;
  r.v = v_tile ? v + lane / tile * tile * slice_bytes : v + at * slice_bytes;
  r.tile_first = k_tile || v_tile ? static_cast<int>(lane % tile) : 0;
  if (header_bytes) {
    r.k_header = k_header + at * header_bytes;
    r.v_header = v_header + at * header_bytes;
  }
  r.tokens = t1 - t0;
  return r;
}

void KvRowsView::gather_row(int which, int64_t t, uint8_t* row) const {
  const uint8_t* header = (which == 0 ? k_header : v_header) + static_cast<size_t>(t) * header_bytes;
  if (header_bytes) std::memcpy(row, header, header_bytes);
  if (which == 0 ? k_tile : v_tile) {
    const size_t lane = static_cast<size_t>(tile_first + t), tile = static_cast<size_t>(kKTile);
    const uint8_t* t0 = (which == 0 ? k : v) + lane / tile * tile * slice_bytes;
    for (int s = 0; s < slices; ++s) {
      TileToSlice(which, Def(scheme).tile, static_cast<size_t>(head_dim), t0 + static_cast<size_t>(s) * slice_stride,
                  static_cast<int>(lane % tile), row + header_bytes + static_cast<size_t>(s) * slice_bytes);
    }
    return;
  }
  const uint8_t* payload = (which == 0 ? k : v) + static_cast<size_t>(t) * slice_bytes;
  for (int s = 0; s < slices; ++s) {
    std::memcpy(row + header_bytes + static_cast<size_t>(s) * slice_bytes,
                payload + static_cast<size_t>(s) * slice_stride, slice_bytes);
  }
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
