// SHA-256 (OpenSSL's EVP, not hand-written): model fingerprints, token
// digests and the prefix store's chained chunk keys.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>

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

}  // namespace kvq
