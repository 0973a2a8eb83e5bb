// Internal: the KV cache families behind kvq::KvCache (kv_cache.h). A family
// owns a set of scheme names (rows: the ten row schemes; groups: the grouped
// grammar and its presets) and makes the backend that stores them. One
// table lists the families (families.cc); KvCache walks it and never asks
// which family a scheme belongs to.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvq/kv_cache.h"
#include "kvq/token_table.h"

namespace kvq::detail {

// What a family parsed from a scheme name (KvSchemeInfo::parsed); each
// family derives its own.
struct SchemeDescription {
  virtual ~SchemeDescription() = default;
};

struct KvCacheGeometry {
  int n_layers = 0, max_seq = 0, n_kv_heads = 0, head_dim = 0;
  RopeConfig rope;
  std::shared_ptr<const TokenTable> token_table;  // t0+ schemes (token_family.cc); others ignore it
};

// One cache's storage. Lengths: row backends read any T <= written(layer),
// grouped ones their current length (they throw kvq::Error otherwise).
class KvCacheBackend {
 public:
  virtual ~KvCacheBackend() = default;
  virtual std::unique_ptr<KvCacheBackend> copy() const = 0;
  // token: the id of the token written (-1: not given); only a t0+ cache's
  // layer 0 reads it.
  virtual void write(int layer, int pos, std::span<const float> k, std::span<const float> v, int token) = 0;
  virtual int64_t written(int layer) const = 0;
  virtual void read(int layer, int64_t pos, std::span<float> k, std::span<float> v) const = 0;
  virtual void attend(int layer, int64_t T, std::span<const float> q, int n_heads, std::span<float> out,
                      const DecodeAttentionOptions& o) const = 0;
  virtual void attend_ref(int layer, int64_t T, std::span<const float> q, int n_heads, std::span<float> out,
                          const DecodeAttentionOptions& o) const = 0;
  // Bytes of the layer's first T tokens, its share of the tables included.
  virtual uint64_t layer_bytes(int layer, int64_t T) const = 0;
  virtual uint64_t allocated_bytes() const = 0;
  // Whether the backend attends, counts and saves any T <= written(layer)
  // (rows) or only its current length (groups: a streaming store keeps no
  // earlier form of its open tokens).
  virtual bool any_length() const = 0;
  // Attention over tokens [begin, end) as a part (any-length backends; the
  // default is a kvq::Error naming the scheme).
  virtual AttentionPart attend_part(int layer, int64_t begin, int64_t end, std::span<const float> q, int n_heads,
                                    const DecodeAttentionOptions& o) const;
  // How token ranges align (KvCache::range_alignment) and the largest |value|
  // the backend stores (grouped: fp16's 65504).
  virtual KvRangeAlignment range_alignment() const { return {}; }
  virtual float value_limit() const { return std::numeric_limits<float>::max(); }
  // The calibrated tables as held (saved before the state), and the state
  // of every layer's first T tokens; load_state fills a fresh backend made
  // by the family's restore() from those tables.
  virtual void save_tables(std::vector<uint8_t>& out) const = 0;
  virtual void save_state(int64_t T, std::vector<uint8_t>& out) const = 0;
  virtual void load_state(std::span<const uint8_t> state, int64_t T) = 0;
  // A token range [from, to) (the prefix store's chunks; grouped backends
  // only at their current length to), and a fresh backend filled from the
  // ranges [0, ends[0]), [ends[0], ends[1]), ... exactly as load_state would
  // be from the whole state at ends.back().
  virtual void save_range(int64_t from, int64_t to, std::vector<uint8_t>& out) const = 0;
  virtual void load_ranges(std::span<const std::span<const uint8_t>> parts, std::span<const int64_t> ends) = 0;
};

struct KvCacheFamily {
  const char* name;     // "rows", "groups"
  std::string (*grammar)();  // what the family's names look like (unknown-name errors)
  // Fills `info` and returns true when the family owns `name`; a malformed
  // name of the family is a kvq::Error naming `arg`.
  bool (*describe)(const std::string& name, const char* arg, KvSchemeInfo& info);
  std::unique_ptr<KvCacheBackend> (*make)(const KvSchemeInfo& info, const KvCacheGeometry& g,
                                          const StaticRanges* ranges);
  // A fresh backend from saved tables (validated; kvq::Error on any bad value).
  std::unique_ptr<KvCacheBackend> (*restore)(const KvSchemeInfo& info, const KvCacheGeometry& g,
                                             std::span<const uint8_t> tables);
  void (*list)(std::vector<std::string>& names);  // the names "all" stands for
  // What a restore checks before it allocates anything: the fewest bytes
  // (tables and state) one layer of T tokens can take, and what a backend
  // of the geometry allocates up front, whatever it is then written.
  double (*least_layer_bytes)(const KvSchemeInfo& info, const KvCacheGeometry& g, int64_t T);
  double (*capacity_bytes)(const KvSchemeInfo& info, const KvCacheGeometry& g);
};

const std::vector<KvCacheFamily>& kv_cache_families();

// The families, each in its own file.
const KvCacheFamily& RowFamily();      // row_family.cc
const KvCacheFamily& GroupedFamily();  // group_family.cc
const KvCacheFamily& TokenFamily();    // token_family.cc

// `t0+` and the inner scheme's name: layer 0 by token id, the rest in
// `inner` (kvq::Error naming `arg` when inner already is one).
KvSchemeInfo token_layer_scheme(const KvSchemeInfo& inner, const char* arg);

}  // namespace kvq::detail
