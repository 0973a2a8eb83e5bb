// KVQS (a saved kvq::KvCache): restore into a caller's context of 512
// positions; whatever is accepted attends to finite values at every layer,
// takes a further token where it has room, and saves back to the same bytes
// (a restore is exact, so a save of it is too).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "kvq/error.h"
#include "kvq/kv_cache.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char magic[4] = {'K', 'V', 'Q', 'S'};
  const std::vector<uint8_t> bytes = kvq::fuzz::AsContainer(data, size, magic);
  kvq::KvCacheExpect expect;
  expect.max_seq = 512;  // the caller's capacity bounds what a restore allocates
  expect.token_table = [] { return kvq::fuzz::FuzzTokenTable(); };  // a t0+ cache's (of 2 heads x 32)
  try {
    kvq::KvCacheMeta meta;
    kvq::KvCache c = kvq::KvCache::from_bytes(bytes, expect, &meta);
    const int64_t T = c.tokens();
    if (T < 1 || T > 512) __builtin_trap();
    const size_t E = static_cast<size_t>(c.n_kv_heads()) * static_cast<size_t>(c.head_dim());
    // Saved again, the same bytes: nothing read was dropped or reinterpreted.
    if (c.to_bytes(T, meta) != bytes) __builtin_trap();
    if (bytes.size() <= c.bytes() || bytes.size() > c.bytes() + 4096) __builtin_trap();
    if (E > (size_t{1} << 14) || c.n_layers() > 8) return 0;  // keep each run fast
    const bool sane = kvq::fuzz::SaneValues(c);
    kvq::fuzz::AttendEveryLayer(c, sane);
    if (T < 512) {  // the restored store takes the next token
      const std::vector<float> k(E, 0.5f), v(E, -0.25f);
      for (int l = 0; l < c.n_layers(); ++l) c.write(l, static_cast<int>(T), k, v, 7);
      kvq::fuzz::AttendEveryLayer(c, sane);
    }
  } catch (const kvq::Error&) {
  }
  return 0;
}
