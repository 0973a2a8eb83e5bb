// The in-process store: a map per name, shared by the process's stores of
// that name (kvq serve's conversations, tests, Python), with an optional
// cap in bytes: past it the least recently used chunks go first.
#include <list>
#include <map>
#include <mutex>

#include "store/backends.h"

namespace kvq::store {
namespace {

struct Shared {
  struct Entry {
    std::vector<uint8_t> value;
    std::list<Key>::iterator use;  // its place in `lru`
  };
  std::mutex mu;
  std::map<Key, Entry> entries;
  std::list<Key> lru;  // most recently used first
  uint64_t bytes = 0, max_bytes = 0;  // 0: no cap

  void used(Entry& e) { lru.splice(lru.begin(), lru, e.use); }
  void erase(std::map<Key, Entry>::iterator it) {
    bytes -= it->second.value.size();
    lru.erase(it->second.use);
    entries.erase(it);
  }
};

std::shared_ptr<Shared> Named(const std::string& name, uint64_t max_bytes) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<Shared>> all;
  std::lock_guard<std::mutex> lock(mu);
  auto& s = all[name];
  if (!s) s = std::make_shared<Shared>();
  if (max_bytes > 0) {  // the latest cap given holds for every store of the name
    std::lock_guard<std::mutex> l(s->mu);
    s->max_bytes = max_bytes;
  }
  return s;
}

class MemoryStore final : public StoreBackend {
 public:
  MemoryStore(std::string name, uint64_t max_bytes) : name_(std::move(name)), s_(Named(name_, max_bytes)) {}
  std::string describe() const override { return "memory:" + name_; }
  std::vector<std::optional<uint64_t>> sizes(std::span<const Key> keys) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    std::vector<std::optional<uint64_t>> out;
    for (const Key& k : keys) {
      auto it = s_->entries.find(k);
      out.push_back(it == s_->entries.end() ? std::nullopt : std::optional<uint64_t>(it->second.value.size()));
    }
    return out;
  }
  std::vector<std::optional<std::vector<uint8_t>>> get(std::span<const Key> keys) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    std::vector<std::optional<std::vector<uint8_t>>> out;
    for (const Key& k : keys) {
      auto it = s_->entries.find(k);
      out.push_back(it == s_->entries.end() ? std::nullopt : std::optional(it->second.value));
    }
    return out;
  }
  bool put(std::span<const Key> chain, std::span<const uint8_t> value) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    Shared& s = *s_;
    if (s.max_bytes > 0 && value.size() > s.max_bytes) return false;  // it would evict itself
    auto it = s.entries.find(chain.back());
    if (it != s.entries.end()) s.erase(it);
    s.lru.push_front(chain.back());
    Shared::Entry& e = s.entries[chain.back()];
    e.value.assign(value.begin(), value.end());
    e.use = s.lru.begin();
    s.bytes += value.size();
    // Evicted least recently used first; the chain's earlier chunks become
    // more recent than this one (without them it is unusable), chunk 0 the
    // most recent of all.
    touch_locked(chain.first(chain.size() - 1));
    while (s.max_bytes > 0 && s.bytes > s.max_bytes) s.erase(s.entries.find(s.lru.back()));
    return s.entries.count(chain.back()) > 0;
  }
  std::optional<uint64_t> held_bytes() override {
    std::lock_guard<std::mutex> lock(s_->mu);
    return s_->bytes;
  }
  void touch(std::span<const Key> chain) override {
    std::lock_guard<std::mutex> lock(s_->mu);
    touch_locked(chain);
  }

 private:
  // Chunk 0 ends the most recent.
  void touch_locked(std::span<const Key> chain) {
    for (size_t i = chain.size(); i-- > 0;) {
      auto it = s_->entries.find(chain[i]);
      if (it != s_->entries.end()) s_->used(it->second);
    }
  }
  std::string name_;
  std::shared_ptr<Shared> s_;
};

}  // namespace

std::unique_ptr<StoreBackend> open_memory_store(const std::string& name, uint64_t max_bytes) {
  return std::make_unique<MemoryStore>(name, max_bytes);
}

}  // namespace kvq::store
