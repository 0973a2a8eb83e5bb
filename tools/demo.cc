// `kvq demo`: quantizes a synthetic K/V tensor with LLM-like outlier
// channels and prints round-trip error and throughput per mode.
#include <omp.h>

#include <chrono>
#include <cmath>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "hwy/targets.h"
#include "kvq/affine.h"
#include "kvq/targets.h"
#include "tools/commands.h"

namespace kvq::tools {

void AddDemoCommand(CLI::App& app, DemoOptions& opts) {
  CLI::App* demo = app.add_subcommand("demo", "Quantize a synthetic K/V tensor and print error and speed");
  demo->add_option("--tokens", opts.tokens, "cached tokens")->check(CLI::Range(1, 1 << 20));
  demo->add_option("--heads", opts.heads, "KV heads")->check(CLI::Range(1, 1024));
  demo->add_option("--head-dim", opts.head_dim, "head dimension")->check(CLI::Range(1, 4096));
  demo->add_option("--threads", opts.threads, "OpenMP threads (0 = default)")->check(CLI::Range(0, 1024));
}

namespace {

double Seconds(const std::function<void()>& fn, int reps) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];  // median
}

}  // namespace

int RunDemo(const DemoOptions& o) {
  if (o.threads > 0) omp_set_num_threads(o.threads);
  const Shape shape = {1, o.heads, o.tokens, o.head_dim};
  Tensor x(shape, DType::F32);
  float* p = x.data_as<float>();
  // Gaussian values (Box-Muller on a fixed LCG stream); every 37th channel is
  // an outlier channel 20x larger, as seen in real keys.
  uint64_t s = 2024;
  auto uniform = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return (static_cast<double>(s >> 11) + 0.5) * 0x1p-53;
  };
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double g = std::sqrt(-2 * std::log(uniform())) * std::cos(2 * M_PI * uniform());
    p[i] = static_cast<float>(((i % o.head_dim) % 37 == 5 ? 20.0 : 1.0) * g);
  }
  std::string targets;
  for (const std::string& t : supported_simd_targets()) targets += (targets.empty() ? "" : " ") + t;
  std::printf("kvq demo: synthetic K/V %s f32 (%.1f MiB), outlier channels x20, SIMD target %s (of: %s), %d threads\n",
              shape_str(shape).c_str(), static_cast<double>(x.nbytes()) / (1 << 20), dispatched_simd_target().c_str(),
              targets.c_str(), omp_get_max_threads());
  std::printf("%-6s %6s %10s %12s %12s %10s %10s %12s %12s %10s\n", "mode", "bits", "scale", "max|err|",
              "mean|err|", "NMSE", "SNR(dB)", "quant GB/s", "dequant GB/s", "memcpy GB/s");
  Tensor copy = Tensor::Uninitialized(shape, DType::F32);
  const double gb = static_cast<double>(x.nbytes()) / 1e9;
  const double t_copy = Seconds([&] { std::memcpy(copy.data(), x.data(), x.nbytes()); }, 5);
  for (QuantMode mode : {QuantMode::Int8, QuantMode::Fp8}) {
    AffineQuantized q;
    Tensor y;
    quantize_kv_cache_into(x, mode, q);
    dequantize_kv_cache_into(q, y);
    const double tq = Seconds([&] { quantize_kv_cache_into(x, mode, q); }, 5);
    const double td = Seconds([&] { dequantize_kv_cache_into(q, y); }, 5);
    double max_err = 0, sum_err = 0, num = 0, den = 0;
    const float* yp = y.data_as<float>();
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double e = static_cast<double>(p[i]) - yp[i];
      max_err = std::max(max_err, std::fabs(e));
      sum_err += std::fabs(e);
      num += e * e;
      den += static_cast<double>(p[i]) * p[i];
    }
    const double bits = 8.0 * static_cast<double>(q.size_bytes()) / static_cast<double>(x.numel());
    std::printf("%-6s %6.3f %10.4g %12.4g %12.4g %10.3g %10.2f %12.2f %12.2f %10.2f\n", quant_mode_name(mode),
                bits, q.scale, max_err, sum_err / static_cast<double>(x.numel()), num / den,
                10 * std::log10(den / num), gb / tq, gb / td, gb / t_copy);
  }
  std::printf("(GB/s of float32 input; medians of 5 runs. Benchmarks with the memcpy reference: build/release/bench/kvq_bench)\n");
  return 0;
}

}  // namespace kvq::tools
