// The in-process store: a map per name, shared by the process's stores of
// that name (tests, Python).
#include <map>
#include <mutex>

#include "store/backends.h"

namespace kvq::store {
namespace {

struct Shared {
  std::mutex mu;
  std::map<Key, std::vector<uint8_t>> entries;
};

std::shared_ptr<Shared> Named(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<Shared>> all;
  std::lock_guard<std::mutex> lock(mu);
  auto& s = all[name];
  if (!s) s = std::make_shared<Shared>();
  return s;
}

class MemoryStore final : public StoreBackend {
 public:
  explicit MemoryStore(std::string name) : name_(std::move(name)), s_(Named(name_)) {}
  std::string describe() const override { return "memory:" + name_; }
  std::vector<std::optional<uint64_t>> sizes(std::span<const Key> keys) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    std::vector<std::optional<uint64_t>> out;
    for (const Key& k : keys) {
      auto it = s_->entries.find(k);
      out.push_back(it == s_->entries.end() ? std::nullopt : std::optional<uint64_t>(it->second.size()));
    }
    return out;
  }
  std::vector<std::optional<std::vector<uint8_t>>> get(std::span<const Key> keys) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    std::vector<std::optional<std::vector<uint8_t>>> out;
    for (const Key& k : keys) {
      auto it = s_->entries.find(k);
      out.push_back(it == s_->entries.end() ? std::nullopt : std::optional(it->second));
    }
    return out;
  }
  bool put(std::span<const Key> chain, std::span<const uint8_t> value) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->entries[chain.back()].assign(value.begin(), value.end());
    return true;
  }

 private:
  std::string name_;
  std::shared_ptr<Shared> s_;
};

}  // namespace

std::unique_ptr<StoreBackend> open_memory_store(const std::string& name) { return std::make_unique<MemoryStore>(name); }

}  // namespace kvq::store
