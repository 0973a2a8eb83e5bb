// SHA-256 and HMAC-SHA256 (OpenSSL's EVP, not hand-written): model
// fingerprints, token digests, the prefix store's chained chunk keys and
// its authenticated chunks.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>

namespace kvq {

using Digest = std::array<uint8_t, 32>;

class Sha256 {
 public:
  Sha256();  // throws kvq::Error if OpenSSL cannot start a digest
  ~Sha256();
  Sha256(Sha256&&) noexcept;
  Sha256& operator=(Sha256&&) noexcept;
  void update(const void* p, size_t n);
  void u32(uint32_t x);  // little-endian
  void u64(uint64_t x);  // little-endian
  Digest final();        // once

 private:
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
};

// HMAC-SHA256 (RFC 2104, OpenSSL's EVP_MAC) of the parts, concatenated,
// under `key`: the prefix store's chunk tags. Throws kvq::Error if OpenSSL
// fails.
Digest hmac_sha256(std::span<const uint8_t> key, std::initializer_list<std::span<const uint8_t>> parts);

// a == b in time independent of where they differ (CRYPTO_memcmp).
bool digests_equal(const Digest& a, const Digest& b);

}  // namespace kvq
