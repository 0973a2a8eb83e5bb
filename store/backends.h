// Internal: the prefix store's backends (prefix_store.h's open_backend).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "store/prefix_store.h"

namespace kvq::store {

using WarnFn = std::function<void(const std::string&)>;

std::unique_ptr<StoreBackend> open_memory_store(const std::string& name, uint64_t max_bytes);
std::unique_ptr<StoreBackend> open_dir_store(const std::string& dir, uint64_t max_bytes, WarnFn warn);
std::unique_ptr<StoreBackend> open_redis_store(const std::string& url, const StoreOptions& o, WarnFn warn);

// Directory scans by size-capped directory stores in this process (a test
// counts them: a write must not rescan a large directory each time).
extern std::atomic<uint64_t> dir_store_scans;

// Redis Cluster's slot of a key: CRC16-XMODEM of the key, or of its hash
// tag (the text between the first '{' and the next '}', when not empty),
// mod 16384.
int redis_key_slot(std::string_view key);

// 64 lowercase hex digits.
inline std::string key_hex(const Key& k) { return hex_digest(k); }

}  // namespace kvq::store
