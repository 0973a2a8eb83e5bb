#include "model/fingerprint.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>

#include "kvq/error.h"
#include "kvq/file.h"
#include "kvq/kv_cache.h"
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

// What identifies a file's bytes without reading them: device, inode, size,
// mtime and ctime (ns). The ctime catches a file rewritten in place with
// its size and mtime put back (utimensat sets the mtime, never the ctime);
// the inode one replaced by another.
struct Stamp {
  uint64_t dev = 0, ino = 0, size = 0;
  int64_t mtime_ns = 0, ctime_ns = 0;
  bool operator==(const Stamp&) const = default;
  std::string text() const {
    return std::to_string(dev) + " " + std::to_string(ino) + " " + std::to_string(size) + " " +
           std::to_string(mtime_ns) + " " + std::to_string(ctime_ns);
  }
};

std::istream& operator>>(std::istream& in, Stamp& s) {
  return in >> s.dev >> s.ino >> s.size >> s.mtime_ns >> s.ctime_ns;
}

Stamp StampOf(const std::string& path, const char* arg) {
  struct stat st {};
  KVQ_CHECK_ARG(::stat(path.c_str(), &st) == 0, arg, ": cannot open '", path, "' (", std::strerror(errno), ")");
  const auto ns = [](const struct timespec& t) { return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec; };
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_size),
          ns(st.st_mtim), ns(st.st_ctim)};
}

std::string Absolute(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::absolute(path, ec);
  return ec ? path : p.lexically_normal().string();
}

// $XDG_CACHE_HOME/kvq/fingerprints (else ~/.cache/...), or "" when neither is set.
std::string CacheDir() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg && *xdg) return std::string(xdg) + "/kvq/fingerprints";
  const char* home = std::getenv("HOME");
  return home && *home ? std::string(home) + "/.cache/kvq/fingerprints" : std::string();
}

constexpr const char* kTag = "kvq-fingerprint-2";

uint64_t CacheMinBytes() {
  const char* e = std::getenv("KVQ_FINGERPRINT_CACHE_MIN_BYTES");
  if (e && *e) {
    char* end = nullptr;
    const unsigned long long v = std::strtoull(e, &end, 10);
    if (end && *end == 0) return v;
  }
  return uint64_t{64} << 20;
}

}  // namespace

Digest model_fingerprint(const std::string& checkpoint_path, const std::string& tokenizer_path) {
  const Stamp a = StampOf(checkpoint_path, "model"), b = StampOf(tokenizer_path, "tokenizer");
  std::string entry;  // the cache file for these two paths, when the files are large enough to be worth it
  const std::string dir = CacheDir();
  if (!dir.empty() && a.size + b.size >= CacheMinBytes()) {
    Sha256 key;
    const std::string pa = Absolute(checkpoint_path), pb = Absolute(tokenizer_path);
    key.u64(pa.size()), key.update(pa.data(), pa.size()), key.update(pb.data(), pb.size());
    entry = dir + "/" + hex_digest(key.final());
    std::ifstream f(entry);
    std::string tag, hex;
    Stamp ca, cb;
    if (f >> tag >> ca >> cb >> hex && tag == kTag && ca == a && cb == b && hex.size() == 64 && hex.find_first_not_of("0123456789abcdef") == std::string::npos) {
      Digest d;
      for (size_t i = 0; i < 32; ++i) d[i] = static_cast<uint8_t>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
      return d;
    }
  }
  Sha256 h;
  HashFile(h, checkpoint_path, "model");
  HashFile(h, tokenizer_path, "tokenizer");
  const Digest d = h.final();
  // Kept only if neither file changed while it was read; a cache that
  // cannot be written is no error.
  const Stamp a2 = StampOf(checkpoint_path, "model"), b2 = StampOf(tokenizer_path, "tokenizer");
  if (!entry.empty() && a2 == a && b2 == b) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const std::string text = std::string(kTag) + " " + a.text() + " " + b.text() + " " + hex_digest(d) + "\n";
    try {
      write_file_whole(entry, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()), "fingerprint cache");
    } catch (const Error&) {
    }
  }
  return d;
}

Digest tokens_digest(std::span<const int> tokens) {
  Sha256 h;
  for (int t : tokens) h.u32(static_cast<uint32_t>(t));
  return h.final();
}


}  // namespace kvq::model
