// kvq_bench: codec throughput against memcpy of the same bytes, in one run.
//
// All codec benchmarks work on one 128 MiB float32 tensor of shape
// (1, 32, 8192, 128) and set bytes_processed to its float32 size, so their
// bytes_per_second compare directly with BM_memcpy. The argument is the
// OpenMP thread count (`/threads:1`, `/threads:2`).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "hwy/targets.h"
#include "kvq/affine.h"
#include "kvq/error.h"
#include "kvq/targets.h"
#include "kvq/tensor.h"

namespace {

using kvq::AffineQuantized;
using kvq::QuantMode;
using kvq::Tensor;

const kvq::Shape kShape = {1, 32, 8192, 128};

// Deterministic LLM-like data: smooth values with a few large channels.
const Tensor& Input() {
  static const Tensor t = [] {
    Tensor x(kShape, kvq::DType::F32);
    float* p = x.data_as<float>();
    uint64_t s = 12345;
    for (int64_t i = 0; i < x.numel(); ++i) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      const float u = static_cast<float>(static_cast<int32_t>(s >> 32)) * 0x1p-31f;
      p[i] = (i % 128 == 17) ? 40.0f * u : u;
    }
    return x;
  }();
  return t;
}

void SetThreads(benchmark::State& state) { omp_set_num_threads(static_cast<int>(state.range(0))); }

void Finish(benchmark::State& state) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) *
                          static_cast<int64_t>(Input().nbytes()));
}

void BM_memcpy(benchmark::State& state) {
  SetThreads(state);
  const Tensor& x = Input();
  Tensor y = Tensor::Uninitialized(x.shape(), x.dtype());
  std::memset(y.data(), 0, y.nbytes());  // fault pages in before timing
  const int threads = static_cast<int>(state.range(0));
  const size_t n = x.nbytes();
  for (auto _ : state) {
    // Split like the kernels do so the 2-thread reference is comparable.
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; ++t) {
      const size_t b = n * static_cast<size_t>(t) / static_cast<size_t>(threads);
      const size_t e = n * static_cast<size_t>(t + 1) / static_cast<size_t>(threads);
      std::memcpy(static_cast<char*>(y.data()) + b, static_cast<const char*>(x.data()) + b, e - b);
    }
    benchmark::ClobberMemory();
  }
  Finish(state);
}

void BM_quantize(benchmark::State& state, QuantMode mode) {
  SetThreads(state);
  const Tensor& x = Input();
  AffineQuantized q;
  kvq::quantize_kv_cache_into(x, mode, q);  // allocate + fault in
  for (auto _ : state) {
    kvq::quantize_kv_cache_into(x, mode, q);
    benchmark::DoNotOptimize(q.codes.data());
    benchmark::ClobberMemory();
  }
  Finish(state);
}

void BM_dequantize(benchmark::State& state, QuantMode mode) {
  SetThreads(state);
  const AffineQuantized q = kvq::quantize_kv_cache(Input(), mode);
  Tensor out;
  kvq::dequantize_kv_cache_into(q, out);
  for (auto _ : state) {
    kvq::dequantize_kv_cache_into(q, out);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  Finish(state);
}

void BM_quantize_kv_cache_int8(benchmark::State& s) { BM_quantize(s, QuantMode::Int8); }
void BM_dequantize_kv_cache_int8(benchmark::State& s) { BM_dequantize(s, QuantMode::Int8); }
void BM_quantize_kv_cache_fp8(benchmark::State& s) { BM_quantize(s, QuantMode::Fp8); }
void BM_dequantize_kv_cache_fp8(benchmark::State& s) { BM_dequantize(s, QuantMode::Fp8); }

#define KVQ_CODEC_BENCH(fn) \
  BENCHMARK(fn)->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime()

KVQ_CODEC_BENCH(BM_memcpy);
KVQ_CODEC_BENCH(BM_quantize_kv_cache_int8);
KVQ_CODEC_BENCH(BM_dequantize_kv_cache_int8);
KVQ_CODEC_BENCH(BM_quantize_kv_cache_fp8);
KVQ_CODEC_BENCH(BM_dequantize_kv_cache_fp8);

}  // namespace

int main(int argc, char** argv) {
  // --kvq_targets=NAME (before Google Benchmark's flags): as KVQ_TARGETS;
  // --kvq_list_targets: prints the supported targets, best first, and exits.
  std::string targets;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--kvq_list_targets") {
      for (const std::string& t : kvq::supported_simd_targets()) std::printf("%s\n", t.c_str());
      return 0;
    }
    if (a.rfind("--kvq_targets=", 0) != 0) continue;
    targets = a.substr(14);
    for (int j = i; j + 1 < argc; ++j) argv[j] = argv[j + 1];
    --argc, --i;
  }
  benchmark::Initialize(&argc, argv);
  try {
    kvq::apply_simd_targets_from_env();
    if (!targets.empty()) kvq::set_simd_targets(targets, "--kvq_targets");
  } catch (const kvq::Error& e) {
    std::fprintf(stderr, "kvq_bench: error: %s\n", e.what());
    return 2;
  }
  // The target the kernels ran on and the CPU's SIMD flags, in the JSON context and on stderr.
  const std::string target = kvq::dispatched_simd_target(), flags = kvq::cpu_simd_flags();
  benchmark::AddCustomContext("simd_target", target);
  benchmark::AddCustomContext("cpu_simd_flags", flags);
  std::fprintf(stderr, "kvq_bench: SIMD target %s; CPU flags: %s\n", target.c_str(), flags.c_str());
  benchmark::AddCustomContext("tensor_shape", "(1, 32, 8192, 128) f32, 128 MiB");
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
