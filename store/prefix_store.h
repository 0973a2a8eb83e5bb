// A compressed prefix store for KV caches (the layer above kvq/kv_cache.h):
// the prompt's tokens cut into chunks of C tokens, each chunk's K/V of every
// layer kept in the scheme's stored form (a KVQR range, kv_cache.h) under a
// chained key, in a local directory, in Redis, or in process memory.
//
//   kvq::store::PrefixStore store("redis://127.0.0.1:6379", {.model = fingerprint});
//   int64_t n = store.longest_prefix(tokens, cache);   // restores [0, n) into cache
//   ... compute tokens n.. ; at every multiple of C: store.put(tokens, cache);
//
// Keys (vLLM's and LMCache's chained scheme): chunk i of a token sequence
// has the key
//   K_i = SHA-256("kvq-prefix-1" | model fingerprint (32 bytes, zeros when
//         none) | u16 length + canonical scheme name | u32 n_layers,
//         n_kv_heads, head_dim | RoPE | SHA-256 of the cache's calibrated
//         tables | u32 C | u32 offset (ChunkPlan) | K_{i-1} (32 zero bytes for
//         i = 0) | the chunk's token ids as u32 little-endian)
// so equal keys mean an equal prefix under the same model, scheme, tables
// and chunking. C is the requested chunk size rounded up to a multiple of
// the scheme's group (a grouped scheme's G, 1 for row schemes).
//
// Chunk i holds tokens [begin(i), end(i)) (ChunkPlan: chunk 0 also the
// first `offset` tokens). Values: the KVQR range saved when the cache held
// end(i) tokens, carrying K_i and its tables' digest. Restoring chunks
// 0..k-1 gives the cache an uninterrupted run has at end(k-1), bit for bit
// (KvCache::restore_ranges). A value that fails any check (CRC, scheme,
// geometry, tables, range, key) is a miss with one warning line; put then
// overwrites it. So is one larger than a chunk of the cache can be
// (max_chunk_bytes): it is never fetched.
//
// Trust: without a secret, a chunk's CRC32C, key and checks catch damage,
// not a writer: anyone who can write the directory or the Redis database
// can make another user's run restore K/V of their choosing. With a secret
// (StoreOptions::secret), only holders of it can write chunks that are
// restored; readers without it see unusable entries.
//
// Backends (open_backend): a directory (one file per chunk, temp file +
// rename, a size cap that evicts the least recently used chains from their
// last chunk backwards), Redis through hiredis (key prefix, TTL, AUTH,
// 1 s timeouts), or memory. A backend never throws once open: a failing one
// warns once and behaves as an empty store from then on.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "kvq/kv_cache.h"
#include "kvq/sha256.h"

namespace kvq::store {

using Key = Digest;

struct StoreOptions {
  int chunk_tokens = 256;        // rounded up to a multiple of the scheme's group
  uint64_t max_bytes = 0;        // directory and memory: size cap, least recently used chunks first, a chain's last first (0: none)
  int ttl_seconds = 0;           // Redis: expiry of each entry (0: none)
  std::string key_prefix = "kvq:prefix:";  // Redis: prepended to the hex key
  int timeout_ms = 1000;         // Redis: connect and per-command timeout (1..60000)
  std::optional<Key> model;      // the model's fingerprint (model/fingerprint.h)
  // A secret (any bytes; empty: none; never printed): every chunk then
  // carries HMAC-SHA256(secret, "kvq-prefix-hmac-1" | key | value) after its
  // value, and a chunk whose tag fails (written without the secret, under
  // another one, or altered) is a miss with one warning.
  std::string secret;
  // Where warnings go (one line each, no trailing newline); default stderr.
  std::function<void(const std::string&)> warn;
};

// Key-value storage of chunks. Batched calls take the keys in order.
class StoreBackend {
 public:
  virtual ~StoreBackend() = default;
  // What to print: the path or the URL with any password as ***.
  virtual std::string describe() const = 0;
  // False while the backend is down (an unreachable or dying server,
  // retried later).
  virtual bool alive() const { return true; }
  // Changes when the backend came back after being down: what it held
  // before may be gone (a restarted Redis), so what this store remembers
  // having written is forgotten.
  virtual uint64_t epoch() const { return 0; }
  // False once writing stopped for this store (a read-only or full
  // directory: warned once): put is not worth serialising a chunk for.
  virtual bool writable() const { return alive(); }
  // The size of what each key holds: nullopt when absent, kNotAValue when
  // something that is not a value sits there (a Redis key of another type:
  // unusable, and overwritten by put).
  static constexpr uint64_t kNotAValue = ~uint64_t{0};
  virtual std::vector<std::optional<uint64_t>> sizes(std::span<const Key> keys) = 0;
  virtual std::vector<std::optional<std::vector<uint8_t>>> get(std::span<const Key> keys) = 0;
  // Stores `value` under chain.back(); chain is the chunk's key chain from
  // chunk 0 (a size-capped backend keeps a chain's earlier chunks longer
  // than its later ones: without its first chunks a chain is unusable).
  // False when the value was not kept (writing stopped, or the size cap
  // evicted it at once: the chain's later chunks would not fit either).
  virtual bool put(std::span<const Key> chain, std::span<const uint8_t> value) = 0;
  // The chain's chunks were just used (restored): a size-capped backend
  // marks them recently used, chunk 0 the most recent.
  virtual void touch(std::span<const Key> chain) { (void)chain; }
  // The bytes it holds, where it knows them cheaply (memory:); else nullopt.
  virtual std::optional<uint64_t> held_bytes() { return std::nullopt; }
};

// url: "memory:" or "memory:NAME" (a map shared by the process's stores of
// that name), "redis://[user:password@]host[:port][/db]" (password also from
// KVQ_REDIS_PASSWORD), a directory path, or "" for the default directory
// ($XDG_CACHE_HOME/kvq/prefix, else ~/.cache/kvq/prefix). Throws kvq::Error
// on a malformed URL or option; a server that cannot be reached is a
// warning and an empty store.
std::unique_ptr<StoreBackend> open_backend(const std::string& url, const StoreOptions& o);
std::string default_store_dir();

// The most bytes a stored chunk ending at `end` can hold for this cache's
// geometry: 10 bytes per token, layer and channel (fp32 needs 8) plus
// 1 MiB; a store lookup never fetches a larger value.
uint64_t max_chunk_bytes(const KvCache& cache, int64_t end);

// The chunk size a cache of this scheme uses for a requested one.
int chunk_tokens_for(const KvCache& cache, int requested);

// Where chunks end: offset + (i + 1) C. The offset puts the ends where a
// cache holds the fewest open tokens: a dynamic grouped scheme's sinks and
// recent window (S + R: at T = S + R + kG every group but the recent window
// is coded), a calibrated one's sinks (whole tiles), 0 for row schemes.
// Chunk 0 is [0, offset + C).
struct ChunkPlan {
  int tokens = 1;      // C
  int64_t offset = 0;
  int64_t end(int64_t i) const { return offset + (i + 1) * tokens; }
  int64_t begin(int64_t i) const { return i == 0 ? 0 : end(i - 1); }
  bool is_end(int64_t T) const { return T >= end(0) && (T - offset) % tokens == 0; }
  // The first chunk end past T (where a prefill pass should stop to store).
  int64_t next_end(int64_t T) const { return T < end(0) ? end(0) : offset + ((T - offset) / tokens + 1) * tokens; }
};
ChunkPlan chunk_plan(const KvCache& cache, int requested);

// Keys of the full chunks of `tokens` (chunk size C = chunk_tokens_for).
std::vector<Key> chunk_keys(const KvCache& cache, std::span<const int> tokens, int chunk_tokens,
                            const std::optional<Key>& model);

struct LookupReport {
  int64_t tokens = 0;        // restored
  int chunks = 0;            // restored
  int bad = 0;               // entries found unusable (warned, to be overwritten)
  double lookup_s = 0;       // keys, sizes, get, checks
  double restore_s = 0;      // KvCache::restore_ranges
  uint64_t bytes = 0;        // value bytes read
};

class PrefixStore {
 public:
  explicit PrefixStore(const std::string& url, StoreOptions o = {});
  const StoreOptions& options() const { return o_; }
  StoreBackend& backend() { return *b_; }
  int chunk_tokens(const KvCache& cache) const { return chunk_tokens_for(cache, o_.chunk_tokens); }
  ChunkPlan plan(const KvCache& cache) const { return chunk_plan(cache, o_.chunk_tokens); }

  // Restores into `cache` the longest run of stored chunks that are full
  // chunks of tokens[0, limit) (limit -1: all of them) and returns the
  // tokens restored (0: the cache is untouched). The cache must be of the
  // scheme and tables the chunks were stored with (else they are misses)
  // with max_seq >= the tokens restored.
  int64_t longest_prefix(std::span<const int> tokens, KvCache& cache, int64_t limit = -1,
                         LookupReport* report = nullptr);
  // Stores the full chunks of tokens[0, cache.tokens()) this store has not
  // restored or written already (whatever the backend holds under their
  // keys, which may be unusable, is overwritten): a row cache any of them,
  // a grouped cache the one ending at its current length (call put as each
  // chunk fills, as kvq generate does). tokens: the ids the cache was
  // computed from (at least cache.tokens()). Returns the chunks written.
  int put(std::span<const int> tokens, const KvCache& cache, uint64_t* bytes = nullptr);

 private:
  void Warn(const std::string& s) const;
  static constexpr size_t kTagBytes = 32;
  Digest Tag(const Key& key, std::span<const uint8_t> value) const;  // with o_.secret
  static Digest TagOf(std::span<const uint8_t> stored);               // its last kTagBytes
  StoreOptions o_;
  std::unique_ptr<StoreBackend> b_;
  std::set<Key> good_;  // restored or written by this store: put skips them
  uint64_t epoch_ = 0;  // the backend's epoch() good_ holds for
  std::optional<Key> full_chain_;  // chunk 0's key of a chain the size cap could not hold: not extended
};

}  // namespace kvq::store
