// The prefix store (store/prefix_store.h) on Llama-3-8B's attention geometry:
// 32 layers, 8 KV heads, head_dim 128, chunks of 256 tokens (288 for groups
// of 96; chunk ends offset by the recent window, store/prefix_store.h's
// ChunkPlan). One chunk is the second of a prompt (a steady one: its value holds
// the groups handed over in it and what is open at its end).
//
// BM_prefix_put/<backend>/<scheme>, BM_prefix_get/<backend>/<scheme>: one
// chunk's value into / out of the backend (a rotation of 8 keys); backends
// memory:, a directory under $TMPDIR (each put written to a temporary file,
// synced and renamed) and, when KVQ_BENCH_REDIS names a server
// (redis://127.0.0.1:port), Redis. BM_prefix_memcpy/<scheme>: memcpy of the
// same bytes, the bound. BM_prefix_restore/<scheme>: the CPU side of a hit,
// KvCache::restore_ranges of chunks 0 and 1 (CRC, checks, decoding into
// the cache), per chunk. Counters: chunk_bytes, bytes_per_token (of the
// chunk measured), chunk_tokens; bytes_per_second: of the value.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "kvq/kv_cache.h"
#include "store/backends.h"
#include "store/prefix_store.h"

namespace {

using kvq_bench::ForEachRow;
using kvq_bench::Geo;
using kvq_bench::RangesFor;
namespace store = kvq::store;

constexpr Geo kLlama3_8B{32, 8, 128};
constexpr int kLayers = 32;
constexpr int kChunk = 256;

struct Chunks {
  store::ChunkPlan plan;
  int C = 0;
  std::vector<std::vector<uint8_t>> values;  // chunks 0 and 1
  std::vector<store::Key> keys;
  const kvq::StaticRanges* ranges = nullptr;
};

kvq::KvCache Empty(const std::string& scheme, const kvq::StaticRanges* r) {
  return kvq::KvCache(scheme, kLayers, 4 * kChunk, kLlama3_8B.kv, kLlama3_8B.hd, r);
}

const Chunks& ChunksFor(const std::string& scheme) {
  static std::map<std::string, Chunks> built;
  auto it = built.find(scheme);
  if (it != built.end()) return it->second;
  Chunks c;
  c.ranges = kvq::describe_kv_scheme(scheme).needs_ranges ? &RangesFor(kLlama3_8B, kLayers) : nullptr;
  kvq::KvCache cache = Empty(scheme, c.ranges);
  c.plan = store::chunk_plan(cache, kChunk);
  c.C = c.plan.tokens;
  std::vector<int> tokens(static_cast<size_t>(c.plan.end(1)));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int>(i * 7919 % 32000);
  c.keys = store::chunk_keys(cache, tokens, c.C, std::nullopt);
  ForEachRow(static_cast<int>(c.plan.end(1)), kLlama3_8B.kv * kLlama3_8B.hd, kLlama3_8B.hd,
             [&](int t, const std::vector<float>& k, const std::vector<float>& v) {
               for (int l = 0; l < kLayers; ++l) cache.write(l, t, k, v);
               if (c.plan.is_end(t + 1)) {
                 const int64_t i = static_cast<int64_t>(c.values.size());
                 c.values.push_back(cache.range_to_bytes(c.plan.begin(i), -1, c.keys[static_cast<size_t>(i)]));
               }
             });
  return built.emplace(scheme, std::move(c)).first->second;
}

void Counters(benchmark::State& state, const Chunks& c) {
  const size_t n = c.values[1].size();
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(n));
  state.counters["chunk_bytes"] = static_cast<double>(n);
  state.counters["bytes_per_token"] = static_cast<double>(n) / c.C;
  state.counters["chunk_tokens"] = c.C;
}

std::string BenchDir() {
  static const std::string d = [] {
    const char* t = std::getenv("TMPDIR");
    const std::string dir = std::string(t && *t ? t : "/tmp") + "/kvq_prefix_bench_" + std::to_string(::getpid());
    std::filesystem::remove_all(dir);
    std::atexit([] { std::filesystem::remove_all(BenchDir()); });
    return dir;
  }();
  return d;
}

std::unique_ptr<store::StoreBackend> Open(const std::string& backend) {
  store::StoreOptions o;
  o.warn = [](const std::string& s) { std::fprintf(stderr, "prefix bench: %s\n", s.c_str()); };
  if (backend == "redis") return store::open_backend(std::getenv("KVQ_BENCH_REDIS"), o);
  if (backend == "dir") return store::open_backend(BenchDir(), o);
  return store::open_backend("memory:bench", o);
}

// Distinct keys for the rotation (the chunk's key with its last byte varied).
store::Key Rotated(const store::Key& k, int64_t i) {
  store::Key r = k;
  r[31] = static_cast<uint8_t>(r[31] ^ (i & 7));
  return r;
}

void Put(benchmark::State& state, const std::string& backend, const std::string& scheme) {
  const Chunks& c = ChunksFor(scheme);
  auto b = Open(backend);
  int64_t i = 0;
  for (auto _ : state) {
    const store::Key chain[2] = {c.keys[0], Rotated(c.keys[1], i++)};
    b->put(chain, c.values[1]);
  }
  if (!b->alive()) state.SkipWithError("the backend gave up");
  Counters(state, c);
}

void Get(benchmark::State& state, const std::string& backend, const std::string& scheme) {
  const Chunks& c = ChunksFor(scheme);
  auto b = Open(backend);
  for (int64_t i = 0; i < 8; ++i) {
    const store::Key chain[2] = {c.keys[0], Rotated(c.keys[1], i)};
    b->put(chain, c.values[1]);
  }
  int64_t i = 0;
  for (auto _ : state) {
    const store::Key k = Rotated(c.keys[1], i++);
    auto v = b->get(std::span(&k, 1));
    if (!v[0] || v[0]->size() != c.values[1].size()) {
      state.SkipWithError("a miss");
      break;
    }
    benchmark::DoNotOptimize(v[0]->data());
  }
  Counters(state, c);
}

void Memcpy(benchmark::State& state, const std::string& scheme) {
  const Chunks& c = ChunksFor(scheme);
  std::vector<uint8_t> dst(c.values[1].size());
  for (auto _ : state) {
    std::memcpy(dst.data(), c.values[1].data(), dst.size());
    benchmark::ClobberMemory();
  }
  Counters(state, c);
}

void Restore(benchmark::State& state, const std::string& scheme) {
  const Chunks& c = ChunksFor(scheme);
  kvq::KvCache cache = Empty(scheme, c.ranges);
  const std::vector<std::span<const uint8_t>> parts = {c.values[0], c.values[1]};
  const std::vector<int64_t> ends = {c.plan.end(0), c.plan.end(1)};
  for (auto _ : state) cache.restore_ranges(parts, ends, c.keys);
  Counters(state, c);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(c.values[0].size() + c.values[1].size()));
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * 2);  // chunks
}

const int kRegistered = [] {
  std::vector<std::string> schemes = {"fp16", "q8_0", "q4_0"};
  for (const auto& [name, s] : kvq::grouped_kv_presets()) schemes.push_back(name);
  std::vector<std::string> backends = {"memory", "dir"};
  if (const char* r = std::getenv("KVQ_BENCH_REDIS"); r && *r) backends.push_back("redis");
  for (const std::string& s : schemes) {
    benchmark::RegisterBenchmark(("BM_prefix_memcpy/" + s).c_str(), Memcpy, s)->Unit(benchmark::kMicrosecond);
    for (const std::string& b : backends) {
      benchmark::RegisterBenchmark(("BM_prefix_put/" + b + "/" + s).c_str(), Put, b, s)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
      benchmark::RegisterBenchmark(("BM_prefix_get/" + b + "/" + s).c_str(), Get, b, s)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
    benchmark::RegisterBenchmark(("BM_prefix_restore/" + s).c_str(), Restore, s)->Unit(benchmark::kMicrosecond);
  }
  return 0;
}();

}  // namespace
