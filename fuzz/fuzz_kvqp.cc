// KVQP (SortedProfileEncoding): deserialize; whatever is accepted decodes.
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_util.h"
#include "kvq/error.h"
#include "kvq/sorted_profile.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char magic[4] = {'K', 'V', 'Q', 'P'};
  const std::vector<uint8_t> bytes = kvq::fuzz::AsContainer(data, size, magic);
  try {
    const kvq::SortedProfileEncoding e = kvq::deserialize_sorted_profile(bytes);
    if (e.n < 0 || e.n > kvq::kMaxProfileValues) __builtin_trap();  // accepted beyond the documented limit
    // Decoding allocates n floats: up to 2^24 here to keep the fuzzer fast;
    // larger accepted encodings are constant or empty tails (no bytes).
    if (e.n <= (int64_t{1} << 24)) {
      const std::vector<float> v = kvq::decode(e);
      if (static_cast<int64_t>(v.size()) != e.n) __builtin_trap();
    }
    (void)e.why();
    if (kvq::serialize(e) != bytes) __builtin_trap();  // what is accepted round-trips
  } catch (const kvq::Error&) {
  }
  return 0;
}
