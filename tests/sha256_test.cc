// SHA-256 and HMAC-SHA256 (kvq/sha256.h) against published vectors:
// FIPS 180-2's "abc" and the empty string, RFC 4231's HMAC cases 1, 2 and 6.
#include "kvq/sha256.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvq/kv_cache.h"

namespace kvq {
namespace {

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

TEST(Sha256, KnownAnswers) {
  Sha256 empty;
  EXPECT_EQ(hex_digest(empty.final()), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  Sha256 abc;
  abc.update("a", 1), abc.update("bc", 2);  // incremental
  EXPECT_EQ(hex_digest(abc.final()), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256, HmacKnownAnswersAndParts) {
  const std::vector<uint8_t> key1(20, 0x0b);
  EXPECT_EQ(hex_digest(hmac_sha256(key1, {Bytes("Hi There")})),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hex_digest(hmac_sha256(Bytes("Jefe"), {Bytes("what do ya want "), Bytes("for nothing?")})),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  const std::vector<uint8_t> key6(131, 0xaa);  // longer than a block: hashed first
  EXPECT_EQ(hex_digest(hmac_sha256(key6, {Bytes("Test Using Larger Than Block-Size Key - Hash Key First")})),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  const Digest a = hmac_sha256(Bytes("k"), {Bytes("x")});
  Digest b = a;
  EXPECT_TRUE(digests_equal(a, b));
  b[31] ^= 1;
  EXPECT_FALSE(digests_equal(a, b));
  EXPECT_NE(hex_digest(hmac_sha256({}, {Bytes("x")})), hex_digest(a));  // an empty key is a key
}

}  // namespace
}  // namespace kvq
