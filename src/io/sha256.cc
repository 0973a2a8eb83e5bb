#include "kvq/sha256.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

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

Digest hmac_sha256(std::span<const uint8_t> key, std::initializer_list<std::span<const uint8_t>> parts) {
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  EVP_MAC_CTX* c = mac ? EVP_MAC_CTX_new(mac) : nullptr;
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                               OSSL_PARAM_construct_end()};
  // An empty key is a valid HMAC key; OpenSSL wants a non-null pointer for it.
  static const uint8_t kNone = 0;
  bool ok = c && EVP_MAC_init(c, key.empty() ? &kNone : key.data(), key.size(), params) == 1;
  for (const auto& p : parts) ok = ok && EVP_MAC_update(c, p.data(), p.size()) == 1;
  Digest d{};
  size_t n = 0;
  ok = ok && EVP_MAC_final(c, d.data(), &n, d.size()) == 1 && n == d.size();
  EVP_MAC_CTX_free(c);
  EVP_MAC_free(mac);
  KVQ_CHECK_ARG(ok, "hmac_sha256: OpenSSL failed");
  return d;
}

bool digests_equal(const Digest& a, const Digest& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

}  // namespace kvq
