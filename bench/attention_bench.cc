// Fused decode attention: BM_decode_attention/<scheme>/<T>, one query
// position, n_heads 32, n_kv_heads 8, head_dim 128 (Llama-3-8B's attention
// geometry), 2 OpenMP threads. The fp32 rows of the same run are the bound to
// read ratios against. bytes_per_second counts the stored K and V bytes the
// call reads.
//
// BM_decode_attention reads one layer's cache again and again, so whatever
// fits the last-level cache is read from it, in part or whole (fp32 at 16K
// tokens is 128 MiB; this host's L3 is 260 MiB, shared with other guests).
// In a real decode step every layer's cache is
// read once per token, after all the other layers' caches: it comes from
// DRAM. BM_decode_attention_cold/<scheme>/<T> measures that: a KvCache of
// `layers` layers, the call on layer i % layers in iteration i, with layers
// chosen so that they hold at least 3x the last-level cache (read from
// sysfs; capped at 32, Llama-3-8B's layer count, which is what a real model
// would bring).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "kvq/attention.h"
#include "kvq/grouped_kv.h"

namespace {

constexpr int kHeads = 32, kKvHeads = 8, kHeadDim = 128, kThreads = 2;

// Deterministic, roughly Gaussian K and V rows (one large K channel): calls
// row(t, k, v) for t = 0 .. T - 1 (the grouped caches take these K rows as
// their keys before RoPE).
template <typename Fn>
void ForEachRow(int T, const Fn& row) {
  std::vector<float> k(kKvHeads * kHeadDim), v(k.size());
  uint64_t s = 99;
  auto next = [&s] {  // sum of uniforms
    float acc = 0;
    for (int i = 0; i < 4; ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      acc += static_cast<float>(static_cast<int32_t>(s >> 32)) * 0x1p-31f;
    }
    return acc;
  };
  for (int t = 0; t < T; ++t) {
    for (size_t i = 0; i < k.size(); ++i) {
      const float big = (i % 128 == 17) ? 8.0f : 1.0f;
      k[i] = big * next();
      v[i] = next();
    }
    row(t, k, v);
  }
}

// Those rows in `layers` layers of a cache.
template <typename Cache>
void Fill(Cache& cache, int layers, int T) {
  ForEachRow(T, [&](int t, const std::vector<float>& k, const std::vector<float>& v) {
    for (int l = 0; l < layers; ++l) cache.write(l, t, k, v);
  });
}

std::unique_ptr<kvq::KvCache> BuildCache(kvq::KvScheme scheme, int layers, int T) {
  auto cache = std::make_unique<kvq::KvCache>(scheme, layers, T, kKvHeads, kHeadDim);
  Fill(*cache, layers, T);
  return cache;
}

// The most recently built cache (building one takes longer than timing it).
const kvq::KvCache& CacheFor(kvq::KvScheme scheme, int layers, int T) {
  static std::unique_ptr<kvq::KvCache> cache;
  static kvq::KvScheme built_scheme;
  static int built_T = -1, built_layers = -1;
  if (!cache || built_scheme != scheme || built_T != T || built_layers != layers) {
    cache.reset();
    cache = BuildCache(scheme, layers, T);
    built_scheme = scheme;
    built_T = T;
    built_layers = layers;
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

// Layers holding >= 3x the last-level cache, in [2, 32].
int ColdLayers(kvq::KvScheme scheme, int T) {
  const kvq::KvRowCodec codec(scheme, kKvHeads * kHeadDim, kHeadDim);
  const double layer_bytes = 2.0 * static_cast<double>(T) * static_cast<double>(codec.row_bytes());
  const double want = std::ceil(3.0 * LastLevelCacheBytes() / layer_bytes);
  return static_cast<int>(std::clamp(want, 2.0, 32.0));
}

void BM_decode_attention(benchmark::State& state, kvq::KvScheme scheme, int T, bool int8_query,
                         bool cold) {
  const int layers = cold ? ColdLayers(scheme, T) : 1;
  const kvq::KvCache& cache = CacheFor(scheme, layers, T);
  std::vector<kvq::KvRowsView> views;
  for (int l = 0; l < layers; ++l) views.push_back(cache.view(l, T));
  std::vector<float> q(kHeads * kHeadDim), out(q.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * static_cast<float>(i));
  kvq::DecodeAttentionOptions o;
  o.threads = kThreads;
  o.int8_query = int8_query;
  size_t layer = 0;
  for (auto _ : state) {
    kvq::decode_attention(q, kHeads, views[layer], out, o);
    benchmark::DoNotOptimize(out.data());
    layer = layer + 1 == views.size() ? 0 : layer + 1;
  }
  const double bytes = 2.0 * static_cast<double>(T) * static_cast<double>(cache.codec().row_bytes());
  state.SetBytesProcessed(static_cast<int64_t>(bytes * static_cast<double>(state.iterations())));
  state.counters["bits"] = cache.bits_per_element();
  state.counters["layers"] = layers;
  // Multiply-adds of exact attention: q.k and p.v, head_dim each, for every
  // query head and token; as a rate, comparable across schemes.
  const double macs = 2.0 * kHeads * kHeadDim * static_cast<double>(T);
  state.counters["MAC/s"] = benchmark::Counter(macs * static_cast<double>(state.iterations()),
                                               benchmark::Counter::kIsRate);
}

// A grouped cache of the synthetic rows; allocated (k<B>a) and calibrated
// schemes get ranges measured on the first 256 rows, with the channel
// weights of a model (one large channel per head, the rest in a geometric
// spread), so the per-channel bit widths vary as they would.
std::unique_ptr<kvq::GroupedKvCache> BuildGroupedCache(const kvq::GroupedKvScheme& g, int layers, int T) {
  std::vector<std::vector<float>> k(static_cast<size_t>(layers)), v(k.size());
  ForEachRow(std::min(T, 256), [&](int, const std::vector<float>& kr, const std::vector<float>& vr) {
    for (int l = 0; l < layers; ++l) {
      k[static_cast<size_t>(l)].insert(k[static_cast<size_t>(l)].end(), kr.begin(), kr.end());
      v[static_cast<size_t>(l)].insert(v[static_cast<size_t>(l)].end(), vr.begin(), vr.end());
    }
  });
  kvq::StaticRanges r = kvq::StaticRanges::from_samples(k, v, kKvHeads, kHeadDim);
  for (size_t c = 0; c < r.k_lo.size(); ++c) {
    r.k_weight.push_back(c % kHeadDim == 17 ? 1e4f : std::pow(1.05f, static_cast<float>(c % kHeadDim)));
  }
  auto cache = std::make_unique<kvq::GroupedKvCache>(g, layers, T, kKvHeads, kHeadDim, &r);
  Fill(*cache, layers, T);
  return cache;
}

// Grouped schemes (grouped_kv.h): the cache as it stands at length T (R
// recent tokens and the open group exact in fp16, the rest in codes), the
// fused grouped kernel merged with the fp16 kernel over the exact tokens.
// bytes_per_second counts GroupedKvCache::bytes(T) for the layer.
const kvq::GroupedKvCache& GroupedCacheFor(const std::string& name, int layers, int T) {
  static std::unique_ptr<kvq::GroupedKvCache> cache;
  static std::string built_name;
  static int built_T = -1, built_layers = -1;
  if (!cache || built_name != name || built_T != T || built_layers != layers) {
    cache.reset();
    cache = BuildGroupedCache(kvq::parse_grouped_kv_scheme(name), layers, T);
    built_name = name;
    built_T = T;
    built_layers = layers;
  }
  return *cache;
}

void BM_grouped_attention(benchmark::State& state, const std::string& name, int T, bool cold) {
  const kvq::GroupedKvScheme g = kvq::parse_grouped_kv_scheme(name);
  const double layer_bytes = static_cast<double>(T) * 2.0 * kKvHeads * kHeadDim * g.bits(T) / 8.0;
  const int layers =
      cold ? static_cast<int>(std::clamp(std::ceil(3.0 * LastLevelCacheBytes() / layer_bytes), 2.0, 32.0)) : 1;
  const kvq::GroupedKvCache& cache = GroupedCacheFor(name, layers, T);
  std::vector<float> q(kHeads * kHeadDim), out(q.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * static_cast<float>(i));
  int layer = 0;
  for (auto _ : state) {
    cache.attend(layer, T, q, kHeads, out, kThreads);
    benchmark::DoNotOptimize(out.data());
    layer = layer + 1 == layers ? 0 : layer + 1;
  }
  const double bytes = static_cast<double>(cache.bytes(T)) / layers;
  state.SetBytesProcessed(static_cast<int64_t>(bytes * static_cast<double>(state.iterations())));
  state.counters["bits"] = cache.bits(T);  // measured: 8-bit fallbacks counted
  state.counters["layers"] = layers;
  const double macs = 2.0 * kHeads * kHeadDim * static_cast<double>(T);
  state.counters["MAC/s"] = benchmark::Counter(macs * static_cast<double>(state.iterations()),
                                               benchmark::Counter::kIsRate);
}

void Register(const std::string& name, kvq::KvScheme s, int T, bool int8_query, bool cold) {
  benchmark::RegisterBenchmark(name.c_str(), BM_decode_attention, s, T, int8_query, cold)
      ->Unit(benchmark::kMicrosecond)
      ->UseRealTime();
}

bool HasInt8QueryPath(kvq::KvScheme s) {
  using kvq::KvScheme;
  return s == KvScheme::Int8 || s == KvScheme::Int8Head || s == KvScheme::Q8_0 || s == KvScheme::Q4_0;
}

const int kRegistered = [] {
  using kvq::KvScheme;
  for (KvScheme s : {KvScheme::Fp32, KvScheme::Fp16, KvScheme::Bf16, KvScheme::Int8, KvScheme::Int8Head,
                     KvScheme::Fp8E4M3, KvScheme::Fp8E5M2, KvScheme::Q8_0, KvScheme::Q4_0}) {
    const std::string scheme = kvq::kv_scheme_name(s);
    for (int T : {1024, 4096, 16384, 65536}) {
      const std::string t = std::string("/").append(std::to_string(T));
      Register("BM_decode_attention/" + scheme + t, s, T, false, false);
      // The opt-in integer-score path (DecodeAttentionOptions::int8_query).
      if (HasInt8QueryPath(s)) Register("BM_decode_attention_int8q/" + scheme + t, s, T, true, false);
    }
    Register("BM_decode_attention_cold/" + scheme + "/16384", s, 16384, false, true);
    if (HasInt8QueryPath(s)) Register("BM_decode_attention_cold_int8q/" + scheme + "/16384", s, 16384, true, true);
  }
  for (const auto& [preset, g] : kvq::grouped_kv_presets()) {
    for (int T : {1024, 4096, 16384, 65536}) {
      benchmark::RegisterBenchmark(("BM_decode_attention/" + preset + "/" + std::to_string(T)).c_str(),
                                   BM_grouped_attention, preset, T, false)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
    benchmark::RegisterBenchmark(("BM_decode_attention_cold/" + preset + "/16384").c_str(), BM_grouped_attention,
                                 preset, 16384, true)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
  }
  return 0;
}();

}  // namespace
