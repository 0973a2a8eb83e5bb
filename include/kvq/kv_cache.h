// One KV cache for every scheme (SPEC §6, §10): a row scheme (kv_scheme.h),
// a grouped scheme or a preset (grouped_kv.h), picked by name as llama.cpp's
// -ctk picks a cache type. Whether a scheme stores rows or groups is its
// family's business (src/schemes/families.h); callers never branch on it.
//
//   kvq::KvCache cache("kvq-4.5", n_layers, max_seq, n_kv_heads, head_dim, &ranges);
//   cache.write(layer, pos, k_after_rope, v);          // positions in order
//   kvq::decode_attention(q, n_heads, cache, layer, out); // at the layer's length
//   cache.save("prompt.kvqs");                          // kvq::KvCache::load(...)
//
// Saved caches (to_bytes / save) are one container (SPEC §9 framing: magic
// "KVQS", version, payload size, CRC32C of the payload):
//
//   u16  scheme name length, then the canonical name (ASCII)
//   u32  n_layers, n_kv_heads, head_dim
//   RoPE f32 theta, u8 scaling, f32 factor, f32 low_freq_factor,
//        f32 high_freq_factor, u32 original_context
//   u64  tokens (every layer holds this many)
//   u8   flags: 1 = model fingerprint, 2 = token-ids digest; then the 32-byte
//        fields that are present
//   u64  table bytes, then the scheme's calibrated tables as the cache
//        holds them (p8 grids, static ranges, allocated K widths; empty for
//        row schemes)
//   u64  state bytes, then exactly what the cache holds for those tokens
//        (row schemes: each layer's K then V codec rows; grouped schemes:
//        the grouped store's state, src/groups/state_io.cc)
//
// The header is at most 4 KiB; the tables and the state are bytes(tokens).
// A saved cache holds 1..2^30 tokens and no capacity: the restoring caller
// gives its max_seq (KvCacheExpect). Every count is checked against
// the bytes that must hold it before any allocation (and the capacity
// against this machine's memory), every stored value is checked as the scheme allows it (codes
// in range, finite scales and fp16 values, ranges with lo <= hi), and a
// restored cache attends bitwise as the saved one and accepts further writes
// as it would.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvq/attention.h"
#include "kvq/grouped_kv.h"
#include "kvq/kv_scheme.h"
#include "kvq/rope.h"
#include "kvq/token_table.h"

namespace kvq {

namespace detail {
class KvCacheBackend;     // src/cache/families.h
struct SchemeDescription; // src/cache/families.h: a family's parsed form of a name
class ByteWriter;      // src/container.h
}  // namespace detail

// What a scheme name stands for.
struct KvSchemeInfo {
  std::string name;          // canonical: a preset resolves to the scheme it names
  std::string label;         // what to print: the preset's name, else the canonical name
  std::string family;        // "rows" or "groups" (for reports; callers need not look)
  bool needs_ranges = false; // built from calibrated StaticRanges
  // `t0+<scheme>`: layer 0 held as token ids and read through the model's
  // TokenTable (kvq/token_table.h); writes to layer 0 name the token.
  bool token_layer = false;
  // The family's parsed form of the name (opaque): a scheme is parsed once,
  // by describe_kv_scheme, and every later step reads this.
  std::shared_ptr<const detail::SchemeDescription> parsed;
};

// Throws kvq::Error naming `arg` and listing the row schemes, the grouped
// grammar and the presets when the name is unknown. head_dim > 0: a preset
// resolves as it does for heads of that size (grouped_kv_preset; a cache
// resolves its own), its label still the preset's name.
KvSchemeInfo describe_kv_scheme(const std::string& name, const char* arg = "kv", int head_dim = 0);
// The fewest bytes one layer of `tokens` tokens takes in the scheme (its
// calibrated tables included; a grouped scheme's units held in fp16 outside
// their grid add to it once written: KvCache::bytes counts them).
// (A preset as it resolves at head_dim; a t0+ scheme: its inner scheme's,
// which layer 0's token ids take less than.)
double kv_scheme_layer_bytes(const std::string& name, int64_t tokens, int n_kv_heads, int head_dim);
// The scheme a preset stands for in a cache of this geometry (nullopt when
// `name` is no preset). Without a token table: the preset as it resolves
// at head_dim (grouped_kv_preset). With one, layer 0 is held as token ids
// and the name's bits go to the other layers: "t0+" and the first of the
// preset's inner schemes (grouped_kv_preset_token_ladder, in order of preference)
// whose steady-state bits -- the mean over cache lengths max_seq - 127 ..
// max_seq of every stored bit, layer 0's ids included -- are within the
// name's less kPresetBitsMargin (the units a scheme holds outside its
// grid add to its count: up to 0.035 bit measured on heads of 64 without
// `m`, more with it); the last when none is.
inline constexpr double kPresetBitsMargin = 0.04;
std::optional<std::string> resolve_kv_preset(const std::string& name, int n_layers, int max_seq, int n_kv_heads,
                                             int head_dim, const TokenTable* token_table);
// Whether `scheme` (canonical) is something the preset may resolve to at
// heads of head_dim: its plain scheme or "t0+" one of its token ladder's.
bool kv_preset_admits(const std::string& preset, const std::string& scheme, int head_dim);
// Every row scheme, then every preset (what "all" means to kvq eval).
std::vector<std::string> all_kv_scheme_names();

// Optional identities a saved cache carries.
struct KvCacheMeta {
  std::optional<std::array<uint8_t, 32>> model_fingerprint;  // e.g. SHA-256 of the checkpoint and tokenizer
  std::optional<std::array<uint8_t, 32>> tokens_digest;      // e.g. SHA-256 of the token ids
};

// A 32-byte identity as 64 lowercase hex digits.
std::string hex_digest(const std::array<uint8_t, 32>& d);

// See KvCache::range_alignment.
struct KvRangeAlignment {
  int unit = 1;
  int offset = 0;
};

// What a restore must match (each field checked when set); a mismatch is a
// kvq::Error naming the field and both values.
struct KvCacheExpect {
  std::optional<std::string> scheme;  // a name or preset (compared canonically)
  std::optional<int> n_layers, n_kv_heads, head_dim;
  // The restored cache's capacity (>= the saved tokens), as an engine's
  // context sets it; unset, the saved tokens (a full cache).
  std::optional<int> max_seq;
  std::optional<RopeConfig> rope;
  std::optional<std::array<uint8_t, 32>> model_fingerprint;
  // Gives the token table a t0+ cache reads layer 0 through (its digest
  // must be the one the cache was saved with); called only when the saved
  // scheme is a t0+ one (a model's table takes a pass over its vocabulary).
  std::function<std::shared_ptr<const TokenTable>()> token_table;
};

class KvCache {
 public:
  // Throws kvq::Error on an unknown scheme, a bad geometry for it, or a
  // scheme that needs calibrated ranges without them (ranges are copied),
  // or a t0+ scheme without a token table of its geometry (shared, not
  // copied; row and grouped schemes ignore it). A preset given a token
  // table holds layer 0 as ids (resolve_kv_preset); its label stays the
  // preset's name.
  KvCache(const std::string& scheme, int n_layers, int max_seq, int n_kv_heads, int head_dim,
          const StaticRanges* ranges = nullptr, const RopeConfig& rope = {},
          std::shared_ptr<const TokenTable> token_table = nullptr);
  ~KvCache();
  KvCache(KvCache&&) noexcept;
  KvCache& operator=(KvCache&&) noexcept;
  KvCache Copy() const;  // an explicit deep copy

  const KvSchemeInfo& info() const { return info_; }
  const std::string& scheme() const { return info_.name; }
  int n_layers() const { return n_layers_; }
  int max_seq() const { return max_seq_; }
  int n_kv_heads() const { return n_kv_heads_; }
  int head_dim() const { return head_dim_; }
  const RopeConfig& rope() const { return rope_; }
  // The table a t0+ cache reads layer 0 through (null for other schemes).
  const std::shared_ptr<const TokenTable>& token_table() const { return table_; }

  // Stores token `pos` of `layer`: k after RoPE at pos, v (n_kv_heads *
  // head_dim floats each). Positions of a layer are written in order; pos =
  // 0 starts a new sequence (a row scheme also rewrites any earlier
  // position, dropping the ones after it). Throws kvq::Error on a bad
  // layer, position, length or a non-finite value. token: the token's id,
  // which a t0+ cache's layer 0 stores instead of k and v (required there,
  // ignored elsewhere).
  void write(int layer, int pos, std::span<const float> k, std::span<const float> v, int token = -1);
  int64_t written(int layer) const;
  // The length every layer has reached (the least of them).
  int64_t tokens() const;
  // Token pos of `layer` as attention reads it at the layer's length: K
  // after RoPE, V. Throws unless 0 <= pos < written(layer).
  void read(int layer, int64_t pos, std::span<float> k, std::span<float> v) const;

  // Attention of a query at position T - 1 over tokens [0, T) of `layer`,
  // T = opts.length (-1: written(layer)); row schemes read any T <=
  // written, grouped ones their current length. q: n_heads * head_dim
  // floats after RoPE at T - 1; out the same size.
  void attend(int layer, std::span<const float> q, int n_heads, std::span<float> out,
              const DecodeAttentionOptions& opts = {}) const;
  // Reference: every token decoded as attention reads it, softmax in double.
  void attend_ref(int layer, std::span<const float> q, int n_heads, std::span<float> out,
                  const DecodeAttentionOptions& opts = {}) const;

  // Chunked prefill: writes tokens pos0 .. pos0 + n - 1 of `layer` (k, v: n
  // rows of n_kv_heads * head_dim floats, K after RoPE; pos0 = written(layer)
  // or 0) and gives the query of each (q: n rows of n_heads * head_dim,
  // after RoPE) the attention decoding gives it: the query at pos reads
  // tokens [0, pos] as the scheme stores them at length pos + 1 (open group,
  // window and tiers included). out: n rows like q. Row schemes store the
  // block, then attend every query at its causal length (opts.threads
  // across queries); grouped schemes, whose open tokens change form as the
  // cache grows, alternate write and attend. Every value is checked before
  // anything is written: on a kvq::Error the cache is as it was. tokens:
  // the n tokens' ids (a t0+ cache's layer 0 needs them; else may be empty).
  void prefill(int layer, int pos0, std::span<const float> k, std::span<const float> v, std::span<const float> q,
               int n_heads, std::span<float> out, const DecodeAttentionOptions& opts = {},
               std::span<const int> tokens = {});

  // Bytes the cache holds for its first `tokens` tokens of every layer
  // (-1: each layer as written; row schemes any tokens <= written, grouped
  // ones their current length), tables included; bits = 8 bytes / (2
  // tokens E n_layers).
  uint64_t bytes(int64_t tokens = -1) const;
  uint64_t layer_bytes(int layer) const;  // one layer at its length, without the tables
  double bits(int64_t tokens = -1) const;
  // The object's K/V allocations: bytes() plus a bounded constant.
  uint64_t allocated_bytes() const;

  // Whether attend, bytes, to_bytes and range_to_bytes take any length <=
  // written (row schemes) or only the current one (grouped schemes: a
  // streaming store keeps no earlier form of its open tokens).
  bool any_length() const;
  // Attention over tokens [begin, end) of `layer` alone, as a part that
  // merge_attention_parts combines with others (a sink window, a recent
  // window, a far field): schemes with any_length(); others throw
  // kvq::Error. q as for attend (opts.length unused).
  AttentionPart attend_part(int layer, std::span<const float> q, int n_heads, int64_t begin, int64_t end,
                            const DecodeAttentionOptions& opts = {}) const;
  // How token ranges align (the prefix store's chunks): the ranges of a
  // sequence end at offset + a multiple of unit tokens (grouped schemes:
  // unit = G, offset = the sinks and, for dynamic groups, the recent
  // window; row schemes 1 and 0).
  KvRangeAlignment range_alignment() const;

  // Save and restore (layout above). tokens: -1 = tokens(); a row scheme
  // saves any 1 <= tokens <= written by every layer, a grouped one its
  // length (every layer at the same length: a streaming store does not keep
  // what it held at an earlier length).
  std::vector<uint8_t> to_bytes(int64_t tokens = -1, const KvCacheMeta& meta = {}) const;
  static KvCache from_bytes(std::span<const uint8_t> bytes, const KvCacheExpect& expect = {},
                            KvCacheMeta* meta = nullptr);
  // Written to a fresh temporary file beside `path` and renamed: whole or absent.
  void save(const std::string& path, int64_t tokens = -1, const KvCacheMeta& meta = {}) const;
  static KvCache load(const std::string& path, const KvCacheExpect& expect = {}, KvCacheMeta* meta = nullptr);

  // Token ranges: the prefix store's chunks (store/prefix_store.h). A range
  // is one container (magic "KVQR", version 1) whose payload is
  //   the KVQS header's scheme name, geometry and RoPE (above)
  //   u64  begin, u64 end: it holds tokens [begin, end) of a cache of `end`
  //   32 bytes  its id (the store's key: an entry found under another key is
  //        foreign and refused)
  //   32 bytes  SHA-256 of the calibrated tables the cache was built with
  //        (the restoring cache's must match)
  //   u64  state bytes, then the range's state: per layer what a cache of
  //        `end` tokens holds that one of `begin` did not (row schemes: the
  //        K then V rows of the range; grouped schemes (the grouped
  //        store's range state, src/groups/state_io.cc): the new sinks and final
  //        records, then what is still open at `end`).
  // Ranges of one token sequence, saved as the cache reached each end,
  // restore exactly the cache an uninterrupted run has at the last end.
  // range_to_bytes saves [begin, end) (end -1: tokens(); a row scheme any
  // end <= tokens(), a grouped one its length, every layer at it).
  std::vector<uint8_t> range_to_bytes(int64_t begin, int64_t end, const std::array<uint8_t, 32>& id) const;
  // Throws kvq::Error unless `bytes` is an intact range of this cache's
  // scheme, geometry, RoPE and tables holding [begin, end) under `id`.
  void check_range(std::span<const uint8_t> bytes, int64_t begin, int64_t end, const std::array<uint8_t, 32>& id) const;
  // Replaces what the cache holds with tokens [0, ends.back()) from the
  // ranges [0, ends[0]), [ends[0], ends[1]), ... (ids: their keys). Every
  // range is checked as check_range does and its state as a restore checks
  // it; on any error a kvq::Error, and the cache is as it was.
  void restore_ranges(std::span<const std::span<const uint8_t>> chunks, std::span<const int64_t> ends,
                      std::span<const std::array<uint8_t, 32>> ids);
  // The calibrated tables as saved (empty for schemes without any).
  std::vector<uint8_t> tables() const;

 private:
  KvCache() = default;
  void PutHeader(detail::ByteWriter& w) const;
  std::span<const uint8_t> CheckRange(std::span<const uint8_t> bytes, int64_t begin, int64_t end,
                                      const std::array<uint8_t, 32>& id, const std::vector<uint8_t>& tables) const;
  KvSchemeInfo info_;
  int n_layers_ = 0, max_seq_ = 0, n_kv_heads_ = 0, head_dim_ = 0;
  RopeConfig rope_;
  std::shared_ptr<const TokenTable> table_;
  std::unique_ptr<detail::KvCacheBackend> b_;
};

// decode_attention over any cache: the same as cache.attend.
void decode_attention(std::span<const float> q, int n_heads, const KvCache& cache, int layer, std::span<float> out,
                      const DecodeAttentionOptions& opts = {});

}  // namespace kvq
