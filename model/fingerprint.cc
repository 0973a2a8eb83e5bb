#include "model/fingerprint.h"

#include <openssl/evp.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>

#include "kvq/error.h"

namespace kvq::model {
namespace {

struct CtxFree {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) {
    KVQ_CHECK_ARG(ctx_ && EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) == 1, "sha256: OpenSSL init failed");
  }
  void update(const void* p, size_t n) {
    KVQ_CHECK_ARG(EVP_DigestUpdate(ctx_.get(), p, n) == 1, "sha256: OpenSSL update failed");
  }
  void u64(uint64_t x) {
    uint8_t b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(x >> (8 * i));
    update(b, 8);
  }
  Digest final() {
    Digest d{};
    unsigned n = 0;
    KVQ_CHECK_ARG(EVP_DigestFinal_ex(ctx_.get(), d.data(), &n) == 1 && n == d.size(), "sha256: OpenSSL final failed");
    return d;
  }

 private:
  std::unique_ptr<EVP_MD_CTX, CtxFree> ctx_;
};

void HashFile(Sha256& h, const std::string& path, const char* arg) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  KVQ_CHECK_ARG(f.good(), arg, ": cannot open '", path, "' (", std::strerror(errno), ")");
  const std::streamoff size = f.tellg();
  KVQ_CHECK_ARG(size >= 0, arg, ": cannot size '", path, "'");
  f.seekg(0);
  h.u64(static_cast<uint64_t>(size));
  std::vector<char> buf(size_t{1} << 20);
  std::streamoff done = 0;
  while (done < size) {
    f.read(buf.data(), static_cast<std::streamsize>(std::min<std::streamoff>(size - done, buf.size())));
    const std::streamsize n = f.gcount();
    KVQ_CHECK_ARG(n > 0, arg, ": short read of '", path, "'");
    h.update(buf.data(), static_cast<size_t>(n));
    done += n;
  }
}

}  // namespace

Digest model_fingerprint(const std::string& checkpoint_path, const std::string& tokenizer_path) {
  Sha256 h;
  HashFile(h, checkpoint_path, "model");
  HashFile(h, tokenizer_path, "tokenizer");
  return h.final();
}

Digest tokens_digest(std::span<const int> tokens) {
  Sha256 h;
  for (int t : tokens) {
    const uint32_t u = static_cast<uint32_t>(t);
    const uint8_t b[4] = {static_cast<uint8_t>(u), static_cast<uint8_t>(u >> 8), static_cast<uint8_t>(u >> 16),
                          static_cast<uint8_t>(u >> 24)};
    h.update(b, 4);
  }
  return h.final();
}


}  // namespace kvq::model
