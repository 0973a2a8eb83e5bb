#include "kvq/sha256.h"

#include <openssl/evp.h>

#include "kvq/error.h"

namespace kvq {

struct Sha256::Ctx {
  EVP_MD_CTX* c = EVP_MD_CTX_new();
  ~Ctx() { EVP_MD_CTX_free(c); }
};

Sha256::Sha256() : ctx_(std::make_unique<Ctx>()) {
  KVQ_CHECK_ARG(ctx_->c && EVP_DigestInit_ex(ctx_->c, EVP_sha256(), nullptr) == 1, "sha256: OpenSSL init failed");
}
Sha256::~Sha256() = default;
Sha256::Sha256(Sha256&&) noexcept = default;
Sha256& Sha256::operator=(Sha256&&) noexcept = default;

void Sha256::update(const void* p, size_t n) {
  KVQ_CHECK_ARG(EVP_DigestUpdate(ctx_->c, p, n) == 1, "sha256: OpenSSL update failed");
}

void Sha256::u32(uint32_t x) {
  const uint8_t b[4] = {static_cast<uint8_t>(x), static_cast<uint8_t>(x >> 8), static_cast<uint8_t>(x >> 16),
                        static_cast<uint8_t>(x >> 24)};
  update(b, 4);
}

void Sha256::u64(uint64_t x) {
  u32(static_cast<uint32_t>(x));
  u32(static_cast<uint32_t>(x >> 32));
}

Digest Sha256::final() {
  Digest d{};
  unsigned n = 0;
  KVQ_CHECK_ARG(EVP_DigestFinal_ex(ctx_->c, d.data(), &n) == 1 && n == d.size(), "sha256: OpenSSL final failed");
  return d;
}

}  // namespace kvq
