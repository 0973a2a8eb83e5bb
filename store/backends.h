// Internal: the prefix store's backends (prefix_store.h's open_backend).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "store/prefix_store.h"

namespace kvq::store {

using WarnFn = std::function<void(const std::string&)>;

std::unique_ptr<StoreBackend> open_memory_store(const std::string& name);
std::unique_ptr<StoreBackend> open_dir_store(const std::string& dir, uint64_t max_bytes, WarnFn warn);
std::unique_ptr<StoreBackend> open_redis_store(const std::string& url, const StoreOptions& o, WarnFn warn);

// 64 lowercase hex digits.
inline std::string key_hex(const Key& k) { return hex_digest(k); }

}  // namespace kvq::store
