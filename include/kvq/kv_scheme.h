// KV-cache schemes (SPEC §6): how each written K or V row is stored, one
// registry, one name each, and a per-layer cache that stores rows in a scheme
// and reads them back.
//
// Row layouts (row_len = n_kv_heads * head_dim values; all little-endian):
//   fp32            row_len * f32
//   fp16 / bf16     row_len * u16 (round to nearest even)
//   int8            f32 scale | row_len * i8     (seed rule on the whole row)
//   int8-head       n_kv_heads * f32 scale | row_len * i8 (seed rule per head)
//   fp8-e4m3        row_len * u8 E4M3FN (seed cast, scale 1, saturating)
//   fp8-e4m3-scaled f32 scale (amax / 448) | row_len * u8 E4M3FN of x / scale
//   fp8-e5m2        row_len * u8 E5M2 (saturating)
//   q8_0 / q4_0     row_len / 32 ggml blocks (see ggml_quants.h)
// A row is its header (the f32 scales, when the scheme has any) followed by
// its payload (codes, or ggml blocks).
//
// The row store's layout (src/rows/row_store.h), per layer and for K and V separately: the headers of all
// positions in one array, then the payload cut into `slices` pieces, one per
// KV head (head-major: one head's codes of consecutive positions are
// contiguous, so attention streams them), except q8_0/q4_0 with head_dim not
// a multiple of 32, whose blocks straddle heads and stay whole rows (1 slice).
//
//   [K headers: max_seq * header_bytes][K slice 0: max_seq * slice_bytes]...
//   [V headers ...][V slice 0 ...]...        (each region 64-byte aligned)
//
// K tiles. The K payload of int8 / int8-head (head_dim % 4 == 0) and of
// q8_0 / q4_0 (head_dim % 32 == 0) is stored in tiles of kKTile = 16
// consecutive positions per head slice instead of rows, so attention computes
// 16 scores per vector (lanes = tokens) with no horizontal sums, and int8 dot
// products (AVX-512 VNNI) read 4 codes per lane. A tile is 16 * slice_bytes
// bytes (the same bytes as 16 rows, rearranged); lane l = position % 16:
//   int8, int8-head  group g = elements [4g, 4g+4): 64 bytes at 64 g, lane l's
//                    4 codes at 64 g + 4 l
//   q8_0             fp16 scale of block b, lane l at 32 b + 2 l; then the
//                    codes as int8 above, from offset 32 * blocks
//   q4_0             scales as q8_0; then unit u = elements [8u, 8u+8): 64 bytes
//                    at 32 * blocks + 64 u, lane l's 4 bytes at + 4 l, byte j
//                    holding element 8u+j in its low nibble and 8u+4+j in its
//                    high nibble (nibble = ggml's code, value = (code - 8) * d)
// V tiles. The V payload of int8 / int8-head (head_dim % 16 == 0) and of
// q8_0 / q4_0 (head_dim % 32 == 0) is stored in tiles of the same 16
// positions, each position's codes spread over 4-position quads, so one
// 4-byte lane holds 4 positions' codes of one element and an int8 dot
// product (vpdpbusd) sums the weighted V of 4 tokens per lane. Lane l of the
// tile is quad r = l / 4, byte k = l % 4:
//   int8, int8-head, q8_0  unit (x, r) = elements [16x, 16x+16) of quad r:
//                    64 bytes at codes + 64 (4x + r); element e's code at
//                    + 4 (e % 16) + k. codes = 0 (int8) or, for q8_0, after
//                    the block scales (as K tiles, 32 bytes per block)
//   q4_0             scales as q8_0; unit (b, r) = block b of quad r: 64 bytes
//                    at 32 * blocks + 64 (4b + r); element 32b + j's nibble
//                    at + 4 (j % 16) + k, low nibble for j < 16, high else
// The codes and scales are exactly the codec row's; only their places differ.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvq/tensor.h"

namespace kvq {
namespace schemes {
struct RowSchemeDef;  // src/schemes/row_scheme.h: the registry
}  // namespace schemes

inline constexpr int kKTile = 16;  // positions per K or V tile (see above)

// Append-only values (format identity).
enum class KvScheme : uint8_t {
  Fp32 = 0,
  Fp16 = 1,
  Bf16 = 2,
  Int8 = 3,
  Int8Head = 4,
  Fp8E4M3 = 5,
  Fp8E4M3Scaled = 6,
  Fp8E5M2 = 7,
  Q8_0 = 8,
  Q4_0 = 9,
};

const std::vector<KvScheme>& all_kv_schemes();
const char* kv_scheme_name(KvScheme s);
// Throws kvq::Error naming `arg` and listing the valid names.
KvScheme parse_kv_scheme(const std::string& name, const char* arg = "kv");
// "all" or a comma-separated list of names (duplicates removed, order kept).
std::vector<KvScheme> parse_kv_scheme_list(const std::string& list, const char* arg = "kv");

// Encodes / decodes one row of a scheme. Construction validates the geometry
// (throws kvq::Error); encode/decode are kernels and never throw.
class KvRowCodec {
 public:
  KvRowCodec(KvScheme scheme, int row_len, int head_dim);

  KvScheme scheme() const { return scheme_; }
  // The scheme's registry definition (src/schemes/row_scheme.h).
  const schemes::RowSchemeDef& def() const { return *def_; }
  int row_len() const { return row_len_; }
  size_t row_bytes() const { return row_bytes_; }
  // Bytes of the row's scales in front of its payload (0: none).
  size_t header_bytes() const { return header_bytes_; }
  // The payload in independent equal pieces: n_kv_heads (one per head), or 1.
  int slices() const { return slices_; }
  size_t slice_bytes() const { return (row_bytes_ - header_bytes_) / static_cast<size_t>(slices_); }
  // Positions per K tile (kKTile) when K is stored in tiles, else 0 (rows).
  int k_tile() const { return k_tile_; }
  // Positions per V tile (kKTile) when V is stored in tiles, else 0 (rows).
  int v_tile() const { return v_tile_; }
  // Bits per stored value, everything counted (codes, scales).
  double bits_per_element() const { return 8.0 * static_cast<double>(row_bytes_) / row_len_; }

  // row: row_len finite floats; dst: row_bytes bytes.
  void encode(const float* row, uint8_t* dst) const;
  // src: row_bytes bytes; out: row_len floats.
  void decode(const uint8_t* src, float* out) const;

 private:
  KvScheme scheme_;
  const schemes::RowSchemeDef* def_ = nullptr;  // the scheme's codec (registry)
  int row_len_;
  int head_dim_;
  size_t row_bytes_;
  size_t header_bytes_ = 0;
  int slices_ = 1;
  int k_tile_ = 0;
  int v_tile_ = 0;
};

// Read-only view of the stored K and V of one layer (the input of the fused
// attention kernel, attention.h), in the row store's layout: token t's header at
// k_header + t * header_bytes; its K payload piece s at
// k + s * slice_stride + t * slice_bytes when k_tile == 0 (rows), else
// lane (tile_first + t) % 16 of the K tile at
// k + s * slice_stride + ((tile_first + t) / 16) * 16 * slice_bytes;
// V the same with v and v_tile.
struct KvRowsView {
  KvScheme scheme = KvScheme::Fp32;
  int n_kv_heads = 0;
  int head_dim = 0;
  const uint8_t* k = nullptr;  // payload of slice 0, token 0
  const uint8_t* v = nullptr;
  size_t slice_bytes = 0;      // payload bytes of one token in one slice
  size_t slice_stride = 0;     // bytes between slices, >= tokens * slice_bytes
  int slices = 1;              // n_kv_heads (head-major) or 1 (whole rows)
  const uint8_t* k_header = nullptr;  // may be null when header_bytes == 0
  const uint8_t* v_header = nullptr;
  size_t header_bytes = 0;
  int64_t tokens = 0;          // positions available
  int k_tile = 0;              // 0: K payload in rows; kKTile: in K tiles
  int v_tile = 0;              // 0: V payload in rows; kKTile: in V tiles
  int tile_first = 0;          // tiles: lane of token 0 in the tile at k (and at v)

  // Assembles token t's codec row (header | payload) of K (which = 0) or
  // V (1) into row[0, row_bytes). No validation (a kernel).
  void gather_row(int which, int64_t t, uint8_t* row) const;
  // The view of tokens [t0, t1) (same layout, shifted). Throws kvq::Error
  // unless 0 <= t0 <= t1 <= tokens.
  KvRowsView subview(int64_t t0, int64_t t1) const;
};


}  // namespace kvq
