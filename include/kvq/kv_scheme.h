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
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvq {

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
  int row_len() const { return row_len_; }
  size_t row_bytes() const { return row_bytes_; }
  // Bits per stored value, everything counted (codes, scales).
  double bits_per_element() const { return 8.0 * static_cast<double>(row_bytes_) / row_len_; }

  // row: row_len finite floats; dst: row_bytes bytes.
  void encode(const float* row, uint8_t* dst) const;
  // src: row_bytes bytes; out: row_len floats.
  void decode(const uint8_t* src, float* out) const;

 private:
  KvScheme scheme_;
  int row_len_;
  int head_dim_;
  size_t row_bytes_;
};

// Read-only view of the stored K and V rows of one layer (the input of the
// fused attention kernel, attention.h).
struct KvRowsView {
  KvScheme scheme = KvScheme::Fp32;
  int n_kv_heads = 0;
  int head_dim = 0;
  const uint8_t* k = nullptr;  // K row t starts at k + t * stride
  const uint8_t* v = nullptr;  // V row t starts at v + t * stride
  size_t stride = 0;           // bytes between consecutive rows, >= the row's bytes
  int64_t tokens = 0;          // rows available
};

// K and V rows of n_layers layers for positions [0, max_seq), stored in one
// scheme: the stored bytes are the only copy (attention reads the codes
// through view()). Memory is allocated once, at construction.
class KvCache {
 public:
  KvCache(KvScheme scheme, int n_layers, int max_seq, int n_kv_heads, int head_dim);

  KvScheme scheme() const { return codec_.scheme(); }
  const KvRowCodec& codec() const { return codec_; }
  int max_seq() const { return max_seq_; }

  // Stores the K and V rows of `layer` at `pos`. Throws kvq::Error on an out
  // of range layer/pos, a wrong row length or a non-finite value.
  void write(int layer, int pos, std::span<const float> k, std::span<const float> v);
  // The first `tokens` stored rows of `layer`.
  KvRowsView view(int layer, int64_t tokens) const;
  // Decode one stored row from its bytes.
  void read_k(int layer, int pos, std::span<float> out) const;
  void read_v(int layer, int pos, std::span<float> out) const;

  // Exact stored bytes for one token (K and V, all layers) and for `tokens`.
  size_t bytes_per_token() const { return 2 * codec_.row_bytes() * static_cast<size_t>(n_layers_); }
  size_t bytes(int64_t tokens) const { return bytes_per_token() * static_cast<size_t>(tokens); }
  double bits_per_element() const { return codec_.bits_per_element(); }

 private:
  size_t RowOffset(int layer, int pos, int kv) const;  // byte offset in data_
  KvRowCodec codec_;
  int n_layers_;
  int max_seq_;
  int n_kv_heads_;
  int head_dim_;
  std::vector<uint8_t> data_;  // stored bytes: [layer][pos][K row | V row]
};

}  // namespace kvq
