// The one table of KV cache families (see families.h).
#include "src/cache/families.h"

#include "kvq/error.h"

namespace kvq::detail {

KvRowsView KvCacheBackend::rows(int, int64_t) const {
  Fail("rows: the cache's scheme does not store rows (a grouped scheme); read it through attend() or read()");
}

const std::vector<KvCacheFamily>& kv_cache_families() {
  static const std::vector<KvCacheFamily> f = {RowFamily(), GroupedFamily()};
  return f;
}

}  // namespace kvq::detail
