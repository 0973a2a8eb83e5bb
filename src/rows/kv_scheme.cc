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

std::string ValidNames() {
  std::string s;
  for (const RowSchemeDef* d : schemes::row_schemes()) s += (s.empty() ? "" : ", ") + std::string(d->name);
  return s;
}
}  // namespace

void schemes::SliceToTile(int which, TileCodes t, size_t hd, const uint8_t* src, uint8_t* tile, int lane) {
  for (size_t b = 0; schemes::IsBlockTile(t) && b < hd / ggml::kBlock; ++b) {
    std::memcpy(tile + kTileScaleBytes * b + 2 * static_cast<size_t>(lane), src + BlockBytes(t) * b, 2);
  }
  for (size_t e = 0; e < hd; ++e) PutCode(tile, TilePlace(which, t, hd, e, lane), GetCode(src, SlicePlace(t, e)));
}

void schemes::TileToSlice(int which, TileCodes t, size_t hd, const uint8_t* tile, int lane, uint8_t* dst) {
  for (size_t b = 0; schemes::IsBlockTile(t) && b < hd / ggml::kBlock; ++b) {
    std::memcpy(dst + BlockBytes(t) * b, tile + kTileScaleBytes * b + 2 * static_cast<size_t>(lane), 2);
  }
  for (size_t e = 0; e < hd; ++e) PutCode(dst, SlicePlace(t, e), GetCode(tile, TilePlace(which, t, hd, e, lane)));
}

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

}  // namespace kvq
