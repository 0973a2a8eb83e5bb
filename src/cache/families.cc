// The one table of KV cache families (see families.h).
#include "src/cache/families.h"

#include "kvq/error.h"

namespace kvq::detail {

AttentionPart KvCacheBackend::attend_part(int, int64_t, int64_t, std::span<const float>, int,
                                          const DecodeAttentionOptions&) const {
  Fail("attend_part: the cache's scheme attends only its whole length (a streaming grouped scheme does not keep ",
       "token ranges apart); use attend()");
}

const std::vector<KvCacheFamily>& kv_cache_families() {
  static const std::vector<KvCacheFamily> f = {RowFamily(), GroupedFamily(), TokenFamily()};
  return f;
}

}  // namespace kvq::detail
