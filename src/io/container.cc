#include "src/io/container.h"

#include "kvq/crc32c.h"
#include "kvq/file.h"

namespace kvq::detail {

std::vector<uint8_t> WrapContainer(const char magic[4], uint16_t version,
                                   std::span<const uint8_t> payload) {
  ByteWriter w;
  w.put_array(std::span<const char>(magic, 4));
  w.put<uint16_t>(version);
  w.put<uint16_t>(0);
  w.put<uint64_t>(payload.size());
  w.put<uint32_t>(crc32c(payload));
  w.put_array(payload);
  return std::move(w.bytes());
}

uint32_t CheckContainerHeader(std::span<const uint8_t> bytes, const char magic[4], uint16_t max_version,
                              const char* what, uint64_t have, uint16_t* version) {
  if (bytes.size() < kContainerHeaderBytes) {
    Fail(what, ": truncated: ", bytes.size(), " bytes, the header alone is ",
         kContainerHeaderBytes);
  }
  if (std::memcmp(bytes.data(), magic, 4) != 0) {
    Fail(what, ": bad magic (expected \"", std::string(magic, 4), "\")");
  }
  ByteReader r(bytes.subspan(4, kContainerHeaderBytes - 4), what);
  const uint16_t ver = r.get<uint16_t>();
  const uint16_t reserved = r.get<uint16_t>();
  const uint64_t size = r.get<uint64_t>();
  const uint32_t crc = r.get<uint32_t>();
  if (ver == 0 || ver > max_version) {
    Fail(what, ": unsupported format version ", ver, " (this build reads 1..", max_version, ")");
  }
  if (reserved != 0) Fail(what, ": reserved header field is ", reserved, ", expected 0");
  if (size != have) {
    Fail(what, ": payload size is ", have, " bytes but the header says ", size,
         size > have ? " (truncated)" : " (trailing bytes)");
  }
  if (version) *version = ver;
  return crc;
}

std::span<const uint8_t> OpenContainer(std::span<const uint8_t> bytes, const char magic[4],
                                       uint16_t max_version, const char* what,
                                       uint16_t* version) {
  const uint64_t have = bytes.size() < kContainerHeaderBytes ? 0 : bytes.size() - kContainerHeaderBytes;
  const uint32_t crc = CheckContainerHeader(bytes, magic, max_version, what, have, version);
  const auto payload = bytes.subspan(kContainerHeaderBytes);
  if (crc32c(payload) != crc) Fail(what, ": CRC32C mismatch (corrupted payload)");
  return payload;
}

std::vector<uint8_t> ReadContainerFile(const std::string& path, const char magic[4], uint16_t max_version,
                                       const char* what, const char* arg) {
  uint64_t size = 0;
  const std::vector<uint8_t> head = read_file_head(path, kContainerHeaderBytes, &size, arg);
  try {
    CheckContainerHeader(head, magic, max_version, what, size < kContainerHeaderBytes ? 0 : size - kContainerHeaderBytes);
  } catch (const Error& e) {
    Fail(arg, " '", path, "': ", e.what());
  }
  return read_file_whole(path, size, arg);
}

}  // namespace kvq::detail
