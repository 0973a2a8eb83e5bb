// Chunked prefill over a compressed cache (KvCache::prefill): a block of
// `queries` consecutive positions written and attended, each query reading
// the cache as decoding sees it, after a prefix of T - queries tokens.
// Geometry: Llama-3.2-1B's attention (32 query heads, 8 KV heads, head size
// 64), one layer. The bounding reference is the same call on an fp32 cache
// (BM_prefill_attention/fp32/...) in the same binary; the counters give
// queries per second and the ratio to fp32 is read off the times.
//
//   build/release/bench/kvq_bench --benchmark_filter=BM_prefill_attention
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "kvq/grouped_kv.h"
#include "kvq/kv_cache.h"

namespace {

using kvq_bench::ForEachRow;
using kvq_bench::Geo;
using kvq_bench::RangesFor;

constexpr Geo kLlama1B{32, 8, 64};

void Prefill(benchmark::State& state, const std::string& scheme, int T, int queries, int threads) {
  const Geo g = kLlama1B;
  const int E = g.kv * g.hd, Q = g.heads * g.hd, P = T - queries;
  const kvq::StaticRanges* r = kvq::describe_kv_scheme(scheme).needs_ranges ? &RangesFor(g, 1) : nullptr;
  kvq::KvCache prefix(scheme, 1, T, g.kv, g.hd, r);
  std::vector<float> k(static_cast<size_t>(queries) * E), v(k.size()), q(static_cast<size_t>(queries) * Q),
      out(q.size());
  ForEachRow(T, E, g.hd, [&](int t, const std::vector<float>& kr, const std::vector<float>& vr) {
    if (t < P) {
      prefix.write(0, t, kr, vr);
      return;
    }
    const size_t i = static_cast<size_t>(t - P);
    std::copy(kr.begin(), kr.end(), k.begin() + static_cast<std::ptrdiff_t>(i * E));
    std::copy(vr.begin(), vr.end(), v.begin() + static_cast<std::ptrdiff_t>(i * E));
    for (int h = 0; h < g.heads; ++h) {  // the query: its own token's key, per head (a realistic score spread)
      std::copy(kr.begin() + (h / (g.heads / g.kv)) * g.hd, kr.begin() + (h / (g.heads / g.kv) + 1) * g.hd,
                q.begin() + static_cast<std::ptrdiff_t>(i * Q + static_cast<size_t>(h) * g.hd));
    }
  });
  kvq::DecodeAttentionOptions o;
  o.threads = threads;
  for (auto _ : state) {
    state.PauseTiming();
    kvq::KvCache c = prefix.Copy();
    state.ResumeTiming();
    c.prefill(0, P, k, v, q, g.heads, out, o);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.counters["queries/s"] = benchmark::Counter(static_cast<double>(queries) * state.iterations(),
                                                   benchmark::Counter::kIsRate);
  state.counters["bytes"] = static_cast<double>(prefix.bytes(P));
}

const int kRegistered = [] {
  for (const std::string s : {"fp32", "fp16", "q8_0", "q4_0", "kvq-6.5", "kvq-4.5", "kvq-3.5", "kvq-2.5"}) {
    for (const auto& [T, queries] : {std::pair{512, 512}, std::pair{2048, 256}, std::pair{8192, 512}}) {
      const std::string name = "BM_prefill_attention/" + s + "/" + std::to_string(T) + "/" + std::to_string(queries);
      benchmark::RegisterBenchmark(name.c_str(), Prefill, s, T, queries, 2)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  return 0;
}();

}  // namespace
