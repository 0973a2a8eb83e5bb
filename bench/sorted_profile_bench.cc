// G4 sorted-profile quantizer throughput on 2^20 Gaussian values (4 MiB of
// float32), next to its two bounds in the same run: memcpy of the same bytes
// and the sort (Highway vqsort) that the KS receipt needs (the fit's dominant cost).
// bytes_processed is the float32 input size everywhere.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "hwy/contrib/sort/vqsort.h"
#include "kvq/sorted_profile.h"

namespace {

constexpr size_t kN = size_t{1} << 20;

const std::vector<float>& Values() {
  static const std::vector<float> v = [] {
    std::vector<float> x(kN);
    uint64_t s = 777;
    for (size_t i = 0; i < kN; i += 2) {  // Box–Muller on an LCG, deterministic
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      const double u1 = (static_cast<double>(s >> 11) + 0.5) * 0x1p-53;
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      const double u2 = (static_cast<double>(s >> 11) + 0.5) * 0x1p-53;
      const double r = std::sqrt(-2.0 * std::log(u1));
      x[i] = static_cast<float>(r * std::cos(2 * M_PI * u2));
      x[i + 1] = static_cast<float>(r * std::sin(2 * M_PI * u2));
    }
    return x;
  }();
  return v;
}

void SetBytes(benchmark::State& state) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(kN * 4));
}

void BM_sorted_profile_memcpy(benchmark::State& state) {
  const auto& v = Values();
  std::vector<float> out(kN);
  for (auto _ : state) {
    std::memcpy(out.data(), v.data(), kN * 4);
    benchmark::ClobberMemory();
  }
  SetBytes(state);
}

void BM_sorted_profile_sort(benchmark::State& state) {
  const auto& v = Values();
  std::vector<float> s(kN);
  const hwy::Sorter sorter;
  for (auto _ : state) {
    std::memcpy(s.data(), v.data(), kN * 4);
    sorter(s.data(), kN, hwy::SortAscending());
    benchmark::DoNotOptimize(s.data());
  }
  SetBytes(state);
}

// Args: bits, top_k.
void BM_fit_sorted_profile(benchmark::State& state) {
  kvq::SortedProfileOptions o;
  o.bits = static_cast<int>(state.range(0));
  o.top_k = static_cast<int>(state.range(1));
  const kvq::GaussianEstimator g;
  kvq::standard_codebook(g, o.codebook, o.bits);  // codebook cache warm
  for (auto _ : state) {
    auto e = kvq::fit_sorted_profile(Values(), g, o);
    benchmark::DoNotOptimize(e.codes.data());
  }
  SetBytes(state);
}

void BM_decode_sorted_profile(benchmark::State& state) {
  kvq::SortedProfileOptions o;
  o.bits = static_cast<int>(state.range(0));
  o.top_k = static_cast<int>(state.range(1));
  const auto e = kvq::fit_sorted_profile(Values(), kvq::GaussianEstimator(), o);
  std::vector<float> out(kN);
  for (auto _ : state) {
    kvq::decode_into(e, out);
    benchmark::ClobberMemory();
  }
  SetBytes(state);
}

BENCHMARK(BM_sorted_profile_memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_sorted_profile_sort)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_fit_sorted_profile)->ArgNames({"bits", "top_k"})->Args({4, 0})->Args({4, 64})->Args({8, 0})->Args({3, 0})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_decode_sorted_profile)->ArgNames({"bits", "top_k"})->Args({4, 0})->Args({4, 64})->Args({8, 0})->Args({3, 0})->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
