// kvq/crc32c.h: CRC-32C known answers (RFC 3720) and incremental use.
#include "kvq/crc32c.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvq {
namespace {

TEST(Crc32c, KnownAnswerAndIncremental) {
  const std::string s = "123456789";
  const std::span<const uint8_t> b(reinterpret_cast<const uint8_t*>(s.data()), s.size());
  EXPECT_EQ(crc32c(b), 0xE3069283u);
  EXPECT_EQ(crc32c({}), 0u);
  EXPECT_EQ(crc32c(b.subspan(4), crc32c(b.first(4))), 0xE3069283u);
  std::vector<uint8_t> zeros(32, 0);
  EXPECT_EQ(crc32c(zeros), 0x8A9136AAu);  // RFC 3720 B.4: 32 bytes of zeros
}

}  // namespace
}  // namespace kvq
