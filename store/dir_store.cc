// The directory store: one file per chunk, <dir>/<hex key>.kvqr, written
// whole or not at all (kvq/file.h: a temporary file beside it, synced and
// renamed), so readers and other writers never see part of one. A hit
// touches the file's mtime; with a size cap the least recently used files
// go first (and temporary files a crashed writer left, after an hour).
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>

#include "kvq/error.h"
#include "kvq/file.h"
#include "store/backends.h"

namespace kvq::store {
namespace {

constexpr uint64_t kMaxEntry = uint64_t{1} << 34;  // 16 GiB: a chunk of any sane geometry

// mkdir -p; false with errno set on failure.
bool MakeDirs(const std::string& dir) {
  for (size_t at = 1; at <= dir.size(); ++at) {
    if (at != dir.size() && dir[at] != '/') continue;
    const std::string part = dir.substr(0, at);
    if (::mkdir(part.c_str(), 0777) != 0 && errno != EEXIST) return false;
  }
  struct stat st {};
  return ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

class DirStore final : public StoreBackend {
 public:
  DirStore(std::string dir, uint64_t max_bytes, WarnFn warn)
      : dir_(std::move(dir)), max_bytes_(max_bytes), warn_(std::move(warn)) {
    while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
    if (!MakeDirs(dir_)) {
      warn_("cannot use the directory '" + dir_ + "' (" + std::strerror(errno) + "); continuing without the store");
      dead_ = true;
    }
  }
  std::string describe() const override { return dir_; }
  bool alive() const override { return !dead_; }

  std::vector<bool> contains(std::span<const Key> keys) override {
    std::vector<bool> out;
    for (const Key& k : keys) {
      struct stat st {};
      out.push_back(!dead_ && ::stat(Path(k).c_str(), &st) == 0 && S_ISREG(st.st_mode));
    }
    return out;
  }

  std::vector<std::optional<std::vector<uint8_t>>> get(std::span<const Key> keys) override {
    std::vector<std::optional<std::vector<uint8_t>>> out;
    for (const Key& k : keys) out.push_back(dead_ ? std::nullopt : Read(Path(k)));
    return out;
  }

  void put(const Key& key, std::span<const uint8_t> value) override {
    if (dead_) return;
    try {
      write_file_whole(Path(key), value, "prompt cache");
    } catch (const Error& e) {  // a full disk, a read-only directory: nothing partial is left
      warn_(std::string("cannot store a chunk: ") + e.what());
      return;
    }
    if (max_bytes_ > 0) Evict();
  }

 private:
  std::string Path(const Key& k) const { return dir_ + "/" + key_hex(k) + ".kvqr"; }

  std::optional<std::vector<uint8_t>> Read(const std::string& path) const {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return std::nullopt;  // absent, or evicted by another process meanwhile
    struct stat st {};
    std::optional<std::vector<uint8_t>> out;
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) <= kMaxEntry) {
      std::vector<uint8_t> b(static_cast<size_t>(st.st_size));
      size_t done = 0;
      while (done < b.size()) {
        const ssize_t n = ::read(fd, b.data() + done, b.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        done += static_cast<size_t>(n);
      }
      b.resize(done);  // short: the checks refuse it
      out = std::move(b);
      (void)::futimens(fd, nullptr);  // used now (LRU)
    }
    ::close(fd);
    return out;
  }

  void Evict() {
    DIR* d = ::opendir(dir_.c_str());
    if (!d) return;
    struct Entry {
      std::string path;
      uint64_t size;
      struct timespec mtime;
    };
    std::vector<Entry> entries;
    uint64_t total = 0;
    const time_t now = std::time(nullptr);
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      const std::string path = dir_ + "/" + name;
      struct stat st {};
      if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      if (name.size() == 64 + 5 && name.compare(64, 5, ".kvqr") == 0) {
        entries.push_back({path, static_cast<uint64_t>(st.st_size), st.st_mtim});
        total += static_cast<uint64_t>(st.st_size);
      } else if (name[0] == '.' && name.find(".kvqr.") != std::string::npos && now - st.st_mtime > 3600) {
        ::unlink(path.c_str());  // a crashed writer's temporary file
      }
    }
    ::closedir(d);
    if (total <= max_bytes_) return;
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return a.mtime.tv_sec != b.mtime.tv_sec ? a.mtime.tv_sec < b.mtime.tv_sec : a.mtime.tv_nsec < b.mtime.tv_nsec;
    });
    for (const Entry& e : entries) {
      if (total <= max_bytes_) break;
      if (::unlink(e.path.c_str()) == 0 || errno == ENOENT) total -= e.size;  // another process may have gone first
    }
  }

  std::string dir_;
  uint64_t max_bytes_;
  WarnFn warn_;
  bool dead_ = false;
};

}  // namespace

std::unique_ptr<StoreBackend> open_dir_store(const std::string& dir, uint64_t max_bytes, WarnFn warn) {
  return std::make_unique<DirStore>(dir, max_bytes, std::move(warn));
}

}  // namespace kvq::store
