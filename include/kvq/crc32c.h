// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of every
// kvq serialised format (SPEC §9). Debian 12 ships no C/C++ CRC32C library,
// so this is a slicing-by-8 table implementation with a known-answer test.
#pragma once

#include <cstdint>
#include <span>

namespace kvq {

// CRC32C of `bytes`, continuing from `crc` (0 for a fresh checksum).
// crc32c("123456789") == 0xE3069283.
uint32_t crc32c(std::span<const uint8_t> bytes, uint32_t crc = 0);

}  // namespace kvq
