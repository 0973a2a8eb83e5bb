// The directory store: one file per chunk, <dir>/<hex key>.kvqr, written
// whole or not at all (kvq/file.h: a temporary file beside it, synced and
// renamed), so readers and other writers never see part of one. A hit
// marks the chain's files used; with a size cap the least recently used
// files go first, a chain's last chunk before its first (and temporary
// files a crashed writer left, after an hour). A write that fails (a full
// disk, a read-only directory) is one warning and the last write of the run.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>

#include <unordered_map>

#include "kvq/error.h"
#include "kvq/file.h"
#include "store/backends.h"

namespace kvq::store {

std::atomic<uint64_t> dir_store_scans{0};

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

  bool writable() const override { return !dead_ && !read_only_; }

  std::vector<std::optional<uint64_t>> sizes(std::span<const Key> keys) override {
    std::vector<std::optional<uint64_t>> out;
    for (const Key& k : keys) {
      struct stat st {};
      if (dead_ || ::lstat(Path(k).c_str(), &st) != 0) {
        out.push_back(std::nullopt);
      } else {
        out.push_back(S_ISREG(st.st_mode) ? static_cast<uint64_t>(st.st_size) : kNotAValue);
      }
    }
    return out;
  }

  std::vector<std::optional<std::vector<uint8_t>>> get(std::span<const Key> keys) override {
    std::vector<std::optional<std::vector<uint8_t>>> out;
    for (const Key& k : keys) out.push_back(dead_ ? std::nullopt : Read(Path(k)));
    return out;
  }

  bool put(std::span<const Key> chain, std::span<const uint8_t> value) override {
    if (!writable()) return false;
    const std::string path = Path(chain.back());
    try {
      write_file_whole(path, value, "prompt cache");
    } catch (const Error& e) {  // a full disk, a read-only directory: nothing partial is left
      warn_(std::string("cannot store a chunk: ") + e.what() + "; no more chunks are written to it in this run");
      read_only_ = true;
      return false;
    }
    if (max_bytes_ == 0) return true;
    MarkChain(chain);
    Account(path, value.size());
    if (total_ > max_bytes_) Evict();
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0;  // false: evicted at once (the chain's oldest)
  }

  void touch(std::span<const Key> chain) override {
    if (!dead_ && max_bytes_ > 0) MarkChain(chain);
  }

 private:
  std::string Path(const Key& k) const { return dir_ + "/" + key_hex(k) + ".kvqr"; }

  // A chunk file whole (the store checks its size against what a chunk of
  // the cache can be before asking for it).
  std::optional<std::vector<uint8_t>> Read(const std::string& path) const {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) return std::nullopt;  // absent, or evicted by another process meanwhile
    struct stat st {};
    std::optional<std::vector<uint8_t>> out;
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) <= kMaxEntry) {
      std::vector<uint8_t> b(static_cast<size_t>(st.st_size));
      if (!ReadAll(fd, b)) b.clear();  // it shrank meanwhile: the checks refuse it
      out = std::move(b);
    }
    ::close(fd);
    return out;
  }

  static bool ReadAll(int fd, std::span<uint8_t> b) {
    size_t done = 0;
    while (done < b.size()) {
      const ssize_t n = ::read(fd, b.data() + done, b.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }

  // The chain's files get the time now, chunk 0 the latest and each later
  // one a microsecond earlier: least-recently-used eviction then takes a
  // chain's last chunks first and never leaves a tail without its head.
  void MarkChain(std::span<const Key> chain) const {
    struct timespec now {};
    ::clock_gettime(CLOCK_REALTIME, &now);
    const int64_t base = static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
    for (size_t j = 0; j < chain.size(); ++j) {
      const int64_t t = base - static_cast<int64_t>(j) * 1000;
      const struct timespec ts[2] = {{0, UTIME_OMIT}, {t / 1000000000, t % 1000000000}};
      (void)::utimensat(AT_FDCWD, Path(chain[j]).c_str(), ts, AT_SYMLINK_NOFOLLOW);
    }
  }

  // The store's running view of the directory's size: scanned once, then
  // each write added, so a write does not rescan a large directory; it is
  // rescanned (other processes write too) only when the view passes the cap.
  void Account(const std::string& path, uint64_t bytes) {
    if (!indexed_) {
      Scan(nullptr);
      return;
    }
    auto [it, fresh] = sizes_.emplace(path, bytes);
    if (!fresh) total_ -= it->second, it->second = bytes;
    total_ += bytes;
  }

  struct Entry {
    std::string path;
    uint64_t size;
    struct timespec mtime;
  };

  // Reads the directory: sizes_ and total_, and (when asked) every entry
  // with its mtime; removes temporary files a crashed writer left.
  void Scan(std::vector<Entry>* entries) {
    dir_store_scans.fetch_add(1, std::memory_order_relaxed);
    sizes_.clear(), total_ = 0, indexed_ = true;
    DIR* d = ::opendir(dir_.c_str());
    if (!d) return;
    const time_t now = std::time(nullptr);
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      const std::string path = dir_ + "/" + name;
      const bool chunk = name.size() == 64 + 5 && name.compare(64, 5, ".kvqr") == 0;
      const bool temp = name[0] == '.' && name.find(".kvqr.") != std::string::npos;
      if (!chunk && !temp) continue;
      struct stat st {};
      if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      if (chunk) {
        if (entries) entries->push_back({path, static_cast<uint64_t>(st.st_size), st.st_mtim});
        sizes_.emplace(path, static_cast<uint64_t>(st.st_size));
        total_ += static_cast<uint64_t>(st.st_size);
      } else if (now - st.st_mtime > 3600) {
        ::unlink(path.c_str());  // a crashed writer's temporary file
      }
    }
    ::closedir(d);
  }

  // Over the cap: rescanned, then the least recently used chunks removed
  // until the directory holds at most 90% of the cap (so the next writes do
  // not each rescan).
  void Evict() {
    std::vector<Entry> entries;
    Scan(&entries);
    if (total_ <= max_bytes_) return;
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return a.mtime.tv_sec != b.mtime.tv_sec ? a.mtime.tv_sec < b.mtime.tv_sec : a.mtime.tv_nsec < b.mtime.tv_nsec;
    });
    const uint64_t goal = max_bytes_ - max_bytes_ / 10;
    for (const Entry& e : entries) {
      if (total_ <= goal) break;
      if (::unlink(e.path.c_str()) == 0 || errno == ENOENT) {  // another process may have gone first
        total_ -= e.size;
        sizes_.erase(e.path);
      }
    }
  }

  std::string dir_;
  uint64_t max_bytes_;
  WarnFn warn_;
  bool dead_ = false, read_only_ = false;
  bool indexed_ = false;
  std::unordered_map<std::string, uint64_t> sizes_;  // chunk path -> bytes, as this store last saw them
  uint64_t total_ = 0;
};

}  // namespace

std::unique_ptr<StoreBackend> open_dir_store(const std::string& dir, uint64_t max_bytes, WarnFn warn) {
  return std::make_unique<DirStore>(dir, max_bytes, std::move(warn));
}

}  // namespace kvq::store
