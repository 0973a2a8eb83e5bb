// Helpers shared by the fuzz targets.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "src/container.h"

namespace kvq::fuzz {

// Input byte 0 picks the reading: odd, the bytes as a whole file; even,
// the rest as a payload wrapped in a valid container header (magic, version
// 1, size, CRC32C), so that mutations get past the checksum.
inline std::vector<uint8_t> AsContainer(const uint8_t* data, size_t size, const char magic[4]) {
  if (size == 0) return {};
  if (data[0] & 1) return std::vector<uint8_t>(data + 1, data + size);
  return detail::WrapContainer(magic, 1, std::vector<uint8_t>(data + 1, data + size));
}

// The bytes as a file the loaders can open by path (an anonymous memory
// file: no disk, removed when the descriptor closes).
class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) {
    fd_ = ::memfd_create("kvq-fuzz", 0);
    if (fd_ < 0) __builtin_trap();
    for (size_t done = 0; done < size;) {
      const ssize_t n = ::write(fd_, data + done, size - done);
      if (n <= 0) __builtin_trap();
      done += static_cast<size_t>(n);
    }
  }
  ~MemFile() { ::close(fd_); }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_ = -1;
};

}  // namespace kvq::fuzz
