// Internal: the versioned container every kvq encoding serialises into
// (SPEC §9), and bounds-checked little-endian byte readers/writers.
//
//   offset  size  field
//   0       4     magic (per encoding kind, e.g. "KVQP")
//   4       2     format version (u16)
//   6       2     reserved, 0
//   8       8     payload size in bytes (u64)
//   16      4     CRC32C of the payload (u32)
//   20      ...   payload
//
// All integers and floats are little-endian IEEE/two's complement.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "kvq/error.h"

namespace kvq::detail {

static_assert(std::endian::native == std::endian::little,
              "kvq's serialised formats assume a little-endian host");

inline constexpr size_t kContainerHeaderBytes = 20;

class ByteWriter {
 public:
  template <typename T>
  void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const size_t at = buf_.size();
    buf_.resize(at + sizeof(T));
    std::memcpy(buf_.data() + at, &v, sizeof(T));
  }
  template <typename T>
  void put_array(std::span<const T> v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const size_t at = buf_.size();
    buf_.resize(at + v.size_bytes());
    if (!v.empty()) std::memcpy(buf_.data() + at, v.data(), v.size_bytes());
  }
  std::vector<uint8_t>& bytes() { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

// Reads from a span; every read is bounds-checked and a short read throws
// kvq::Error naming `what` (the encoding being read).
class ByteReader {
 public:
  ByteReader(std::span<const uint8_t> bytes, const char* what) : b_(bytes), what_(what) {}
  template <typename T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T));
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  // Reads `count` elements; the count is checked against the bytes left
  // before anything is allocated, so a corrupted count cannot exhaust memory.
  template <typename T>
  std::vector<T> get_array(uint64_t count) {
    if (count > remaining() / sizeof(T)) truncated();
    std::vector<T> v(static_cast<size_t>(count));
    if (count) std::memcpy(v.data(), b_.data() + pos_, count * sizeof(T));
    pos_ += count * sizeof(T);
    return v;
  }
  size_t remaining() const { return b_.size() - pos_; }
  // Throws unless every byte was consumed.
  void expect_end() const {
    if (pos_ != b_.size()) {
      Fail(what_, ": ", b_.size() - pos_, " unexpected trailing bytes in the payload");
    }
  }
  [[noreturn]] void corrupt(const std::string& why) const { Fail(what_, ": corrupted payload: ", why); }

 private:
  void need(size_t n) const {
    if (n > remaining()) truncated();
  }
  [[noreturn]] void truncated() const {
    Fail(what_, ": truncated payload (read past its end at byte ", pos_, " of ", b_.size(), ")");
  }
  std::span<const uint8_t> b_;
  const char* what_;
  size_t pos_ = 0;
};

// Prepends the container header to `payload`.
std::vector<uint8_t> WrapContainer(const char magic[4], uint16_t version,
                                   std::span<const uint8_t> payload);
// Validates the 20-byte header in `bytes` (magic, version 1..max_version,
// reserved 0) and that it declares `have` payload bytes; returns its CRC.
uint32_t CheckContainerHeader(std::span<const uint8_t> bytes, const char magic[4], uint16_t max_version,
                              const char* what, uint64_t have, uint16_t* version = nullptr);
// A container file, read header first: its magic, version and declared
// size are checked against the file's size before the rest is read (a
// 3 GiB file of anything else costs 20 bytes, not 3 GB). The CRC and
// payload are the caller's (OpenContainer). Errors name `arg` and the path.
std::vector<uint8_t> ReadContainerFile(const std::string& path, const char magic[4], uint16_t max_version,
                                       const char* what, const char* arg);
// Validates magic, version (1..max_version), size and CRC; returns the
// payload and its version. Throws kvq::Error naming `what` on any mismatch.
std::span<const uint8_t> OpenContainer(std::span<const uint8_t> bytes, const char magic[4],
                                       uint16_t max_version, const char* what,
                                       uint16_t* version = nullptr);

}  // namespace kvq::detail
