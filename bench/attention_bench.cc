// Fused decode attention and cache writes, every scheme through kvq::KvCache.
//
// BM_decode_attention/<scheme>/<T>: one query position, 32 query heads, 8 KV
// heads, head_dim 128 (Llama-3-8B's attention geometry), 2 OpenMP threads.
// The fp32, fp16 and q4_0 rows of the same run are the bounds to read ratios
// against; bytes_per_second counts the bytes the cache holds for the layer
// (KvCache::bytes: what a call reads).
//
// BM_decode_attention reads one layer's cache again and again, so whatever
// fits the last-level cache is read from it, in part or whole. In a real
// decode step every layer's cache is read once per token, after all the
// other layers' caches: it comes from DRAM. BM_decode_attention_cold/
// <scheme>/16384 measures that: a cache of `layers` layers, the call on
// layer i % layers in iteration i, with layers chosen so that they hold at
// least 3x the last-level cache (read from sysfs; capped at 32, Llama-3-8B's
// layer count).
//
// BM_attention_geometry/<scheme>/q<H>kv<K>/hd<D>/<T>/t<threads>: the same
// call warm for MHA (32/32), GQA 4 (32/8) and GQA 8 (32/4), head_dim 64 and
// 128, T 4096 and 16384, 1 and 2 threads.
//
// BM_token_layer_attention/<ids>/<T>/t<threads>: layer 0 of a `t0+` cache
// (token ids read through a token table of 32,000 ids, Llama-2's
// vocabulary: 131 MB of fp16 at this geometry; ids uniform, every row
// gathered from all of it, or Zipf(1.1), as a text's), K rotated at read
// and attended by the fp32 kernel. The
// bound: BM_decode_attention/fp16/<T> and /fp32/<T> of the same run (the
// layer stored as rows).
//
// BM_grouped_write/<scheme>: the amortised cost of appending one token (every
// KV head of a layer, K after RoPE and V, hand-overs included) to a cache
// that grows from 0 to 4096 tokens; memcpy of the token's fp32 bytes is the
// bound, fp16 and q4_0 the row caches to compare with. README compares it
// with BM_decode_attention/<scheme>/4096.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kvq/attention.h"
#include "kvq/kv_cache.h"
#include "kvq/token_table.h"
#include "bench/bench_util.h"

namespace {

using kvq_bench::ForEachRow;
using kvq_bench::Geo;
using kvq_bench::RangesFor;

constexpr Geo kDefault{32, 8, 128};
constexpr int kThreads = 2;

// The most recently built cache (building one takes longer than timing it).
const kvq::KvCache& CacheFor(const std::string& scheme, const Geo& g, int layers, int T) {
  static std::unique_ptr<kvq::KvCache> cache;
  static std::tuple<std::string, int, int, int, int> built;
  const auto key = std::make_tuple(scheme, g.kv, g.hd, layers, T);
  if (!cache || built != key) {
    cache.reset();
    const kvq::StaticRanges* r = kvq::describe_kv_scheme(scheme).needs_ranges ? &RangesFor(g, layers) : nullptr;
    cache = std::make_unique<kvq::KvCache>(scheme, layers, T, g.kv, g.hd, r);
    ForEachRow(T, g.kv * g.hd, g.hd, [&](int t, const std::vector<float>& k, const std::vector<float>& v) {
      for (int l = 0; l < layers; ++l) cache->write(l, t, k, v);
    });
    built = key;
  }
  return *cache;
}

// Bytes of the last-level cache (sysfs; 256 MiB when unknown).
double LastLevelCacheBytes() {
  double best = 0;
  for (int i = 0; i < 8; ++i) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/size");
    std::string text;
    if (!(f >> text) || text.empty()) continue;
    double v = std::atof(text.c_str());
    const char unit = text.back();
    if (unit == 'K') v *= 1024.0;
    if (unit == 'M') v *= 1024.0 * 1024.0;
    best = std::max(best, v);
  }
  return best > 0 ? best : 256.0 * 1024 * 1024;
}

// Layers holding >= 3x the last-level cache, in [2, 32], from the bytes one
// layer holds at T tokens.
int ColdLayers(const std::string& scheme, int T) {
  const Geo g = kDefault;
  const double layer_bytes = kvq::kv_scheme_layer_bytes(scheme, T, g.kv, g.hd);
  return static_cast<int>(std::clamp(std::ceil(3.0 * LastLevelCacheBytes() / layer_bytes), 2.0, 32.0));
}

void Attention(benchmark::State& state, const std::string& scheme, const Geo& g, int T, int threads, bool cold,
               bool int8_query) {
  const int layers = cold ? ColdLayers(scheme, T) : 1;
  const kvq::KvCache& cache = CacheFor(scheme, g, layers, T);
  std::vector<float> q(static_cast<size_t>(g.heads * g.hd)), out(q.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * static_cast<float>(i));
  kvq::DecodeAttentionOptions o;
  o.threads = threads;
  o.int8_query = int8_query;
  int layer = 0;
  for (auto _ : state) {
    cache.attend(layer, q, g.heads, out, o);
    benchmark::DoNotOptimize(out.data());
    layer = layer + 1 == layers ? 0 : layer + 1;
  }
  const double bytes = static_cast<double>(cache.bytes()) / layers;  // what one call reads
  state.SetBytesProcessed(static_cast<int64_t>(bytes * static_cast<double>(state.iterations())));
  state.counters["bits"] = cache.bits();
  state.counters["layers"] = layers;
  // Multiply-adds of exact attention: q.k and p.v, head_dim each, for every
  // query head and token; as a rate, comparable across schemes.
  const double macs = 2.0 * g.heads * g.hd * static_cast<double>(T);
  state.counters["MAC/s"] = benchmark::Counter(macs * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

// Appending tokens 0 .. 4095 to one layer, again and again (a new sequence
// each time): the amortised cost of one token, hand-overs included.
void Write(benchmark::State& state, const std::string& scheme) {
  const Geo g = kDefault;
  const int T = 4096, E = g.kv * g.hd;
  std::vector<float> rows;
  ForEachRow(T, E, g.hd, [&](int, const std::vector<float>& k, const std::vector<float>& v) {
    rows.insert(rows.end(), k.begin(), k.end());
    rows.insert(rows.end(), v.begin(), v.end());
  });
  const bool memcpy_bound = scheme == "memcpy";
  std::unique_ptr<kvq::KvCache> cache;
  std::vector<float> sink(static_cast<size_t>(T) * 2 * static_cast<size_t>(E));
  if (!memcpy_bound) {
    const kvq::StaticRanges* r = kvq::describe_kv_scheme(scheme).needs_ranges ? &RangesFor(g, 1) : nullptr;
    cache = std::make_unique<kvq::KvCache>(scheme, 1, T, g.kv, g.hd, r);
  }
  int pos = 0;
  for (auto _ : state) {
    const float* k = rows.data() + static_cast<size_t>(pos) * 2 * static_cast<size_t>(E);
    if (memcpy_bound) {
      std::memcpy(sink.data() + static_cast<size_t>(pos) * 2 * static_cast<size_t>(E), k, 2 * static_cast<size_t>(E) * sizeof(float));
      benchmark::ClobberMemory();
    } else {
      cache->write(0, pos, {k, static_cast<size_t>(E)}, {k + E, static_cast<size_t>(E)});
    }
    pos = pos + 1 == T ? 0 : pos + 1;
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 2 * E * static_cast<int64_t>(sizeof(float)));
}

// Layer 0 of a t0+fp16 cache of T tokens over a 32,000-id table: ids drawn
// uniformly (every row a fresh gather: the worst case) or Zipf-distributed
// with exponent 1.1 (a text's: frequent ids' rows stay in cache).
void TokenLayer(benchmark::State& state, const std::string& ids, const Geo& g, int T, int threads, bool, bool) {
  constexpr int kVocab = 32000;
  static std::unique_ptr<kvq::KvCache> cache;
  static std::pair<int, std::string> built;
  if (!cache || built != std::make_pair(T, ids)) {
    cache.reset();
    const size_t E = static_cast<size_t>(g.kv * g.hd);
    std::vector<float> k(kVocab * E), v(k.size());
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = std::sin(0.001f * static_cast<float>(i % 100003)), v[i] = std::cos(0.0007f * static_cast<float>(i % 99991));
    }
    auto table = std::make_shared<const kvq::TokenTable>(kVocab, g.kv, g.hd, k, v);
    cache = std::make_unique<kvq::KvCache>("t0+fp16", 2, T, g.kv, g.hd, nullptr, kvq::RopeConfig{}, table);
    std::vector<double> cdf(kVocab);  // Zipf(1.1) over ids 0 .. kVocab - 1
    double sum = 0;
    for (int i = 0; i < kVocab; ++i) cdf[static_cast<size_t>(i)] = sum += std::pow(i + 1.0, -1.1);
    uint64_t x = 88172645463325252ull;
    for (int t = 0; t < T; ++t) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      int id = static_cast<int>(x % kVocab);
      if (ids == "zipf") {
        const double u = static_cast<double>(x >> 11) * 0x1.0p-53 * sum;
        id = static_cast<int>(std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
        id = std::min(id, kVocab - 1);
      }
      cache->write(0, t, {k.data(), E}, {v.data(), E}, id);
    }
    built = {T, ids};
  }
  std::vector<float> q(static_cast<size_t>(g.heads * g.hd)), out(q.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * static_cast<float>(i));
  kvq::DecodeAttentionOptions o;
  o.threads = threads;
  for (auto _ : state) {
    cache->attend(0, q, g.heads, out, o);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(static_cast<double>(cache->layer_bytes(0)) *
                                               static_cast<double>(state.iterations())));
  state.counters["table_MB"] = static_cast<double>(cache->token_table()->bytes()) / 1e6;
  const double macs = 2.0 * g.heads * g.hd * static_cast<double>(T);
  state.counters["MAC/s"] = benchmark::Counter(macs * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

bool HasInt8QueryPath(const std::string& s) { return s == "int8" || s == "int8-head" || s == "q8_0" || s == "q4_0"; }

void Reg(const std::string& name, void (*fn)(benchmark::State&, const std::string&, const Geo&, int, int, bool, bool),
         const std::string& scheme, const Geo& g, int T, int threads, bool cold, bool iq) {
  benchmark::RegisterBenchmark(name.c_str(), fn, scheme, g, T, threads, cold, iq)->Unit(benchmark::kMicrosecond)->UseRealTime();
}

const int kRegistered = [] {
  std::vector<std::string> rows = {"fp32", "fp16", "bf16", "int8", "int8-head", "fp8-e4m3", "fp8-e5m2", "q8_0", "q4_0"};
  std::vector<std::string> presets;
  for (const auto& [name, s] : kvq::grouped_kv_presets()) presets.push_back(name);
  std::vector<std::string> all = rows;
  all.insert(all.end(), presets.begin(), presets.end());
  for (const std::string& s : all) {
    for (int T : {1024, 4096, 16384, 65536}) {
      const std::string t = "/" + std::to_string(T);
      Reg("BM_decode_attention/" + s + t, Attention, s, kDefault, T, kThreads, false, false);
      // The opt-in integer-score path of the row kernels (DecodeAttentionOptions::int8_query).
      if (HasInt8QueryPath(s)) Reg("BM_decode_attention_int8q/" + s + t, Attention, s, kDefault, T, kThreads, false, true);
    }
    Reg("BM_decode_attention_cold/" + s + "/16384", Attention, s, kDefault, 16384, kThreads, true, false);
    if (HasInt8QueryPath(s)) Reg("BM_decode_attention_cold_int8q/" + s + "/16384", Attention, s, kDefault, 16384, kThreads, true, true);
  }
  for (const char* ids : {"uniform", "zipf"}) {
    for (int T : {4096, 16384}) {
      for (int threads : {1, 2}) {
        Reg("BM_token_layer_attention/" + std::string(ids) + "/" + std::to_string(T) + "/t" + std::to_string(threads),
            TokenLayer, ids, kDefault, T, threads, false, false);
      }
    }
  }
  std::vector<std::string> geo_schemes = {"fp32", "fp16", "q4_0"};
  geo_schemes.insert(geo_schemes.end(), presets.begin(), presets.end());
  for (const Geo& g : {Geo{32, 32, 128}, Geo{32, 8, 128}, Geo{32, 4, 128}, Geo{32, 32, 64}, Geo{32, 8, 64}, Geo{32, 4, 64}}) {
    for (int T : {4096, 16384}) {
      for (const std::string& s : geo_schemes) {
        for (int threads : {1, 2}) {
          Reg("BM_attention_geometry/" + s + "/q" + std::to_string(g.heads) + "kv" + std::to_string(g.kv) + "/hd" +
                  std::to_string(g.hd) + "/" + std::to_string(T) + "/t" + std::to_string(threads),
              Attention, s, g, T, threads, false, false);
        }
      }
    }
  }
  std::vector<std::string> writes = {"memcpy", "fp16", "q4_0"};
  writes.insert(writes.end(), presets.begin(), presets.end());
  for (const std::string& s : writes) {
    benchmark::RegisterBenchmark(("BM_grouped_write/" + s).c_str(), Write, s)->Unit(benchmark::kMicrosecond);
  }
  return 0;
}();

}  // namespace
