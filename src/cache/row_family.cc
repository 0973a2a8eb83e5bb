// The row family of kvq::KvCache: the ten row schemes (kv_scheme.h) in a
// RowKvCache, read by the fused row kernel (attention.h). A saved state is
// every layer's K codec rows, then its V codec rows.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kvq/error.h"
#include "src/cache/families.h"
#include "src/rows/attention_call.h"
#include "src/rows/row_store.h"

namespace kvq::detail {
namespace {

int CheckedHeadDim(int head_dim) {
  KVQ_CHECK_ARG(head_dim > 0 && head_dim % 8 == 0, "head_dim: row schemes need a positive multiple of 8 (the row ",
                "kernel's step), got ", head_dim);
  return head_dim;
}

class RowBackend final : public KvCacheBackend {
 public:
  // The row kernel reads head_dim in 8-wide steps: checked here once, so
  // its views are valid by construction (attn::StoreAttention).
  RowBackend(KvScheme s, const KvCacheGeometry& g)
      : c_(s, g.n_layers, g.max_seq, g.n_kv_heads, CheckedHeadDim(g.head_dim)), T_(static_cast<size_t>(g.n_layers), 0) {}

  std::unique_ptr<KvCacheBackend> copy() const override {
    auto b = std::make_unique<RowBackend>(c_.scheme(), KvCacheGeometry{c_.n_layers(), c_.max_seq(), c_.n_kv_heads(),
                                                                        c_.head_dim(), {}, nullptr});
    std::vector<uint8_t> k(c_.codec().row_bytes()), v(k.size());
    for (int l = 0; l < c_.n_layers(); ++l) {
      const KvRowsView rv = c_.view(l, T_[static_cast<size_t>(l)]);
      for (int64_t t = 0; t < rv.tokens; ++t) {
        rv.gather_row(0, t, k.data());
        rv.gather_row(1, t, v.data());
        b->c_.write_rows(l, static_cast<int>(t), k.data(), v.data());
      }
      b->T_[static_cast<size_t>(l)] = T_[static_cast<size_t>(l)];
    }
    return b;
  }
  void write(int layer, int pos, std::span<const float> k, std::span<const float> v, int) override {
    const int64_t w = written(layer);
    KVQ_CHECK_ARG(pos >= 0 && pos <= w, "pos: a layer is written in order: expected 0..", w,
                  " (a position written before is rewritten, the ones after it dropped), got ", pos);
    c_.write(layer, pos, k, v);
    T_[static_cast<size_t>(layer)] = pos + 1;
  }
  int64_t written(int layer) const override {
    KVQ_CHECK_ARG(layer >= 0 && layer < c_.n_layers(), "layer: expected 0..", c_.n_layers() - 1, ", got ", layer);
    return T_[static_cast<size_t>(layer)];
  }
  void read(int layer, int64_t pos, std::span<float> k, std::span<float> v) const override {
    const int64_t w = written(layer);
    KVQ_CHECK_ARG(pos >= 0 && pos < w, "read: expected 0 <= pos < ", w, " (tokens written), got ", pos);
    c_.read_k(layer, static_cast<int>(pos), k);
    c_.read_v(layer, static_cast<int>(pos), v);
  }
  void attend(int layer, int64_t T, std::span<const float> q, int n_heads, std::span<float> out,
              const DecodeAttentionOptions& o) const override {
    attn::StoreAttention(q, n_heads, rows(layer, T), out, o);
  }
  void attend_ref(int layer, int64_t T, std::span<const float> q, int n_heads, std::span<float> out,
                  const DecodeAttentionOptions& o) const override {
    decode_attention_ref(q, n_heads, rows(layer, T), out, o);
  }
  uint64_t layer_bytes(int layer, int64_t T) const override {
    Check(layer, T);
    return 2 * c_.codec().row_bytes() * static_cast<uint64_t>(T);
  }
  uint64_t allocated_bytes() const override {
    const KvRowsView v = c_.view(0, 0);
    return 2 * static_cast<uint64_t>(c_.n_layers()) * (static_cast<uint64_t>(v.k - v.k_header) +
                                                       static_cast<uint64_t>(v.slices) * v.slice_stride);
  }
  bool any_length() const override { return true; }
  AttentionPart attend_part(int layer, int64_t begin, int64_t end, std::span<const float> q, int n_heads,
                            const DecodeAttentionOptions& o) const override {
    return attn::StoreAttentionPart(q, n_heads, rows(layer, end).subview(begin, end), o);  // range checked by KvCache
  }
  void save_tables(std::vector<uint8_t>&) const override {}
  void save_state(int64_t T, std::vector<uint8_t>& out) const override { save_range(0, T, out); }
  // Every layer's K rows [from, to), then its V rows.
  void save_range(int64_t from, int64_t to, std::vector<uint8_t>& out) const override {
    const size_t rb = c_.codec().row_bytes();
    KVQ_CHECK_ARG(from >= 0 && from <= to, "range: expected 0 <= from <= to, got ", from, " and ", to);
    for (int l = 0; l < c_.n_layers(); ++l) {
      const KvRowsView v = rows(l, to);
      for (int which = 0; which < 2; ++which) {
        for (int64_t t = from; t < to; ++t) {
          const size_t at = out.size();
          out.resize(at + rb);
          v.gather_row(which, t, out.data() + at);
        }
      }
    }
  }
  // The ranges' rows put back in whole-state order, then load_state.
  void load_ranges(std::span<const std::span<const uint8_t>> parts, std::span<const int64_t> ends) override {
    KVQ_CHECK_ARG(!parts.empty() && parts.size() == ends.size(), "ranges: expected as many ends as states (>= 1)");
    const size_t rb = c_.codec().row_bytes(), L = static_cast<size_t>(c_.n_layers());
    int64_t begin = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      KVQ_CHECK_ARG(ends[i] > begin && ends[i] <= c_.max_seq(), "ranges: range ", i, " ends at ", ends[i],
                    ", expected ", begin + 1, "..", c_.max_seq());
      KVQ_CHECK_ARG(parts[i].size() == L * 2 * static_cast<size_t>(ends[i] - begin) * rb, "cache state: range ", i,
                    " holds ", parts[i].size(), " bytes, expected ", L * 2 * static_cast<size_t>(ends[i] - begin) * rb);
      begin = ends[i];
    }
    std::vector<uint8_t> whole;
    whole.reserve(L * 2 * static_cast<size_t>(begin) * rb);
    for (size_t l = 0; l < L; ++l) {
      for (size_t which = 0; which < 2; ++which) {
        int64_t b = 0;
        for (size_t i = 0; i < parts.size(); ++i) {
          const size_t n = static_cast<size_t>(ends[i] - b) * rb;
          const uint8_t* p = parts[i].data() + (l * 2 + which) * n;
          whole.insert(whole.end(), p, p + n);
          b = ends[i];
        }
      }
    }
    load_state(whole, begin);
  }
  void load_state(std::span<const uint8_t> state, int64_t T) override {
    const size_t rb = c_.codec().row_bytes(), L = static_cast<size_t>(c_.n_layers());
    KVQ_CHECK_ARG(T >= 0 && T <= c_.max_seq(), "cache state: ", T, " tokens do not fit max_seq ", c_.max_seq());
    KVQ_CHECK_ARG(state.size() == L * 2 * static_cast<size_t>(T) * rb, "cache state: expected ",
                  L * 2 * static_cast<size_t>(T) * rb, " bytes of rows, got ", state.size());
    std::vector<float> x(static_cast<size_t>(c_.codec().row_len()));
    for (size_t l = 0; l < L; ++l) {
      const uint8_t* k = state.data() + l * 2 * static_cast<size_t>(T) * rb;
      const uint8_t* v = k + static_cast<size_t>(T) * rb;
      for (int64_t t = 0; t < T; ++t) {
        for (const uint8_t* row : {k + static_cast<size_t>(t) * rb, v + static_cast<size_t>(t) * rb}) {
          c_.codec().decode(row, x.data());  // a row the codec cannot have written (NaN, Inf) is refused
          for (float f : x) {
            if (!std::isfinite(f)) Fail("cache state: layer ", l, " token ", t, " decodes to a non-finite value");
          }
        }
        c_.write_rows(static_cast<int>(l), static_cast<int>(t), k + static_cast<size_t>(t) * rb,
                      v + static_cast<size_t>(t) * rb);
      }
      T_[l] = T;
    }
  }

 private:
  KvRowsView rows(int layer, int64_t T) const {
    Check(layer, T);
    return c_.view(layer, T);
  }
  void Check(int layer, int64_t T) const {
    const int64_t w = written(layer);
    KVQ_CHECK_ARG(T >= 0 && T <= w, "tokens: expected 0..", w, " (tokens written to layer ", layer, "), got ", T);
  }
  RowKvCache c_;
  std::vector<int64_t> T_;  // tokens written per layer
};

struct RowDescription final : SchemeDescription {
  explicit RowDescription(KvScheme s) : scheme(s) {}
  KvScheme scheme;
};

bool Describe(const std::string& name, const char* /*arg*/, KvSchemeInfo& info) {
  for (KvScheme s : all_kv_schemes()) {
    if (name == kv_scheme_name(s)) {
      info.parsed = std::make_shared<RowDescription>(s);
      info.name = info.label = name;
      info.family = "rows";
      info.needs_ranges = false;
      return true;
    }
  }
  return false;
}

// The scheme describe_kv_scheme found.
KvScheme Scheme(const KvSchemeInfo& info) {
  const auto* d = dynamic_cast<const RowDescription*>(info.parsed.get());
  KVQ_ASSERT(d != nullptr);
  return d->scheme;
}

std::unique_ptr<KvCacheBackend> Make(const KvSchemeInfo& info, const KvCacheGeometry& g, const StaticRanges*) {
  return std::make_unique<RowBackend>(Scheme(info), g);
}

std::unique_ptr<KvCacheBackend> Restore(const KvSchemeInfo& info, const KvCacheGeometry& g,
                                        std::span<const uint8_t> tables) {
  KVQ_CHECK_ARG(tables.empty(), "cache tables: a row scheme has none, got ", tables.size(), " bytes");
  return Make(info, g, nullptr);
}

void List(std::vector<std::string>& names) {
  for (KvScheme s : all_kv_schemes()) names.emplace_back(kv_scheme_name(s));
}

std::string Grammar() {
  std::string g = "row schemes ";
  for (KvScheme s : all_kv_schemes()) g.append(s == KvScheme::Fp32 ? "" : ", ").append(kv_scheme_name(s));
  return g;
}

// Every token's K and V codec rows, exactly.
double LeastLayerBytes(const KvSchemeInfo& info, const KvCacheGeometry& g, int64_t T) {
  const KvRowCodec codec(Scheme(info), g.n_kv_heads * g.head_dim, g.head_dim);
  return 2.0 * static_cast<double>(codec.row_bytes()) * static_cast<double>(T);
}

// RowKvCache holds every position up to max_seq from the start.
double CapacityBytes(const KvSchemeInfo& info, const KvCacheGeometry& g) {
  return static_cast<double>(g.n_layers) * LeastLayerBytes(info, g, g.max_seq);
}

}  // namespace

const KvCacheFamily& RowFamily() {
  static const KvCacheFamily f = {"rows", Grammar, Describe, Make, Restore, List, LeastLayerBytes, CapacityBytes};
  return f;
}

}  // namespace kvq::detail
