// KVQC (QuantizedClusterOutliers): deserialize; whatever is accepted
// dequantizes.
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_util.h"
#include "kvq/cluster_outliers.h"
#include "kvq/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char magic[4] = {'K', 'V', 'Q', 'C'};
  const std::vector<uint8_t> bytes = kvq::fuzz::AsContainer(data, size, magic);
  try {
    const kvq::QuantizedClusterOutliers q = kvq::deserialize_cluster_outliers(bytes);
    const int64_t w = int64_t{q.n_head} * q.d_head;
    if (q.tail_tokens * w <= (int64_t{1} << 24)) {  // see fuzz_kvqp.cc
      const kvq::DequantizedClusterOutliers d = kvq::dequantize_cluster_outliers(q);
      if (d.tail_k && d.tail_k->dim(0) != q.tail_tokens) __builtin_trap();
    }
    if (kvq::serialize(q) != bytes) __builtin_trap();
    if (q.size_bytes() != bytes.size()) __builtin_trap();
  } catch (const kvq::Error&) {
  }
  return 0;
}
