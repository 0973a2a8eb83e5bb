// The token-layer family of kvq::KvCache: `t0+<scheme>` holds layer 0 as
// token ids, read through the model's TokenTable (kvq/token_table.h), and
// every other layer in <scheme> (a row scheme, a grouped scheme or a
// preset), whose backend it wraps with one layer fewer.
//
// Layer 0 is exact to fp16 (the table's fp16 K before RoPE, rotated at read, and
// its fp16 V) and costs 2 bytes a token (4 past a 65,536-token
// vocabulary). Attention gathers the layer's K (rotated, rounded to fp16:
// an fp16 cache's numbers) and V as fp16 rows, a block at a time, and runs
// the fp16 row kernel on each (parts merged).
//
// Saved tables: the table's digest (32 bytes), then the inner scheme's.
// Saved state and ranges: the ids of the tokens (little-endian, 2 or 4
// bytes each), then the inner scheme's.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <exception>

#include "kvq/error.h"
#include "kvq/half.h"
#include "kvq/token_table.h"
#include "src/cache/families.h"

namespace kvq::detail {
namespace {

constexpr char kPrefix[] = "t0+";
constexpr size_t kPrefixLen = 3;

struct TokenDescription final : SchemeDescription {
  KvSchemeInfo inner;
};

const KvSchemeInfo& Inner(const KvSchemeInfo& info) {
  const auto* d = dynamic_cast<const TokenDescription*>(info.parsed.get());
  KVQ_ASSERT(d != nullptr);
  return d->inner;
}

const KvCacheFamily& FamilyNamed(const std::string& name) {
  for (const KvCacheFamily& f : kv_cache_families()) {
    if (name == f.name) return f;
  }
  KVQ_ASSERT(false);
  return kv_cache_families().front();
}

KvCacheGeometry InnerGeometry(const KvCacheGeometry& g) {
  KvCacheGeometry i = g;
  i.n_layers = g.n_layers - 1;
  i.token_table = nullptr;
  return i;
}

const TokenTable& CheckedTable(const KvSchemeInfo& info, const KvCacheGeometry& g) {
  KVQ_CHECK_ARG(g.token_table != nullptr, "token_table: the scheme ", info.label,
                " holds layer 0 as token ids and reads K and V from the model's token table; none was given");
  const TokenTable& t = *g.token_table;
  KVQ_CHECK_ARG(t.n_kv_heads() == g.n_kv_heads && t.head_dim() == g.head_dim, "token_table: rows of ",
                t.n_kv_heads(), " x ", t.head_dim(), ", the cache's are ", g.n_kv_heads, " x ", g.head_dim);
  KVQ_CHECK_ARG(g.n_layers >= 2, "n_layers: the scheme ", info.label, " needs at least 2 layers (layer 0 by token, ",
                "the rest in ", Inner(info).label, "), got ", g.n_layers);
  return t;
}

// The layers past 0's share of the calibrated ranges.
std::optional<StaticRanges> WithoutLayer0(const StaticRanges* r) {
  if (r == nullptr) return std::nullopt;
  KVQ_CHECK_ARG(r->n_layers >= 2, "ranges: expected ranges of every layer (>= 2), got ", r->n_layers);
  StaticRanges s = *r;
  s.n_layers = r->n_layers - 1;
  const size_t E = static_cast<size_t>(r->n_kv_heads) * static_cast<size_t>(r->head_dim);
  for (std::vector<float>* x : {&s.k_lo, &s.k_hi, &s.v_lo, &s.v_hi, &s.k_weight}) {
    if (x->size() >= E) x->erase(x->begin(), x->begin() + static_cast<std::ptrdiff_t>(E));
  }
  return s;
}

class TokenBackend final : public KvCacheBackend {
 public:
  TokenBackend(const KvCacheGeometry& g, std::unique_ptr<KvCacheBackend> inner)
      : table_(g.token_table),
        inner_(std::move(inner)),
        rope_(shared_rope_table(g.max_seq, g.head_dim, g.rope)),
        H_(g.n_kv_heads),
        D_(g.head_dim),
        max_seq_(g.max_seq),
        w_(table_->id_bytes()) {}

  std::unique_ptr<KvCacheBackend> copy() const override {
    return std::unique_ptr<TokenBackend>(new TokenBackend(*this, inner_->copy()));
  }
  void write(int layer, int pos, std::span<const float> k, std::span<const float> v, int token) override {
    if (layer != 0) return inner_->write(layer - 1, pos, k, v, token);
    const size_t E = static_cast<size_t>(H_) * static_cast<size_t>(D_);
    KVQ_CHECK_ARG(k.size() == E && v.size() == E, "k, v: expected rows of ", E, " values, got ", k.size(), " and ",
                  v.size());
    KVQ_CHECK_ARG(token >= 0 && token < table_->vocab(), "token: layer 0 of a t0+ cache holds token ids: expected ",
                  "the id of the token written (0..", table_->vocab() - 1, "), got ", token);
    KVQ_CHECK_ARG(pos >= 0 && pos <= n_ && pos < max_seq_, "pos: a layer is written in order: expected 0..",
                  std::min<int64_t>(n_, max_seq_ - 1), ", got ", pos);
    n_ = pos + 1;  // a rewritten position drops the ones after it
    ids_.resize(static_cast<size_t>(n_) * static_cast<size_t>(w_));
    PutId(ids_.data() + static_cast<size_t>(pos) * static_cast<size_t>(w_), static_cast<uint32_t>(token));
  }
  int64_t written(int layer) const override { return layer == 0 ? n_ : inner_->written(layer - 1); }
  void read(int layer, int64_t pos, std::span<float> k, std::span<float> v) const override {
    if (layer != 0) return inner_->read(layer - 1, pos, k, v);
    KVQ_CHECK_ARG(pos >= 0 && pos < n_, "read: expected 0 <= pos < ", n_, " (tokens written), got ", pos);
    Row(pos, k.data(), v.data());
  }
  void attend(int layer, int64_t T, std::span<const float> q, int n_heads, std::span<float> out,
              const DecodeAttentionOptions& o) const override {
    if (layer != 0) return inner_->attend(layer - 1, T, q, n_heads, out, o);
    KVQ_CHECK_ARG(out.size() == q.size(), "out: expected ", q.size(), " floats, got ", out.size());
    const AttentionPart p = Blocked(0, Checked(T), q, n_heads, o);
    std::copy(p.value.begin(), p.value.end(), out.begin());
  }
  void attend_ref(int layer, int64_t T, std::span<const float> q, int n_heads, std::span<float> out,
                  const DecodeAttentionOptions& o) const override {
    if (layer != 0) return inner_->attend_ref(layer - 1, T, q, n_heads, out, o);
    DecodeAttentionOptions f = o;
    f.length = -1;
    decode_attention_ref(q, n_heads, Rows(0, Checked(T)), out, f);
  }
  AttentionPart attend_part(int layer, int64_t begin, int64_t end, std::span<const float> q, int n_heads,
                            const DecodeAttentionOptions& o) const override {
    if (layer != 0) return inner_->attend_part(layer - 1, begin, end, q, n_heads, o);
    return Blocked(begin, Checked(end), q, n_heads, o);
  }
  // Layer 0: the ids and the table's digest (what a saved cache holds of it).
  uint64_t layer_bytes(int layer, int64_t T) const override {
    if (layer != 0) return inner_->layer_bytes(layer - 1, T);
    return static_cast<uint64_t>(Checked(T)) * static_cast<uint64_t>(w_) + 32;
  }
  uint64_t allocated_bytes() const override {
    return ids_.capacity() + 32 + inner_->allocated_bytes();  // the RoPE and token tables are shared
  }
  bool any_length() const override { return inner_->any_length(); }
  KvRangeAlignment range_alignment() const override { return inner_->range_alignment(); }
  float value_limit() const override { return inner_->value_limit(); }
  void save_tables(std::vector<uint8_t>& out) const override {
    out.insert(out.end(), table_->digest().begin(), table_->digest().end());
    inner_->save_tables(out);
  }
  void save_state(int64_t T, std::vector<uint8_t>& out) const override {
    out.insert(out.end(), ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(Checked(T) * w_));
    inner_->save_state(T, out);
  }
  void load_state(std::span<const uint8_t> state, int64_t T) override {
    KVQ_CHECK_ARG(T >= 0 && T <= max_seq_, "cache state: ", T, " tokens do not fit max_seq ", max_seq_);
    const size_t n = static_cast<size_t>(T) * static_cast<size_t>(w_);
    KVQ_CHECK_ARG(state.size() >= n, "cache state: ", state.size(), " bytes cannot hold ", T, " token ids");
    LoadIds(state.first(n), 0);
    inner_->load_state(state.subspan(n), T);
    n_ = T;
  }
  void save_range(int64_t from, int64_t to, std::vector<uint8_t>& out) const override {
    KVQ_CHECK_ARG(from >= 0 && from <= to, "range: expected 0 <= from <= to, got ", from, " and ", to);
    Checked(to);
    out.insert(out.end(), ids_.begin() + static_cast<std::ptrdiff_t>(from * w_),
               ids_.begin() + static_cast<std::ptrdiff_t>(to * w_));
    inner_->save_range(from, to, out);
  }
  void load_ranges(std::span<const std::span<const uint8_t>> parts, std::span<const int64_t> ends) override {
    KVQ_CHECK_ARG(!parts.empty() && parts.size() == ends.size(), "ranges: expected as many ends as states (>= 1)");
    std::vector<std::span<const uint8_t>> inner(parts.size());
    int64_t begin = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      KVQ_CHECK_ARG(ends[i] > begin && ends[i] <= max_seq_, "ranges: range ", i, " ends at ", ends[i], ", expected ",
                    begin + 1, "..", max_seq_);
      const size_t n = static_cast<size_t>(ends[i] - begin) * static_cast<size_t>(w_);
      KVQ_CHECK_ARG(parts[i].size() >= n, "cache state: range ", i, " holds ", parts[i].size(),
                    " bytes, fewer than its ", ends[i] - begin, " token ids");
      LoadIds(parts[i].first(n), begin);
      inner[i] = parts[i].subspan(n);
      begin = ends[i];
    }
    inner_->load_ranges(inner, ends);
    n_ = begin;
  }

 private:
  TokenBackend(const TokenBackend& o, std::unique_ptr<KvCacheBackend> inner)
      : table_(o.table_), inner_(std::move(inner)), rope_(o.rope_), H_(o.H_), D_(o.D_), max_seq_(o.max_seq_),
        w_(o.w_), ids_(o.ids_), n_(o.n_) {}

  int64_t Checked(int64_t T) const {
    KVQ_CHECK_ARG(T >= 0 && T <= n_, "tokens: expected 0..", n_, " (tokens written to layer 0), got ", T);
    return T;
  }
  void PutId(uint8_t* p, uint32_t id) const {
    for (int b = 0; b < w_; ++b) p[b] = static_cast<uint8_t>(id >> (8 * b));
  }
  uint32_t RawId(int64_t t) const {
    const uint8_t* p = ids_.data() + static_cast<size_t>(t) * static_cast<size_t>(w_);
    uint32_t id = 0;
    for (int b = 0; b < w_; ++b) id |= static_cast<uint32_t>(p[b]) << (8 * b);
    return id;
  }
  int Id(int64_t t) const { return static_cast<int>(RawId(t)); }  // checked on write and on load
  // Appends the saved ids of tokens [at, at + bytes / w) to the ones held
  // before `at`, each checked against the table (a refused load leaves a
  // backend its caller discards: restores build a new one).
  void LoadIds(std::span<const uint8_t> bytes, int64_t at) {
    ids_.resize(static_cast<size_t>(at) * static_cast<size_t>(w_));
    ids_.insert(ids_.end(), bytes.begin(), bytes.end());
    for (int64_t t = at; t < at + static_cast<int64_t>(bytes.size() / static_cast<size_t>(w_)); ++t) {
      if (RawId(t) >= static_cast<uint32_t>(table_->vocab())) {
        Fail("cache state: token ", t, " of layer 0 has id ", RawId(t), ", outside the ", table_->vocab(),
             "-token table");
      }
    }
  }
  // Token t of layer 0 as attention reads it, fp16 (an fp16 cache's
  // numbers): the table's K rotated to position t in float32 and rounded,
  // and its V. f: E floats of scratch.
  void Row16(int64_t t, uint16_t* k, uint16_t* v, float* f) const {
    const int id = Id(t);
    const size_t E = static_cast<size_t>(H_) * static_cast<size_t>(D_);
    f16_to_f32({table_->k(id), E}, {f, E});
    rope_->apply(f, H_, static_cast<int>(t));
    f32_to_f16({f, E}, {k, E});
    std::memcpy(v, table_->v(id), E * sizeof(uint16_t));
  }
  void Row(int64_t t, float* k, float* v) const {
    const size_t E = static_cast<size_t>(H_) * static_cast<size_t>(D_);
    std::vector<uint16_t> k16(E), v16(E);
    Row16(t, k16.data(), v16.data(), k);
    f16_to_f32(k16, {k, E});
    f16_to_f32(v16, {v, E});
  }
  // Attention over tokens [begin, end) of layer 0: blocks of rows small
  // enough to stay in this core's cache (about 512 KiB of K and V), each
  // gathered from the table, rotated and attended by the fp16 kernel, the
  // parts merged in block order (the same numbers for any thread count).
  AttentionPart Blocked(int64_t begin, int64_t end, std::span<const float> q, int n_heads,
                        const DecodeAttentionOptions& o) const {
    KVQ_CHECK_ARG(begin < end, "layer 0: no tokens to attend to");
    const size_t E = static_cast<size_t>(H_) * static_cast<size_t>(D_);
    const int64_t block = std::clamp<int64_t>(static_cast<int64_t>((size_t{1} << 17) / E), 16, 256);
    const int64_t n = (end - begin + block - 1) / block;
    std::vector<AttentionPart> parts(static_cast<size_t>(n));
    DecodeAttentionOptions f = o;
    f.length = -1;
    f.threads = 1;
    const int threads = static_cast<int>(std::min<int64_t>(n, o.threads > 0 ? o.threads : omp_get_max_threads()));
    std::exception_ptr err;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < n; ++b) {
      try {
        const int64_t lo = begin + b * block, hi = std::min(end, lo + block);
        parts[static_cast<size_t>(b)] = decode_attention_part(q, n_heads, Rows(lo, hi), f);
      } catch (...) {
#pragma omp critical
        err = std::current_exception();
      }
    }
    if (err) std::rethrow_exception(err);
    return n == 1 ? std::move(parts.front()) : merge_attention_parts(parts);
  }
  // Tokens [begin, end) as fp16 rows (this thread's scratch).
  KvRowsView Rows(int64_t begin, int64_t end) const {
    KVQ_CHECK_ARG(begin < end, "layer 0: no tokens to attend to");
    const size_t E = static_cast<size_t>(H_) * static_cast<size_t>(D_), n = static_cast<size_t>(end - begin);
    thread_local std::vector<uint16_t> k, v;
    thread_local std::vector<float> f;
    if (k.size() < n * E) k.resize(n * E), v.resize(n * E);
    if (f.size() < E) f.resize(E);
    for (size_t i = 0; i < n; ++i) Row16(begin + static_cast<int64_t>(i), k.data() + i * E, v.data() + i * E, f.data());
    KvRowsView rv;
    rv.scheme = KvScheme::Fp16;
    rv.n_kv_heads = H_;
    rv.head_dim = D_;
    rv.k = reinterpret_cast<const uint8_t*>(k.data());
    rv.v = reinterpret_cast<const uint8_t*>(v.data());
    rv.slice_bytes = E * sizeof(uint16_t);
    rv.slice_stride = n * E * sizeof(uint16_t);
    rv.tokens = static_cast<int64_t>(n);
    return rv;
  }

  std::shared_ptr<const TokenTable> table_;
  std::unique_ptr<KvCacheBackend> inner_;
  std::shared_ptr<const RopeTable> rope_;  // shared by every cache of this rotation (rope.h)
  int H_, D_, max_seq_, w_;
  std::vector<uint8_t> ids_;  // layer 0: w_ bytes a token
  int64_t n_ = 0;             // tokens written to layer 0
};

bool Describe(const std::string& name, const char* arg, KvSchemeInfo& info) {
  if (name.rfind(kPrefix, 0) != 0) return false;
  info = token_layer_scheme(describe_kv_scheme(name.substr(kPrefixLen), arg), arg);
  return true;
}

std::unique_ptr<KvCacheBackend> Make(const KvSchemeInfo& info, const KvCacheGeometry& g, const StaticRanges* ranges) {
  CheckedTable(info, g);
  const KvSchemeInfo& in = Inner(info);
  const std::optional<StaticRanges> r = WithoutLayer0(ranges);
  return std::make_unique<TokenBackend>(g, FamilyNamed(in.family).make(in, InnerGeometry(g), r ? &*r : nullptr));
}

std::unique_ptr<KvCacheBackend> Restore(const KvSchemeInfo& info, const KvCacheGeometry& g,
                                        std::span<const uint8_t> tables) {
  const TokenTable& t = CheckedTable(info, g);
  KVQ_CHECK_ARG(tables.size() >= 32, "cache tables: a t0+ cache's begin with its token table's digest; got ",
                tables.size(), " bytes");
  KVQ_CHECK_ARG(std::equal(t.digest().begin(), t.digest().end(), tables.begin()),
                "token_table: the cache was written with another token table (digest ",
                hex_digest(*reinterpret_cast<const std::array<uint8_t, 32>*>(tables.data())).substr(0, 16),
                "...), this one's is ", hex_digest(t.digest()).substr(0, 16),
                "... (another model, or the table computed with other arithmetic)");
  const KvSchemeInfo& in = Inner(info);
  return std::make_unique<TokenBackend>(g, FamilyNamed(in.family).restore(in, InnerGeometry(g), tables.subspan(32)));
}

void List(std::vector<std::string>&) {}  // "all" lists the schemes t0+ wraps

std::string Grammar() { return "t0+<scheme> (layer 0 as token ids through the model's token table)"; }

// Layer 0's ids are 2 bytes a token at the least; a lower bound either way.
double LeastLayerBytes(const KvSchemeInfo& info, const KvCacheGeometry& g, int64_t T) {
  const KvSchemeInfo& in = Inner(info);
  return std::min(2.0 * static_cast<double>(T), FamilyNamed(in.family).least_layer_bytes(in, g, T));
}

double CapacityBytes(const KvSchemeInfo& info, const KvCacheGeometry& g) {
  const KvSchemeInfo& in = Inner(info);
  return FamilyNamed(in.family).capacity_bytes(in, InnerGeometry(g)) +
         4.0 * static_cast<double>(g.max_seq);  // ids
}

}  // namespace

KvSchemeInfo token_layer_scheme(const KvSchemeInfo& inner, const char* arg) {
  KVQ_CHECK_ARG(inner.family != "tokens", arg, ": '", inner.name, "' already holds layer 0 as token ids");
  KvSchemeInfo info;
  info.name = kPrefix + inner.name;
  info.label = kPrefix + inner.label;
  info.family = "tokens";
  info.needs_ranges = inner.needs_ranges;
  info.token_layer = true;
  auto d = std::make_shared<TokenDescription>();
  d->inner = inner;
  info.parsed = std::move(d);
  return info;
}

const KvCacheFamily& TokenFamily() {
  static const KvCacheFamily f = {"tokens", Grammar, Describe, Make, Restore, List, LeastLayerBytes, CapacityBytes};
  return f;
}

}  // namespace kvq::detail
