#include "model/fingerprint.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>

#include "kvq/error.h"
#include "kvq/sha256.h"

namespace kvq::model {
namespace {

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
  for (int t : tokens) h.u32(static_cast<uint32_t>(t));
  return h.final();
}


}  // namespace kvq::model
