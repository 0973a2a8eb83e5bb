// One KV cache for every scheme (see kvq/kv_cache.h).
#include "kvq/kv_cache.h"
#include "kvq/targets.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <fstream>
#include <sstream>

#include <omp.h>

#include "kvq/error.h"
#include "kvq/file.h"
#include "kvq/grouped_kv.h"
#include "kvq/sha256.h"
#include "src/io/container.h"
#include "src/cache/families.h"

namespace kvq {

namespace {

constexpr char kMagic[4] = {'K', 'V', 'Q', 'S'};
constexpr uint16_t kVersion = 1;
constexpr size_t kMaxName = 256;
constexpr uint64_t kMaxHeader = 4096;
constexpr int kMaxLayers = 1 << 16;
constexpr uint64_t kMaxRow = uint64_t{1} << 20;  // n_kv_heads * head_dim

// This machine's physical memory in bytes (what a restore may allocate).
double PhysicalMemory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0x1p40;
}

// A byte count held in a double, for a message: its digits when it fits a
// uint64_t (the cast is undefined beyond), else its magnitude.
std::string ByteCount(double b) {
  if (b >= 0 && b < 0x1p63) return std::to_string(static_cast<uint64_t>(b));
  char s[32];
  std::snprintf(s, sizeof s, "%.3g", b);
  return s;
}

const detail::KvCacheFamily& FamilyOf(const KvSchemeInfo& info) {
  for (const detail::KvCacheFamily& f : detail::kv_cache_families()) {
    if (info.family == f.name) return f;
  }
  KVQ_ASSERT(false);
  return detail::kv_cache_families().front();
}


// The fields KVQS and KVQR open with: scheme name, geometry, RoPE.
struct SavedHeader {
  std::string name;
  uint32_t geo[3];  // n_layers, n_kv_heads, head_dim
  RopeConfig rope;
};

SavedHeader GetHeader(detail::ByteReader& r) {
  SavedHeader h;
  const uint16_t name_len = r.get<uint16_t>();
  if (name_len == 0 || name_len > kMaxName) r.corrupt("a scheme name of " + std::to_string(name_len) + " bytes");
  const std::vector<char> name_bytes = r.get_array<char>(name_len);
  h.name.assign(name_bytes.begin(), name_bytes.end());
  for (uint32_t& x : h.geo) x = r.get<uint32_t>();
  for (uint32_t x : h.geo) {
    if (x == 0 || x > (1u << 30)) r.corrupt("a cache dimension of " + std::to_string(x));
  }
  if (h.geo[0] > kMaxLayers || static_cast<uint64_t>(h.geo[1]) * h.geo[2] > kMaxRow) {
    r.corrupt("a geometry of " + std::to_string(h.geo[0]) + " layers x " + std::to_string(h.geo[1]) + " heads x " +
              std::to_string(h.geo[2]) + " (at most " + std::to_string(kMaxLayers) + " layers and " +
              std::to_string(kMaxRow) + " values a row)");
  }
  RopeConfig& rope = h.rope;
  rope.theta = r.get<float>();
  const uint8_t scaling = r.get<uint8_t>();
  if (scaling > 2) r.corrupt("an unknown RoPE scaling " + std::to_string(scaling));
  rope.scaling = static_cast<RopeConfig::Scaling>(scaling);
  rope.factor = r.get<float>();
  rope.low_freq_factor = r.get<float>();
  rope.high_freq_factor = r.get<float>();
  const uint32_t original_context = r.get<uint32_t>();
  if (original_context > (1u << 30)) r.corrupt("a RoPE original context of " + std::to_string(original_context));
  rope.original_context = static_cast<int>(original_context);
  rope.validate("saved KV cache: RoPE");
  if (!(rope.canonical() == rope)) r.corrupt("RoPE fields its scaling does not read, not at their defaults");
  return h;
}

}  // namespace

void KvCache::PutHeader(detail::ByteWriter& w) const {
  w.put<uint16_t>(static_cast<uint16_t>(info_.name.size()));
  w.put_array(std::span<const char>(info_.name.data(), info_.name.size()));
  for (int x : {n_layers_, n_kv_heads_, head_dim_}) w.put<uint32_t>(static_cast<uint32_t>(x));
  w.put<float>(rope_.theta);
  w.put<uint8_t>(static_cast<uint8_t>(rope_.scaling));
  w.put<float>(rope_.factor);
  w.put<float>(rope_.low_freq_factor);
  w.put<float>(rope_.high_freq_factor);
  w.put<uint32_t>(static_cast<uint32_t>(rope_.original_context));
}

std::string hex_digest(const std::array<uint8_t, 32>& d) {
  static const char* x = "0123456789abcdef";
  std::string s;
  for (uint8_t b : d) s.push_back(x[b >> 4]), s.push_back(x[b & 15]);
  return s;
}

KvSchemeInfo describe_kv_scheme(const std::string& name, const char* arg, int head_dim) {
  if (head_dim > 0 && name.rfind("t0+", 0) == 0) {  // the inner scheme as it resolves at this head size
    return detail::token_layer_scheme(describe_kv_scheme(name.substr(3), arg, head_dim), arg);
  }
  if (head_dim > 0) {
    if (const std::optional<GroupedKvScheme> g = grouped_kv_preset(name, head_dim)) {
      KvSchemeInfo info = describe_kv_scheme(g->name(), arg);
      info.label = name;
      return info;
    }
  }
  KvSchemeInfo info;
  for (const detail::KvCacheFamily& f : detail::kv_cache_families()) {
    if (f.describe(name, arg, info)) return info;
  }
  std::string all;
  for (const detail::KvCacheFamily& f : detail::kv_cache_families()) all.append(all.empty() ? "" : "; ").append(f.grammar());
  Fail(arg, ": unknown KV scheme '", name, "'; expected one of: ", all);
}

std::vector<std::string> all_kv_scheme_names() {
  std::vector<std::string> names;
  for (const detail::KvCacheFamily& f : detail::kv_cache_families()) f.list(names);
  return names;
}

double kv_scheme_layer_bytes(const std::string& name, int64_t tokens, int n_kv_heads, int head_dim) {
  const KvSchemeInfo info = describe_kv_scheme(name, "scheme", std::max(head_dim, 1));
  KVQ_CHECK_ARG(tokens >= 0 && tokens <= (int64_t{1} << 40), "tokens: expected 0..2^40, got ", tokens);
  KVQ_CHECK_ARG(n_kv_heads >= 1 && head_dim >= 1 && int64_t{n_kv_heads} * head_dim <= static_cast<int64_t>(kMaxRow),
                "n_kv_heads, head_dim: expected >= 1 with at most 2^20 values a token, got ", n_kv_heads, ", ", head_dim);
  if (info.token_layer) return kv_scheme_layer_bytes(name.substr(3), tokens, n_kv_heads, head_dim);  // layer 0 takes less
  return FamilyOf(info).least_layer_bytes(info, {1, 1, n_kv_heads, head_dim, {}, nullptr}, tokens);
}

std::optional<std::string> resolve_kv_preset(const std::string& name, int n_layers, int max_seq, int n_kv_heads,
                                             int head_dim, const TokenTable* token_table) {
  const std::optional<GroupedKvScheme> plain = grouped_kv_preset(name, head_dim);
  if (!plain) return std::nullopt;
  if (token_table == nullptr || n_layers < 2) return plain->name();
  const std::optional<GroupedKvPresetLadder> ladder = grouped_kv_preset_token_ladder(name, head_dim);
  KVQ_ASSERT(ladder && !ladder->inner.empty());
  // Steady-state bits as kvq eval counts them (the mean over the last 128
  // cache lengths), from the fewest bytes each length takes.
  const int lo = std::max(1, max_seq - 127);
  const double elements = 2.0 * n_kv_heads * head_dim * n_layers;
  const auto bits = [&](const GroupedKvScheme& g) {
    double s = 0;
    for (int T = lo; T <= max_seq; ++T) {
      const double bytes = static_cast<double>(n_layers - 1) * static_cast<double>(g.layer_bytes(T, n_kv_heads, head_dim)) +
                           static_cast<double>(T) * token_table->id_bytes();
      s += 8.0 * bytes / (static_cast<double>(T) * elements);
    }
    return s / (max_seq - lo + 1);
  };
  for (const GroupedKvScheme& g : ladder->inner) {
    if (bits(g) <= ladder->bits - kPresetBitsMargin) return "t0+" + g.name();
  }
  return "t0+" + ladder->inner.back().name();
}

bool kv_preset_admits(const std::string& preset, const std::string& scheme, int head_dim) {
  const std::optional<GroupedKvScheme> plain = grouped_kv_preset(preset, head_dim);
  if (!plain) return false;
  if (scheme == plain->name()) return true;
  const std::optional<GroupedKvPresetLadder> ladder = grouped_kv_preset_token_ladder(preset, head_dim);
  for (const GroupedKvScheme& g : ladder->inner) {
    if (scheme == "t0+" + g.name()) return true;
  }
  return false;
}

namespace {
// The scheme a cache is made in: a preset given a token table resolves to
// a t0+ scheme, labelled with the preset's name.
KvSchemeInfo DescribeCacheScheme(const std::string& scheme, int n_layers, int max_seq, int n_kv_heads, int head_dim,
                                 const TokenTable* token_table) {
  if (token_table != nullptr && n_layers >= 1 && max_seq >= 1 && n_kv_heads >= 1 && head_dim >= 1) {
    const std::optional<std::string> r = resolve_kv_preset(scheme, n_layers, max_seq, n_kv_heads, head_dim, token_table);
    if (r && r->rfind("t0+", 0) == 0) {
      KvSchemeInfo info = describe_kv_scheme(*r, "scheme", head_dim);
      info.label = scheme;
      return info;
    }
  }
  return describe_kv_scheme(scheme, "scheme", std::max(head_dim, 1));
}
}  // namespace

KvCache::KvCache(const std::string& scheme, int n_layers, int max_seq, int n_kv_heads, int head_dim,
                 const StaticRanges* ranges, const RopeConfig& rope, std::shared_ptr<const TokenTable> token_table)
    : info_(DescribeCacheScheme(scheme, n_layers, max_seq, n_kv_heads, head_dim, token_table.get())),
      n_layers_(n_layers),
      max_seq_(max_seq),
      n_kv_heads_(n_kv_heads),
      head_dim_(head_dim),
      rope_(rope.canonical()) {
  apply_simd_targets_from_env();
  KVQ_CHECK_ARG(n_layers >= 1 && max_seq >= 1 && n_kv_heads >= 1 && head_dim >= 1, "cache: expected n_layers, ",
                "max_seq, n_kv_heads and head_dim >= 1, got ", n_layers, ", ", max_seq, ", ", n_kv_heads, ", ", head_dim);
  KVQ_CHECK_ARG(static_cast<uint64_t>(n_kv_heads) * static_cast<uint64_t>(head_dim) <= kMaxRow,
                "cache: expected n_kv_heads * head_dim <= 2^20, got ", n_kv_heads, " x ", head_dim);
  rope.validate("rope");
  if (info_.token_layer) table_ = std::move(token_table);
  b_ = FamilyOf(info_).make(info_, {n_layers, max_seq, n_kv_heads, head_dim, rope_, table_}, ranges);
}

KvCache::~KvCache() = default;
KvCache::KvCache(KvCache&&) noexcept = default;
KvCache& KvCache::operator=(KvCache&&) noexcept = default;

KvCache KvCache::Copy() const {
  KvCache c;
  c.info_ = info_;
  c.n_layers_ = n_layers_, c.max_seq_ = max_seq_, c.n_kv_heads_ = n_kv_heads_, c.head_dim_ = head_dim_;
  c.rope_ = rope_;
  c.table_ = table_;
  c.b_ = b_->copy();
  return c;
}

void KvCache::write(int layer, int pos, std::span<const float> k, std::span<const float> v, int token) {
  b_->write(layer, pos, k, v, token);
}
int64_t KvCache::written(int layer) const { return b_->written(layer); }

int64_t KvCache::tokens() const {
  int64_t t = b_->written(0);
  for (int l = 1; l < n_layers_; ++l) t = std::min(t, b_->written(l));
  return t;
}

void KvCache::read(int layer, int64_t pos, std::span<float> k, std::span<float> v) const {
  const size_t E = static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(head_dim_);
  KVQ_CHECK_ARG(k.size() == E && v.size() == E, "k, v: expected ", E, " values each, got ", k.size(), " and ", v.size());
  b_->read(layer, pos, k, v);
}

void KvCache::attend(int layer, std::span<const float> q, int n_heads, std::span<float> out,
                     const DecodeAttentionOptions& opts) const {
  const int64_t T = opts.length < 0 ? b_->written(layer) : opts.length;
  KVQ_CHECK_ARG(T >= 1, "layer ", layer, ": no tokens to attend to");
  b_->attend(layer, T, q, n_heads, out, opts);
}

void KvCache::prefill(int layer, int pos0, std::span<const float> k, std::span<const float> v,
                      std::span<const float> q, int n_heads, std::span<float> out, const DecodeAttentionOptions& opts,
                      std::span<const int> tokens) {
  KVQ_CHECK_ARG(layer >= 0 && layer < n_layers_, "layer: expected 0..", n_layers_ - 1, ", got ", layer);
  const size_t kvw = static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(head_dim_);
  KVQ_CHECK_ARG(n_heads >= n_kv_heads_ && n_heads % n_kv_heads_ == 0, "n_heads: expected a multiple of ", n_kv_heads_,
                ", got ", n_heads);
  const size_t qw = static_cast<size_t>(n_heads) * static_cast<size_t>(head_dim_);
  KVQ_CHECK_ARG(!k.empty() && k.size() % kvw == 0, "k: expected n rows of ", kvw, " floats, got ", k.size());
  const size_t n = k.size() / kvw;
  KVQ_CHECK_ARG(v.size() == k.size(), "v: expected ", k.size(), " floats, got ", v.size());
  KVQ_CHECK_ARG(q.size() == n * qw, "q: expected ", n, " rows of ", qw, " floats, got ", q.size());
  KVQ_CHECK_ARG(out.size() == q.size(), "out: expected ", q.size(), " floats, got ", out.size());
  KVQ_CHECK_ARG(tokens.empty() || tokens.size() == n, "tokens: expected none or ", n, " ids, got ", tokens.size());
  KVQ_CHECK_ARG(!(info_.token_layer && layer == 0) || !tokens.empty(), "tokens: layer 0 of ", info_.label,
                " holds token ids: expected the ", n, " tokens' ids");
  if (info_.token_layer && layer == 0) {
    for (int t : tokens) {
      KVQ_CHECK_ARG(t >= 0 && t < table_->vocab(), "tokens: expected ids 0..", table_->vocab() - 1, ", got ", t);
    }
  }
  const auto id = [&](size_t i) { return tokens.empty() ? -1 : tokens[i]; };
  KVQ_CHECK_ARG(pos0 == 0 || pos0 == b_->written(layer), "pos0: expected 0 or ", b_->written(layer), ", got ", pos0);
  KVQ_CHECK_ARG(static_cast<int64_t>(pos0) + static_cast<int64_t>(n) <= max_seq_, "pos0: tokens ", pos0, "..",
                static_cast<int64_t>(pos0) + static_cast<int64_t>(n) - 1, " exceed the cache size ", max_seq_);
  const float lim = b_->value_limit();
  const std::string within =
      lim < std::numeric_limits<float>::max() ? " within +-" + std::to_string(static_cast<int64_t>(lim)) : "";
  for (const auto& [x, name] : {std::pair{k, "k"}, std::pair{v, "v"}, std::pair{q, "q"}}) {
    for (float f : x) {
      KVQ_CHECK_ARG(std::isfinite(f) && (x.data() == q.data() || std::fabs(f) <= lim), name,
                    ": expected finite values", within, ", got ", f);
    }
  }
  const auto row = [](auto s, size_t i, size_t w) { return s.subspan(i * w, w); };
  DecodeAttentionOptions o = opts;
  if (!b_->any_length()) {  // grouped: queries one after the other; each attend splits its coded groups over opts.threads
    for (size_t i = 0; i < n; ++i) {
      write(layer, pos0 + static_cast<int>(i), row(k, i, kvw), row(v, i, kvw), id(i));
      o.length = pos0 + static_cast<int64_t>(i) + 1;
      attend(layer, row(q, i, qw), n_heads, row(out, i, qw), o);
    }
    return;
  }
  for (size_t i = 0; i < n; ++i) write(layer, pos0 + static_cast<int>(i), row(k, i, kvw), row(v, i, kvw), id(i));
  const int nt = static_cast<int>(std::min<size_t>(n, opts.threads > 0 ? static_cast<size_t>(opts.threads)
                                                                       : static_cast<size_t>(omp_get_max_threads())));
  o.threads = 1;
  o.length = pos0 + 1;  // the first query outside the team: an invalid argument throws here, not in a thread
  b_->attend(layer, o.length, row(q, 0, qw), n_heads, row(out, 0, qw), o);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 8) firstprivate(o)
  for (size_t i = 1; i < n; ++i) {
    o.length = pos0 + static_cast<int64_t>(i) + 1;
    b_->attend(layer, o.length, row(q, i, qw), n_heads, row(out, i, qw), o);
  }
}

void KvCache::attend_ref(int layer, std::span<const float> q, int n_heads, std::span<float> out,
                         const DecodeAttentionOptions& opts) const {
  const int64_t T = opts.length < 0 ? b_->written(layer) : opts.length;
  KVQ_CHECK_ARG(T >= 1, "layer ", layer, ": no tokens to attend to");
  b_->attend_ref(layer, T, q, n_heads, out, opts);
}

uint64_t KvCache::bytes(int64_t tokens) const {
  uint64_t total = 0;
  for (int l = 0; l < n_layers_; ++l) total += b_->layer_bytes(l, tokens < 0 ? b_->written(l) : tokens);
  return total;
}

uint64_t KvCache::layer_bytes(int layer) const { return b_->layer_bytes(layer, b_->written(layer)); }

double KvCache::bits(int64_t tokens) const {
  double T = 0;
  for (int l = 0; l < n_layers_; ++l) T += static_cast<double>(tokens < 0 ? b_->written(l) : tokens);
  const double elements = 2.0 * T * n_kv_heads_ * head_dim_;
  return elements > 0 ? 8.0 * static_cast<double>(bytes(tokens)) / elements : 0.0;
}

uint64_t KvCache::allocated_bytes() const { return b_->allocated_bytes(); }
bool KvCache::any_length() const { return b_->any_length(); }
KvRangeAlignment KvCache::range_alignment() const { return b_->range_alignment(); }

AttentionPart KvCache::attend_part(int layer, std::span<const float> q, int n_heads, int64_t begin, int64_t end,
                                   const DecodeAttentionOptions& opts) const {
  const int64_t w = b_->written(layer);
  KVQ_CHECK_ARG(begin >= 0 && begin < end && end <= w, "tokens: expected 0 <= begin < end <= ", w,
                " (tokens written to layer ", layer, "), got ", begin, " and ", end);
  return b_->attend_part(layer, begin, end, q, n_heads, opts);
}

void decode_attention(std::span<const float> q, int n_heads, const KvCache& cache, int layer, std::span<float> out,
                      const DecodeAttentionOptions& opts) {
  cache.attend(layer, q, n_heads, out, opts);
}

// ---- save and restore --------------------------------------------------------------

std::vector<uint8_t> KvCache::to_bytes(int64_t tokens, const KvCacheMeta& meta) const {
  const int64_t T = tokens < 0 ? this->tokens() : tokens;
  KVQ_CHECK_ARG(T >= 1 && T <= this->tokens(), "tokens: expected 1..", this->tokens(),
                " (the tokens every layer holds), got ", tokens);
  detail::ByteWriter w;
  PutHeader(w);
  w.put<uint64_t>(static_cast<uint64_t>(T));
  w.put<uint8_t>(static_cast<uint8_t>((meta.model_fingerprint ? 1 : 0) | (meta.tokens_digest ? 2 : 0)));
  if (meta.model_fingerprint) w.put_array(std::span<const uint8_t>(*meta.model_fingerprint));
  if (meta.tokens_digest) w.put_array(std::span<const uint8_t>(*meta.tokens_digest));
  std::vector<uint8_t> tables, state;
  b_->save_tables(tables);
  b_->save_state(T, state);
  w.put<uint64_t>(tables.size());
  w.put_array(std::span<const uint8_t>(tables));
  w.put<uint64_t>(state.size());
  w.put_array(std::span<const uint8_t>(state));
  return detail::WrapContainer(kMagic, kVersion, w.bytes());
}

KvCache KvCache::from_bytes(std::span<const uint8_t> bytes, const KvCacheExpect& expect, KvCacheMeta* meta) {
  const char* what = "saved KV cache";
  const std::span<const uint8_t> payload = detail::OpenContainer(bytes, kMagic, kVersion, what);
  detail::ByteReader r(payload, what);
  const SavedHeader hd_ = GetHeader(r);
  const std::string& name = hd_.name;
  const uint32_t* geo = hd_.geo;
  const RopeConfig& rope = hd_.rope;
  const uint64_t T = r.get<uint64_t>();
  if (T == 0 || T > (uint64_t{1} << 30)) r.corrupt(std::to_string(T) + " tokens (expected 1..2^30)");
  const uint8_t flags = r.get<uint8_t>();
  if (flags > 3) r.corrupt("unknown flags " + std::to_string(flags));
  KvCacheMeta m;
  if (flags & 1) {
    std::array<uint8_t, 32> f;
    const std::vector<uint8_t> b = r.get_array<uint8_t>(32);
    std::copy(b.begin(), b.end(), f.begin());
    m.model_fingerprint = f;
  }
  if (flags & 2) {
    std::array<uint8_t, 32> f;
    const std::vector<uint8_t> b = r.get_array<uint8_t>(32);
    std::copy(b.begin(), b.end(), f.begin());
    m.tokens_digest = f;
  }
  if (payload.size() - r.remaining() > kMaxHeader) r.corrupt("a header past 4 KiB");
  const KvSchemeInfo info = describe_kv_scheme(name, "saved KV cache: scheme");
  if (info.name != name) r.corrupt("the scheme name '" + name + "', not in its canonical form '" + info.name + "'");
  const int L = static_cast<int>(geo[0]), H = static_cast<int>(geo[1]), hd = static_cast<int>(geo[2]);
  // What the caller's model must match.
  std::string label = info.label;
  if (expect.scheme) {
    const KvSchemeInfo want = describe_kv_scheme(*expect.scheme, "expected scheme");
    // A preset admits whatever it resolves to at the saved head size.
    const bool preset = kv_preset_admits(*expect.scheme, info.name, hd);
    KVQ_CHECK_ARG(preset || want.name == info.name, "saved KV cache: the scheme is ", info.label, " (", info.name,
                  "), expected ", want.label, " (", want.name, ")");
    if (preset) label = *expect.scheme;
  }
  const auto same = [&](const std::optional<int>& e, int got, const char* field) {
    KVQ_CHECK_ARG(!e || *e == got, "saved KV cache: ", field, " is ", got, ", the model has ", e ? *e : 0);
  };
  same(expect.n_layers, L, "n_layers");
  same(expect.n_kv_heads, H, "n_kv_heads");
  same(expect.head_dim, hd, "head_dim");
  if (expect.rope) {
    KVQ_CHECK_ARG(expect.rope->canonical() == rope, "saved KV cache: RoPE is ", rope.describe(), ", the model's is ",
                  expect.rope->describe());
  }
  if (expect.model_fingerprint) {
    KVQ_CHECK_ARG(m.model_fingerprint, "saved KV cache: no model fingerprint; expected one of ",
                  hex_digest(*expect.model_fingerprint).substr(0, 16), "...");
    KVQ_CHECK_ARG(*m.model_fingerprint == *expect.model_fingerprint, "saved KV cache: model fingerprint ",
                  hex_digest(*m.model_fingerprint).substr(0, 16), "... does not match the model's ",
                  hex_digest(*expect.model_fingerprint).substr(0, 16), "... (saved with another model)");
  }
  // The capacity is the caller's, as an engine's context is; unset, the
  // tokens held (a saved cache is its tokens, not a capacity).
  const int max_seq = expect.max_seq ? *expect.max_seq : static_cast<int>(T);
  KVQ_CHECK_ARG(max_seq >= 1 && static_cast<uint64_t>(max_seq) >= T, "saved KV cache: ", T,
                " tokens do not fit max_seq ", max_seq);
  const detail::KvCacheFamily& family = FamilyOf(info);
  detail::KvCacheGeometry g{L, max_seq, H, hd, rope, nullptr};
  if (info.token_layer && expect.token_table) g.token_table = expect.token_table();
  // Nothing is allocated before the bytes are known to hold T tokens of
  // this geometry, and the capacity fits this machine.
  const double least = static_cast<double>(L) * family.least_layer_bytes(info, g, static_cast<int64_t>(T));
  if (least > static_cast<double>(r.remaining())) {
    r.corrupt(std::to_string(T) + " tokens of " + std::to_string(L) + " x " + std::to_string(H) + " x " +
              std::to_string(hd) + " " + info.name + " (at least " + ByteCount(least) +
              " bytes) in " + std::to_string(r.remaining()) + " bytes");
  }
  const double capacity = family.capacity_bytes(info, g);
  KVQ_CHECK_ARG(capacity <= PhysicalMemory(), "saved KV cache: a capacity of ", max_seq, " positions takes ",
                ByteCount(capacity), " bytes, more than this machine's ", ByteCount(PhysicalMemory()),
                " bytes of memory; pass a smaller max_seq");
  const uint64_t table_bytes = r.get<uint64_t>();
  if (table_bytes > r.remaining()) r.corrupt("tables of " + std::to_string(table_bytes) + " bytes past the end");
  const std::vector<uint8_t> tables = r.get_array<uint8_t>(table_bytes);
  const uint64_t state_bytes = r.get<uint64_t>();
  if (state_bytes != r.remaining()) {
    r.corrupt("a state of " + std::to_string(state_bytes) + " bytes where " + std::to_string(r.remaining()) +
              " remain");
  }
  const std::vector<uint8_t> state = r.get_array<uint8_t>(state_bytes);
  r.expect_end();
  KvCache c;
  c.info_ = info;
  c.info_.label = label;
  c.n_layers_ = L, c.max_seq_ = max_seq, c.n_kv_heads_ = H, c.head_dim_ = hd;
  c.rope_ = rope;
  c.table_ = g.token_table;
  c.b_ = family.restore(info, g, tables);
  c.b_->load_state(state, static_cast<int64_t>(T));
  KVQ_CHECK_ARG(c.bytes(static_cast<int64_t>(T)) == table_bytes + state_bytes, "saved KV cache: ",
                table_bytes + state_bytes, " bytes held where the scheme counts ", c.bytes(static_cast<int64_t>(T)));
  if (meta) *meta = m;
  return c;
}

void KvCache::save(const std::string& path, int64_t tokens, const KvCacheMeta& meta) const {
  write_file_whole(path, to_bytes(tokens, meta), "path");
}

KvCache KvCache::load(const std::string& path, const KvCacheExpect& expect, KvCacheMeta* meta) {
  return from_bytes(detail::ReadContainerFile(path, kMagic, kVersion, "saved KV cache", "path"), expect, meta);
}

// ---- token ranges (the prefix store's chunks) ------------------------------------

namespace {
constexpr char kRangeMagic[4] = {'K', 'V', 'Q', 'R'};
constexpr uint16_t kRangeVersion = 1;

Digest TablesDigest(const std::vector<uint8_t>& tables) {
  Sha256 h;
  h.update(tables.data(), tables.size());
  return h.final();
}
}  // namespace

std::vector<uint8_t> KvCache::tables() const {
  std::vector<uint8_t> t;
  b_->save_tables(t);
  return t;
}

std::vector<uint8_t> KvCache::range_to_bytes(int64_t begin, int64_t end, const std::array<uint8_t, 32>& id) const {
  const int64_t T = end < 0 ? tokens() : end;
  KVQ_CHECK_ARG(T >= 1 && T <= tokens(), "end: expected 1..", tokens(), " (the tokens every layer holds), got ", end);
  KVQ_CHECK_ARG(begin >= 0 && begin < T, "begin: expected 0..", T - 1, " (the range ends at ", T, "), got ", begin);
  detail::ByteWriter w;
  PutHeader(w);
  w.put<uint64_t>(static_cast<uint64_t>(begin));
  w.put<uint64_t>(static_cast<uint64_t>(T));
  w.put_array(std::span<const uint8_t>(id));
  const Digest td = TablesDigest(tables());
  w.put_array(std::span<const uint8_t>(td));
  std::vector<uint8_t> state;
  b_->save_range(begin, T, state);
  w.put<uint64_t>(state.size());
  w.put_array(std::span<const uint8_t>(state));
  return detail::WrapContainer(kRangeMagic, kRangeVersion, w.bytes());
}

std::span<const uint8_t> KvCache::CheckRange(std::span<const uint8_t> bytes, int64_t begin, int64_t end,
                                             const std::array<uint8_t, 32>& id,
                                             const std::vector<uint8_t>& tables) const {
  const char* what = "KV cache range";
  const std::span<const uint8_t> payload = detail::OpenContainer(bytes, kRangeMagic, kRangeVersion, what);
  detail::ByteReader r(payload, what);
  const SavedHeader h = GetHeader(r);
  KVQ_CHECK_ARG(h.name == info_.name && static_cast<int>(h.geo[0]) == n_layers_ &&
                    static_cast<int>(h.geo[1]) == n_kv_heads_ && static_cast<int>(h.geo[2]) == head_dim_ &&
                    h.rope == rope_,
                "KV cache range: holds ", h.name, " ", h.geo[0], "x", h.geo[1], "x", h.geo[2], " ", h.rope.describe(),
                ", this cache is ", info_.name, " ", n_layers_, "x", n_kv_heads_, "x", head_dim_, " ", rope_.describe());
  const uint64_t b = r.get<uint64_t>(), e = r.get<uint64_t>();
  std::array<uint8_t, 32> got_id;
  const std::vector<uint8_t> idb = r.get_array<uint8_t>(32);
  std::copy(idb.begin(), idb.end(), got_id.begin());
  KVQ_CHECK_ARG(got_id == id, "KV cache range: its key is ", hex_digest(got_id).substr(0, 16), "..., expected ",
                hex_digest(id).substr(0, 16), "... (an entry stored under another key)");
  KVQ_CHECK_ARG(b == static_cast<uint64_t>(begin) && e == static_cast<uint64_t>(end), "KV cache range: holds tokens [",
                b, ", ", e, "), expected [", begin, ", ", end, ")");
  const std::vector<uint8_t> t = r.get_array<uint8_t>(32);
  const Digest td = TablesDigest(tables);
  KVQ_CHECK_ARG(std::equal(t.begin(), t.end(), td.begin()),
                "KV cache range: saved with calibrated tables other than this cache's");
  const uint64_t state_bytes = r.get<uint64_t>();
  if (state_bytes != r.remaining()) {
    r.corrupt("a state of " + std::to_string(state_bytes) + " bytes where " + std::to_string(r.remaining()) + " remain");
  }
  return payload.subspan(payload.size() - r.remaining());
}

void KvCache::check_range(std::span<const uint8_t> bytes, int64_t begin, int64_t end,
                          const std::array<uint8_t, 32>& id) const {
  (void)CheckRange(bytes, begin, end, id, tables());
}

void KvCache::restore_ranges(std::span<const std::span<const uint8_t>> chunks, std::span<const int64_t> ends,
                             std::span<const std::array<uint8_t, 32>> ids) {
  KVQ_CHECK_ARG(!chunks.empty() && chunks.size() == ends.size() && chunks.size() == ids.size(),
                "chunks: expected as many ends and ids as chunks (>= 1), got ", chunks.size(), ", ", ends.size(), " and ",
                ids.size());
  KVQ_CHECK_ARG(ends.back() <= max_seq_, "chunks: ", ends.back(), " tokens do not fit max_seq ", max_seq_);
  const std::vector<uint8_t> t = tables();
  std::vector<std::span<const uint8_t>> states;
  int64_t begin = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    KVQ_CHECK_ARG(ends[i] > begin, "ends: expected increasing token counts, got ", ends[i], " after ", begin);
    states.push_back(CheckRange(chunks[i], begin, ends[i], ids[i], t));
    begin = ends[i];
  }
  std::unique_ptr<detail::KvCacheBackend> b =
      FamilyOf(info_).restore(info_, {n_layers_, max_seq_, n_kv_heads_, head_dim_, rope_, table_}, t);
  b->load_ranges(states, ends);
  b_ = std::move(b);  // only now: a refused chunk leaves the cache as it was
}

}  // namespace kvq
