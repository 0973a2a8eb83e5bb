// The grouped family of kvq::KvCache: grouped scheme names and presets
// (grouped_kv.h) in a GroupedKvCache, a streaming store read at its current
// length. A saved state is GroupedKvCache::save_state; the tables are its
// save_tables.
#include "kvq/error.h"
#include "src/cache/families.h"
#include "src/groups/grouped_cache.h"

namespace kvq::detail {
namespace {

class GroupedBackend final : public KvCacheBackend {
 public:
  explicit GroupedBackend(GroupedKvCache c) : c_(std::move(c)) {}
  std::unique_ptr<KvCacheBackend> copy() const override { return std::make_unique<GroupedBackend>(c_.Copy()); }
  void write(int layer, int pos, std::span<const float> k, std::span<const float> v, int) override {
    c_.write(layer, pos, k, v);
  }
  int64_t written(int layer) const override { return c_.written(layer); }
  void read(int layer, int64_t pos, std::span<float> k, std::span<float> v) const override { c_.read(layer, pos, k, v); }
  void attend(int layer, int64_t T, std::span<const float> q, int n_heads, std::span<float> out,
              const DecodeAttentionOptions& o) const override {
    Check(layer, T);
    c_.attend(layer, q, n_heads, out, o.threads, o.scale);
  }
  void attend_ref(int layer, int64_t T, std::span<const float> q, int n_heads, std::span<float> out,
                  const DecodeAttentionOptions& o) const override {
    Check(layer, T);
    c_.attend_ref(layer, q, n_heads, out, o.scale);
  }
  uint64_t layer_bytes(int layer, int64_t T) const override {
    Check(layer, T);
    return c_.layer_bytes(layer);
  }
  uint64_t allocated_bytes() const override { return c_.allocated_bytes(); }
  bool any_length() const override { return false; }
  // Ranges start after the sinks and, for dynamic groups, the recent window
  // (the tokens a range's end leaves open), and span whole groups.
  KvRangeAlignment range_alignment() const override {
    const GroupedKvScheme& s = c_.scheme();
    return {s.group, s.sinks + (s.calibrated ? 0 : s.recent)};
  }
  float value_limit() const override { return 65504.0f; }
  void save_tables(std::vector<uint8_t>& out) const override { c_.save_tables(out); }
  void save_state(int64_t T, std::vector<uint8_t>& out) const override {
    for (int l = 0; l < c_.n_layers(); ++l) Check(l, T);
    c_.save_state(out);
  }
  void load_state(std::span<const uint8_t> state, int64_t T) override {
    const std::vector<int64_t> lengths(static_cast<size_t>(c_.n_layers()), T);
    c_.load_state(state, lengths);
  }
  void save_range(int64_t from, int64_t to, std::vector<uint8_t>& out) const override {
    for (int l = 0; l < c_.n_layers(); ++l) Check(l, to);
    c_.save_range_state(from, out);
  }
  void load_ranges(std::span<const std::span<const uint8_t>> parts, std::span<const int64_t> ends) override {
    c_.load_range_states(parts, ends);
  }

 private:
  void Check(int layer, int64_t T) const {
    const int64_t w = c_.written(layer);
    KVQ_CHECK_ARG(T == w, "tokens: a grouped cache is read and saved at its current length (", w,
                  " tokens in layer ", layer, "), got ", T);
  }
  GroupedKvCache c_;
};

struct GroupedDescription final : SchemeDescription {
  explicit GroupedDescription(const GroupedKvScheme& s) : scheme(s) {}
  GroupedKvScheme scheme;
};

// The scheme describe_kv_scheme parsed.
const GroupedKvScheme& Parsed(const KvSchemeInfo& info) {
  const auto* d = dynamic_cast<const GroupedDescription*>(info.parsed.get());
  KVQ_ASSERT(d != nullptr);
  return d->scheme;
}

bool Describe(const std::string& name, const char* arg, KvSchemeInfo& info) {
  const std::optional<GroupedKvScheme> found = find_grouped_kv_scheme(name, arg);
  if (!found) return false;
  const GroupedKvScheme& g = *found;
  info.parsed = std::make_shared<GroupedDescription>(g);
  info.name = g.name();
  // A preset prints as the preset, a scheme as itself, even where it is a
  // preset's plain scheme (on a model a preset may hold another).
  info.label = name;
  info.family = "groups";
  info.needs_ranges = g.needs_ranges();
  return true;
}

std::unique_ptr<KvCacheBackend> Make(const KvSchemeInfo& info, const KvCacheGeometry& g, const StaticRanges* ranges) {
  return std::make_unique<GroupedBackend>(GroupedKvCache(Parsed(info), g.n_layers,
                                                         g.max_seq, g.n_kv_heads, g.head_dim, ranges, g.rope));
}

std::unique_ptr<KvCacheBackend> Restore(const KvSchemeInfo& info, const KvCacheGeometry& g,
                                        std::span<const uint8_t> tables) {
  return std::make_unique<GroupedBackend>(GroupedKvCache(Parsed(info), g.n_layers,
                                                         g.max_seq, g.n_kv_heads, g.head_dim, tables, g.rope));
}

void List(std::vector<std::string>& names) {
  for (const auto& [preset, s] : grouped_kv_presets()) names.push_back(preset);
}

std::string Grammar() {
  std::string g = std::string("grouped schemes ") + grouped_kv_grammar() + " (e.g. k4v3g64r16), presets";
  for (const auto& [preset, s] : grouped_kv_presets()) g.append(" ").append(preset);
  return g;
}

// The scheme's count (fallbacks to fp16 only add to it).
double LeastLayerBytes(const KvSchemeInfo& info, const KvCacheGeometry& g, int64_t T) {
  return static_cast<double>(Parsed(info).layer_bytes(T, g.n_kv_heads, g.head_dim));
}

// Records are allocated as groups complete; up front come the tile rotation
// table (cos and sin of every tile start) and each layer's open rings (at
// most a group and its hand-over in fp16).
double CapacityBytes(const KvSchemeInfo& info, const KvCacheGeometry& g) {
  const GroupedKvScheme& s = Parsed(info);
  const double E = static_cast<double>(g.n_kv_heads) * g.head_dim;
  return 4.0 * g.head_dim * (g.max_seq / 16.0 + 1) +
         static_cast<double>(g.n_layers) * 4 * E * (s.sinks + 2.0 * (s.group + s.recent) + 64);
}

}  // namespace

const KvCacheFamily& GroupedFamily() {
  static const KvCacheFamily f = {"groups", Grammar, Describe, Make, Restore, List, LeastLayerBytes, CapacityBytes};
  return f;
}

}  // namespace kvq::detail
