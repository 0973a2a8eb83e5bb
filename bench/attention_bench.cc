// Fused decode attention: BM_decode_attention/<scheme>/<T>, one query
// position, n_heads 32, n_kv_heads 8, head_dim 128, 2 OpenMP threads. The
// fp32 rows of the same run are the bound to read ratios against.
// bytes_per_second counts the stored K and V bytes the call reads.
#include <benchmark/benchmark.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "kvq/attention.h"

namespace {

constexpr int kHeads = 32, kKvHeads = 8, kHeadDim = 128, kThreads = 2;

// The most recently built cache (building one takes longer than timing it).
const kvq::KvCache& CacheFor(kvq::KvScheme scheme, int T) {
  static std::unique_ptr<kvq::KvCache> cache;
  static kvq::KvScheme built_scheme;
  static int built_T = -1;
  if (!cache || built_scheme != scheme || built_T != T) {
    cache.reset();
    cache = std::make_unique<kvq::KvCache>(scheme, 1, T, kKvHeads, kHeadDim);
    std::vector<float> k(kKvHeads * kHeadDim), v(k.size());
    uint64_t s = 99;
    auto next = [&s] {  // deterministic, roughly Gaussian (sum of uniforms)
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
      cache->write(0, t, k, v);
    }
    built_scheme = scheme;
    built_T = T;
  }
  return *cache;
}

void BM_decode_attention(benchmark::State& state, kvq::KvScheme scheme, int T, bool int8_query) {
  const kvq::KvCache& cache = CacheFor(scheme, T);
  const kvq::KvRowsView view = cache.view(0, T);
  std::vector<float> q(kHeads * kHeadDim), out(q.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * static_cast<float>(i));
  kvq::DecodeAttentionOptions o;
  o.threads = kThreads;
  o.int8_query = int8_query;
  for (auto _ : state) {
    kvq::decode_attention(q, kHeads, view, out, o);
    benchmark::DoNotOptimize(out.data());
  }
  const double bytes = 2.0 * static_cast<double>(T) * static_cast<double>(cache.codec().row_bytes());
  state.SetBytesProcessed(static_cast<int64_t>(bytes * static_cast<double>(state.iterations())));
  state.counters["bits"] = cache.bits_per_element();
  // Multiply-adds of exact attention: q.k and p.v, head_dim each, for every
  // query head and token; as a rate, comparable across schemes.
  const double macs = 2.0 * kHeads * kHeadDim * static_cast<double>(T);
  state.counters["MAC/s"] = benchmark::Counter(macs * static_cast<double>(state.iterations()),
                                               benchmark::Counter::kIsRate);
}

const int kRegistered = [] {
  using kvq::KvScheme;
  for (KvScheme s : {KvScheme::Fp32, KvScheme::Fp16, KvScheme::Bf16, KvScheme::Int8, KvScheme::Int8Head,
                     KvScheme::Fp8E4M3, KvScheme::Fp8E5M2, KvScheme::Q8_0, KvScheme::Q4_0}) {
    for (int T : {1024, 4096, 16384, 65536}) {
      const std::string name = std::string("BM_decode_attention/") + kvq::kv_scheme_name(s) + "/" + std::to_string(T);
      benchmark::RegisterBenchmark(name.c_str(), BM_decode_attention, s, T, false)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
      // The opt-in integer-score path (DecodeAttentionOptions::int8_query).
      if (s == KvScheme::Int8 || s == KvScheme::Int8Head || s == KvScheme::Q8_0 || s == KvScheme::Q4_0) {
        const std::string iq = std::string("BM_decode_attention_int8q/") + kvq::kv_scheme_name(s) + "/" + std::to_string(T);
        benchmark::RegisterBenchmark(iq.c_str(), BM_decode_attention, s, T, true)
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
      }
    }
  }
  return 0;
}();

}  // namespace
