// KVQR (a range of a kvq::KvCache, the prefix store's chunk): restored into
// the reference cache of the scheme it names (fuzz_util.h: fixed geometry and
// calibrated ranges), as the first range or after the reference first range
// when it says it begins where that one ends. Whatever is accepted attends to
// finite values, takes a further token, and saves back to the same bytes (a
// restore is exact, so the range saved from it is too); a refused range
// leaves the cache as it was.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "kvq/error.h"
#include "kvq/kv_cache.h"

namespace {

// The fields a range names up front (kv_cache.h's layout); false if short.
bool Peek(const std::vector<uint8_t>& c, std::string& name, uint64_t& begin, uint64_t& end,
          std::array<uint8_t, 32>& id) {
  const size_t h = kvq::detail::kContainerHeaderBytes;
  if (c.size() < h + 2) return false;
  uint16_t n;
  std::memcpy(&n, c.data() + h, 2);
  const size_t at = h + 2 + n + 12 + 21;  // name, geometry (3 x u32), RoPE (4 f32, u8, u32)
  if (c.size() < at + 16 + 32) return false;
  name.assign(reinterpret_cast<const char*>(c.data() + h + 2), n);
  std::memcpy(&begin, c.data() + at, 8);
  std::memcpy(&end, c.data() + at + 8, 8);
  std::memcpy(id.data(), c.data() + at + 16, 32);
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char magic[4] = {'K', 'V', 'Q', 'R'};
  const std::vector<uint8_t> bytes = kvq::fuzz::AsContainer(data, size, magic);
  std::string name;
  uint64_t begin = 0, end = 0;
  std::array<uint8_t, 32> id;
  if (!Peek(bytes, name, begin, end, id)) return 0;
  std::string scheme;  // the reference scheme whose canonical name the range gives
  for (const char* s : kvq::fuzz::kRangeSchemes) {
    if (kvq::describe_kv_scheme(s).name == name) scheme = s;
  }
  if (scheme.empty() || end > 128 || (begin != 0 && begin != kvq::fuzz::kRange0) || end <= begin) return 0;
  kvq::KvCache c = kvq::fuzz::RangeCache(scheme);
  const std::vector<uint8_t> before = c.tables();
  std::vector<std::span<const uint8_t>> parts;
  std::vector<int64_t> ends;
  std::vector<std::array<uint8_t, 32>> ids;
  if (begin != 0) {
    parts.push_back(kvq::fuzz::RangeSeeds(scheme)[0]);
    ends.push_back(kvq::fuzz::kRange0);
    ids.push_back(kvq::fuzz::RangeId(0));
  }
  parts.push_back(bytes);
  ends.push_back(static_cast<int64_t>(end));
  ids.push_back(id);
  const auto& seeds = kvq::fuzz::RangeSeeds(scheme);
  const bool seed = bytes == seeds[0] || bytes == seeds[1];
  try {
    c.restore_ranges(parts, ends, ids);
  } catch (const kvq::Error&) {
    if (seed) __builtin_trap();  // a range the reference sequence saved must restore
    if (c.tokens() != 0 || c.tables() != before) __builtin_trap();  // refused: untouched
    return 0;
  }
  const int64_t T = c.tokens();
  if (T != static_cast<int64_t>(end)) __builtin_trap();
  if (c.range_to_bytes(static_cast<int64_t>(begin), -1, id) != bytes) __builtin_trap();
  const size_t E = static_cast<size_t>(c.n_kv_heads()) * static_cast<size_t>(c.head_dim());
  kvq::fuzz::AttendEveryLayer(c, kvq::fuzz::SaneValues(c));
  if (T < c.max_seq()) {
    const std::vector<float> k(E, 0.5f), v(E, -0.25f);
    try {
      for (int l = 0; l < c.n_layers(); ++l) c.write(l, static_cast<int>(T), k, v, 7);
    } catch (const kvq::Error&) {
      __builtin_trap();
    }
  }
  return 0;
}
