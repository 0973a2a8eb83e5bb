#include "store/prefix_store.h"

#include <malloc.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "kvq/error.h"
#include "store/backends.h"

namespace kvq::store {
namespace {

// Where warnings go unless StoreOptions::warn says otherwise.
void StderrWarn(const std::string& s) { std::fprintf(stderr, "kvq prefix store: %s\n", s.c_str()); }

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::string default_store_dir() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg && *xdg) return std::string(xdg) + "/kvq/prefix";
  const char* home = std::getenv("HOME");
  KVQ_CHECK_ARG(home && *home, "prompt cache: no directory given and neither XDG_CACHE_HOME nor HOME is set");
  return std::string(home) + "/.cache/kvq/prefix";
}

std::unique_ptr<StoreBackend> open_backend(const std::string& url, const StoreOptions& o) {
  KVQ_CHECK_ARG(o.chunk_tokens >= 1 && o.chunk_tokens <= (1 << 20), "chunk_tokens: expected 1..2^20, got ",
                o.chunk_tokens);
  KVQ_CHECK_ARG(o.timeout_ms >= 1 && o.timeout_ms <= 60000, "timeout_ms: expected 1..60000, got ", o.timeout_ms);
  KVQ_CHECK_ARG(o.ttl_seconds >= 0, "ttl_seconds: expected >= 0, got ", o.ttl_seconds);
  // Warnings may quote a server's text or a file's bytes: one escaped line each.
  WarnFn warn = [w = o.warn ? o.warn : StderrWarn](const std::string& s) { w(escape_for_message(s)); };
  if (url.rfind("memory:", 0) == 0) return open_memory_store(url.substr(7), o.max_bytes);
  // A URL's scheme is case-insensitive (RFC 3986); nothing after it is
  // echoed, since it may hold a user and password.
  const size_t sep = url.find("://");
  std::string scheme = sep == std::string::npos ? "" : url.substr(0, sep);
  for (char& ch : scheme) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (scheme == "redis") return open_redis_store("redis://" + url.substr(sep + 3), o, warn);
  KVQ_CHECK_ARG(sep == std::string::npos, "prompt cache: unsupported URL scheme '", escape_for_message(scheme),
                "://' (expected a directory, redis://host:port[/db] or memory:; TLS and unix sockets are not ",
                "supported)");
  return open_dir_store(url.empty() ? default_store_dir() : url, o.max_bytes, warn);
}

uint64_t max_chunk_bytes(const KvCache& cache, int64_t end) {
  // fp32, the widest scheme, stores 8 bytes per token, layer and channel
  // (K and V); 10 leaves room for any scheme's scales and fallbacks.
  const uint64_t values = static_cast<uint64_t>(std::max<int64_t>(end, 0)) * static_cast<uint64_t>(cache.n_layers()) *
                          static_cast<uint64_t>(cache.n_kv_heads()) * static_cast<uint64_t>(cache.head_dim());
  return 10 * values + (uint64_t{1} << 20);
}

int chunk_tokens_for(const KvCache& cache, int requested) {
  KVQ_CHECK_ARG(requested >= 1 && requested <= (1 << 20), "chunk_tokens: expected 1..2^20, got ", requested);
  const int unit = cache.range_alignment().unit;
  return (requested + unit - 1) / unit * unit;
}

ChunkPlan chunk_plan(const KvCache& cache, int requested) {
  ChunkPlan p;
  p.tokens = chunk_tokens_for(cache, requested);
  p.offset = cache.range_alignment().offset;
  return p;
}

std::vector<Key> chunk_keys(const KvCache& cache, std::span<const int> tokens, int chunk_tokens,
                            const std::optional<Key>& model) {
  const ChunkPlan plan = chunk_plan(cache, chunk_tokens);
  // Everything the chain starts from, hashed once.
  Sha256 th;
  const std::vector<uint8_t> tables = cache.tables();
  th.update(tables.data(), tables.size());
  const Digest tables_digest = th.final();
  std::vector<uint8_t> head;
  auto put = [&](const void* p, size_t n) {
    head.insert(head.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
  };
  put("kvq-prefix-1", 12);
  const Key zero{};
  put(model ? model->data() : zero.data(), 32);
  const std::string& name = cache.scheme();
  const uint16_t nl = static_cast<uint16_t>(name.size());
  put(&nl, 2);
  put(name.data(), name.size());
  for (int x : {cache.n_layers(), cache.n_kv_heads(), cache.head_dim()}) {
    const uint32_t u = static_cast<uint32_t>(x);
    put(&u, 4);
  }
  const RopeConfig& r = cache.rope();
  const uint8_t sc = static_cast<uint8_t>(r.scaling);
  const uint32_t oc = static_cast<uint32_t>(r.original_context);
  put(&r.theta, 4), put(&sc, 1), put(&r.factor, 4), put(&r.low_freq_factor, 4), put(&r.high_freq_factor, 4), put(&oc, 4);
  put(tables_digest.data(), 32);
  const uint32_t uc = static_cast<uint32_t>(plan.tokens), uo = static_cast<uint32_t>(plan.offset);
  put(&uc, 4);
  put(&uo, 4);
  std::vector<Key> keys;
  Key prev{};
  for (int64_t i = 0; plan.end(i) <= static_cast<int64_t>(tokens.size()); ++i) {
    Sha256 h;
    h.update(head.data(), head.size());
    h.update(prev.data(), prev.size());
    for (size_t t = static_cast<size_t>(plan.begin(i)); t < static_cast<size_t>(plan.end(i)); ++t) {
      KVQ_CHECK_ARG(tokens[t] >= 0, "tokens: expected ids >= 0, got ", tokens[t], " at ", t);
      h.u32(static_cast<uint32_t>(tokens[t]));
    }
    prev = h.final();
    keys.push_back(prev);
  }
  return keys;
}

PrefixStore::PrefixStore(const std::string& url, StoreOptions o) : o_(std::move(o)), b_(open_backend(url, o_)) {}

Digest PrefixStore::Tag(const Key& key, std::span<const uint8_t> value) const {
  static const char kDomain[] = "kvq-prefix-hmac-1";
  return hmac_sha256({reinterpret_cast<const uint8_t*>(o_.secret.data()), o_.secret.size()},
                     {{reinterpret_cast<const uint8_t*>(kDomain), sizeof kDomain - 1}, key, value});
}

Digest PrefixStore::TagOf(std::span<const uint8_t> stored) {
  Digest d;
  std::copy(stored.end() - kTagBytes, stored.end(), d.begin());
  return d;
}

void PrefixStore::Warn(const std::string& s) const { (o_.warn ? o_.warn : StderrWarn)(escape_for_message(s)); }

int64_t PrefixStore::longest_prefix(std::span<const int> tokens, KvCache& cache, int64_t limit,
                                    LookupReport* report) {
  LookupReport rep;
  const auto t0 = std::chrono::steady_clock::now();
  const ChunkPlan plan = chunk_plan(cache, o_.chunk_tokens);
  const size_t n = limit < 0 ? tokens.size() : std::min<size_t>(tokens.size(), static_cast<size_t>(limit));
  std::vector<Key> keys = chunk_keys(cache, tokens.first(n), plan.tokens, o_.model);
  while (!keys.empty() && plan.end(static_cast<int64_t>(keys.size()) - 1) > cache.max_seq()) keys.pop_back();
  std::vector<std::vector<uint8_t>> values;
  if (!keys.empty() && b_->alive()) {
    const std::vector<std::optional<uint64_t>> have = b_->sizes(keys);
    size_t run = 0;
    while (run < keys.size() && run < have.size() && have[run]) {
      const int64_t begin = plan.begin(static_cast<int64_t>(run)), end = plan.end(static_cast<int64_t>(run));
      const uint64_t most = max_chunk_bytes(cache, end);
      if (*have[run] > most) {  // never fetched: a hostile entry could be any size
        Warn("chunk " + std::to_string(run) + " (tokens " + std::to_string(begin) + ".." + std::to_string(end) +
             ", key " + key_hex(keys[run]).substr(0, 16) + "...) in " + b_->describe() + " is unusable: " +
             (*have[run] == StoreBackend::kNotAValue
                  ? std::string("not a stored value")
                  : std::to_string(*have[run]) + " bytes, more than the " + std::to_string(most) +
                        " a chunk of this cache can take") +
             "; recomputing it");
        good_.erase(keys[run]);
        ++rep.bad;
        break;
      }
      ++run;
    }
    keys.resize(run);
    auto got = run ? b_->get(keys) : std::vector<std::optional<std::vector<uint8_t>>>{};
    for (size_t i = 0; i < got.size() && got[i]; ++i) {
      const int64_t begin = plan.begin(static_cast<int64_t>(i)), end = plan.end(static_cast<int64_t>(i));
      try {
        if (!o_.secret.empty()) {
          std::vector<uint8_t>& v = *got[i];
          KVQ_CHECK_ARG(v.size() >= kTagBytes && digests_equal(Tag(keys[i], std::span(v).first(v.size() - kTagBytes)),
                                                              TagOf(v)),
                        "its HMAC-SHA256 fails under the store's secret (written without it, under another one, ",
                        "or altered)");
          v.resize(v.size() - kTagBytes);
        }
        cache.check_range(*got[i], begin, end, keys[i]);
      } catch (const Error& e) {
        Warn("chunk " + std::to_string(i) + " (tokens " + std::to_string(begin) + ".." + std::to_string(end) +
             ", key " + key_hex(keys[i]).substr(0, 16) + "...) in " + b_->describe() + " is unusable: " + e.what() +
             "; recomputing it");
        good_.erase(keys[i]);  // put overwrites it
        ++rep.bad;
        break;
      }
      rep.bytes += got[i]->size();
      values.push_back(std::move(*got[i]));
    }
  }
  rep.lookup_s = Since(t0);
  if (!values.empty()) {
    const auto t1 = std::chrono::steady_clock::now();
    std::vector<std::span<const uint8_t>> spans(values.begin(), values.end());
    std::vector<int64_t> ends;
    for (size_t i = 0; i < values.size(); ++i) ends.push_back(plan.end(static_cast<int64_t>(i)));
    try {
      cache.restore_ranges(spans, ends, std::span(keys).first(values.size()));
      b_->touch(std::span(keys).first(values.size()));
      rep.tokens = ends.back();
      rep.chunks = static_cast<int>(values.size());
      good_.insert(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(values.size()));
    } catch (const Error& e) {
      // Each chunk passed its own checks; the states together did not (a
      // crafted entry): nothing is restored, every chunk is recomputed.
      Warn(std::string("chunks 0..") + std::to_string(values.size() - 1) + " in " + b_->describe() +
           " do not restore: " + e.what() + "; recomputing them");
      for (size_t i = 0; i < values.size(); ++i) good_.erase(keys[i]);
      rep.bad += static_cast<int>(values.size());
    }
    rep.restore_s = Since(t1);
  }
  // The fetched values were as large as the cache restored from them; freed,
  // glibc keeps such blocks in its heap (its mmap threshold rises past them)
  // and the process would hold them resident beside the cache. Returned.
  values = {};
#ifdef __GLIBC__
  if (rep.bytes > (uint64_t{1} << 20)) ::malloc_trim(0);
#endif
  if (report) *report = rep;
  return rep.tokens;
}

int PrefixStore::put(std::span<const int> tokens, const KvCache& cache, uint64_t* bytes) {
  const ChunkPlan plan = chunk_plan(cache, o_.chunk_tokens);
  const int64_t T = cache.tokens();
  KVQ_CHECK_ARG(static_cast<int64_t>(tokens.size()) >= T, "tokens: the cache holds ", T, " tokens, got ", tokens.size(),
                " ids");
  if (bytes) *bytes = 0;
  if (!b_->writable() || T < plan.end(0)) return 0;
  const std::vector<Key> keys = chunk_keys(cache, tokens.first(static_cast<size_t>(T)), plan.tokens, o_.model);
  if (full_chain_ && *full_chain_ == keys[0]) return 0;  // its next chunk would be evicted at once too
  // A cache read at its length only (grouped) gives only the range ending there.
  size_t first = 0;
  if (!cache.any_length()) {
    if (!plan.is_end(T)) return 0;
    first = keys.size() - 1;
  }
  const std::vector<Key> want(keys.begin() + static_cast<std::ptrdiff_t>(first), keys.end());
  int written = 0;
  if (b_->epoch() != epoch_) {  // the backend came back: it may have lost what was written
    good_.clear();
    epoch_ = b_->epoch();
  }
  for (size_t j = 0; j < want.size(); ++j) {
    if (good_.count(want[j])) continue;
    const size_t i = first + j;
    std::vector<uint8_t> v =
        cache.range_to_bytes(plan.begin(static_cast<int64_t>(i)), plan.end(static_cast<int64_t>(i)), want[j]);
    if (!o_.secret.empty()) {
      const Digest tag = Tag(want[j], v);
      v.insert(v.end(), tag.begin(), tag.end());
    }
    if (!b_->put(std::span(keys).first(i + 1), v)) {
      if (b_->writable()) full_chain_ = keys[0];  // the size cap holds no more of this chain
      break;
    }
    good_.insert(want[j]);
    if (bytes) *bytes += v.size();
    ++written;
  }
  return written;
}

}  // namespace kvq::store
