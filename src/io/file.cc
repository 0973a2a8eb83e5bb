#include "kvq/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "kvq/error.h"

namespace kvq {

void write_file_whole(const std::string& path, std::span<const uint8_t> bytes, const char* arg) {
  // What sits at `path` (or at the end of its symlinks) is replaced only
  // when it is a regular file: the rename would put a file in place of a
  // FIFO or a device node (/dev/null, as root).
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    KVQ_CHECK_ARG(!S_ISDIR(st.st_mode), arg, ": '", path, "' is a directory");
    KVQ_CHECK_ARG(S_ISREG(st.st_mode), arg, ": '", path,
                  "' is not a regular file (a FIFO, a device or a socket); kvq writes only regular files");
  }
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  std::string tmp = (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) + "." +
                    path.substr(slash == std::string::npos ? 0 : slash + 1) + ".XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  KVQ_CHECK_ARG(fd >= 0, arg, ": cannot create a temporary file in '", dir, "' (", std::strerror(errno), ")");
  const mode_t mask = ::umask(0);
  ::umask(mask);
  (void)::fchmod(fd, 0666 & ~mask);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      Fail(arg, ": write to '", tmp, "' failed (", std::strerror(e), "); '", path, "' is unchanged");
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    Fail(arg, ": cannot write '", path, "' (", std::strerror(e), "); it is unchanged");
  }
}

namespace {
uint64_t RegularFileSize(const std::string& path, const char* arg) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) Fail(arg, " '", path, "': cannot open (", std::strerror(errno), ")");
  if (!S_ISREG(st.st_mode)) Fail(arg, " '", path, "': not a regular file");
  return static_cast<uint64_t>(st.st_size);
}
}  // namespace

std::vector<uint8_t> read_file_head(const std::string& path, size_t n, uint64_t* size, const char* arg) {
  *size = RegularFileSize(path, arg);
  std::ifstream f(path, std::ios::binary);
  if (!f) Fail(arg, " '", path, "': cannot open");
  std::vector<uint8_t> out(static_cast<size_t>(std::min<uint64_t>(n, *size)));
  f.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size()));
  out.resize(static_cast<size_t>(f.gcount()));
  return out;
}

std::vector<uint8_t> read_file_whole(const std::string& path, uint64_t max_bytes, const char* arg) {
  const uint64_t size = RegularFileSize(path, arg);
  if (size > max_bytes) Fail(arg, " '", path, "': ", size, " bytes, more than the limit of ", max_bytes);
  std::ifstream f(path, std::ios::binary);
  if (!f) Fail(arg, " '", path, "': cannot open");
  std::vector<uint8_t> out(static_cast<size_t>(size));
  f.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(out.size()));
  out.resize(static_cast<size_t>(f.gcount()));  // a file that shrank meanwhile
  return out;
}

void check_output_path(const char* arg, const std::string& path, std::initializer_list<std::string> inputs) {
  if (path.empty()) return;
  struct stat out {};
  if (::stat(path.c_str(), &out) == 0) {
    KVQ_CHECK_ARG(!S_ISDIR(out.st_mode), arg, ": '", path, "' is a directory");
    for (const std::string& in : inputs) {
      struct stat st {};
      KVQ_CHECK_ARG(!(::stat(in.c_str(), &st) == 0 && st.st_dev == out.st_dev && st.st_ino == out.st_ino),
                    arg, ": '", path, "' is this run's input '", in, "'; refusing to overwrite it");
    }
  }
  const auto dir = std::filesystem::path(path).parent_path();
  KVQ_CHECK_ARG(dir.empty() || std::filesystem::is_directory(dir), arg, ": directory '", dir.string(),
                "' does not exist");
  std::string probe = (dir.empty() ? std::string(".kvq-out-XXXXXX") : (dir / ".kvq-out-XXXXXX").string());
  const int fd = ::mkstemp(probe.data());
  KVQ_CHECK_ARG(fd >= 0, arg, ": cannot create a file in '", dir.empty() ? "." : dir.string(), "' (",
                std::strerror(errno), ")");
  ::close(fd);
  ::unlink(probe.c_str());
}

}  // namespace kvq
