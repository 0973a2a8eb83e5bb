// The weights' passes. Decode: the fused dequantise-and-dot
// (kvq/ggml_weights.h: matvec_fused) and the integer path (matvec_int) over matrices of an 8B model's FFN
// geometry (14336 x 4096, Llama-3-8B's gate/up), four of them so that the
// bytes come from DRAM (64-470 MB depending on the type), rows split over
// `threads` OpenMP threads as the forward pass splits them. The bounding
// reference in the same binary is BM_weight_read: the same number of
// bytes read by `threads` threads with memchr (a read-only stream at the
// memory's rate). bytes_per_second of the two give the fraction of the
// DRAM read rate the kernel reaches; tokens/s of a model follow from its
// weight bytes.
//
//   build/release/bench/kvq_bench --benchmark_filter=BM_weight
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <omp.h>

#include <cstring>
#include <string>
#include <vector>

#include "kvq/ggml_weights.h"
#include "kvq/half.h"

namespace {

constexpr size_t kRows = 14336, kCols = 4096, kMats = 4;

struct Matrices {
  std::vector<uint8_t> bytes;
  std::vector<kvq::ggml::WeightMatrix> m;
};

// kMats random matrices of `type` with finite scales (every fp16 scale
// field of a block set to 0.01).
const Matrices& Make(uint32_t type) {
  static std::vector<std::pair<uint32_t, Matrices>> made;
  for (auto& [t, m] : made) {
    if (t == type) return m;
  }
  made.emplace_back(type, Matrices{});
  Matrices& out = made.back().second;
  const size_t block = static_cast<size_t>(kvq::ggml::weight_block(type)),
               bb = static_cast<size_t>(kvq::ggml::weight_block_bytes(type)), row_bytes = kCols / block * bb;
  out.bytes.resize(kMats * kRows * row_bytes);
  uint64_t s = 0x9E3779B97F4A7C15ull ^ type;
  for (size_t i = 0; i < out.bytes.size(); i += 8) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    std::memcpy(out.bytes.data() + i, &s, std::min<size_t>(8, out.bytes.size() - i));
  }
  const uint16_t h = kvq::f32_to_f16_ref(0.01f);
  for (size_t b = 0; b < out.bytes.size() / bb; ++b) {
    for (uint8_t off : kvq::ggml::scale_fields(type)) std::memcpy(out.bytes.data() + b * bb + off, &h, 2);
  }
  for (size_t k = 0; k < kMats; ++k) {
    kvq::ggml::WeightMatrix w;
    w.type = type;
    w.data = out.bytes.data() + k * kRows * row_bytes;
    w.rows = kRows, w.cols = kCols, w.row_bytes = row_bytes;
    out.m.push_back(w);
  }
  return out;
}

void BM_weight_matvec(benchmark::State& state, kvq::ggml::WeightType type) {
  const int threads = static_cast<int>(state.range(0));
  const Matrices& mats = Make(static_cast<uint32_t>(type));
  std::vector<float> x(kCols), out(kRows);
  for (size_t j = 0; j < kCols; ++j) x[j] = static_cast<float>(j % 13) * 0.1f - 0.6f;
  for (auto _ : state) {
    for (const kvq::ggml::WeightMatrix& w : mats.m) {
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t a = 0; a < static_cast<int64_t>(kRows); a += 64) {
        const size_t b = std::min(kRows, static_cast<size_t>(a) + 64);
        kvq::ggml::matvec_fused(w, x.data(), static_cast<size_t>(a), b, out.data() + a);
      }
      benchmark::DoNotOptimize(out.data());
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * mats.bytes.size()));
  state.counters["weights/s"] = benchmark::Counter(static_cast<double>(kMats * kRows * kCols) * state.iterations(),
                                                   benchmark::Counter::kIsRate);
}

// The integer path (kvq/ggml_weights.h: matvec_int, llama.cpp's arithmetic):
// the activation rounded to the type's 8-bit blocks once per matrix (inside
// the timing, as the forward pass does it), then the rows split as the
// forward pass splits them (model/transformer.cc: MatMulInt8): one call a
// thread, each a contiguous range of whole 64-row blocks (a call prepares
// the activation's scales and codes once for all its rows).
void BM_weight_matvec_int8(benchmark::State& state, kvq::ggml::WeightType type) {
  const int threads = static_cast<int>(state.range(0));
  const uint32_t t = static_cast<uint32_t>(type);
  const Matrices& mats = Make(t);
  std::vector<float> x(kCols), out(kRows);
  for (size_t j = 0; j < kCols; ++j) x[j] = static_cast<float>(j % 13) * 0.1f - 0.6f;
  std::vector<uint8_t> xq(kvq::ggml::activation_bytes(t, kCols));
  const size_t per = (kRows + 64 * static_cast<size_t>(threads) - 1) / (64 * static_cast<size_t>(threads)) * 64;
  for (auto _ : state) {
    for (const kvq::ggml::WeightMatrix& w : mats.m) {
      kvq::ggml::quantize_activation(t, x.data(), kCols, xq.data());
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int p = 0; p < threads; ++p) {
        const size_t a = std::min(kRows, static_cast<size_t>(p) * per), b = std::min(kRows, a + per);
        if (a < b) kvq::ggml::matvec_int(w, xq.data(), a, b, out.data() + a);
      }
      benchmark::DoNotOptimize(out.data());
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * mats.bytes.size()));
  state.counters["weights/s"] = benchmark::Counter(static_cast<double>(kMats * kRows * kCols) * state.iterations(),
                                                   benchmark::Counter::kIsRate);
}

// A prompt's pass: T activation rows against one matrix through the integer
// path (matmul_int: each weight row decoded once for 4 activation rows), the
// rows split over `threads` as the batched pass splits them. Its bounding
// reference is BM_weight_sgemm: OpenBLAS's sgemm of the same T rows by the
// matrix's float32 copy, the exact batched pass's product. weight_rows/s
// counts multiply-adds (T x rows x cols per iteration).
constexpr size_t kPromptRows = 64;

void BM_weight_matmul_int8(benchmark::State& state, kvq::ggml::WeightType type) {
  const int threads = static_cast<int>(state.range(0));
  const uint32_t t = static_cast<uint32_t>(type);
  const kvq::ggml::WeightMatrix& w = Make(t).m[0];
  const size_t ab = kvq::ggml::activation_bytes(t, kCols);
  std::vector<float> x(kPromptRows * kCols), out(kPromptRows * kRows);
  for (size_t j = 0; j < x.size(); ++j) x[j] = static_cast<float>(j % 13) * 0.1f - 0.6f;
  std::vector<uint8_t> xq(kPromptRows * ab);
  for (auto _ : state) {
    for (size_t r = 0; r < kPromptRows; ++r) kvq::ggml::quantize_activation(t, x.data() + r * kCols, kCols, xq.data() + r * ab);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t a = 0; a < static_cast<int64_t>(kRows); a += 64) {
      const size_t b = std::min(kRows, static_cast<size_t>(a) + 64);
      kvq::ggml::matmul_int(w, xq.data(), kPromptRows, static_cast<size_t>(a), b, out.data() + a, kRows);
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["MAC/s"] = benchmark::Counter(static_cast<double>(kPromptRows * kRows * kCols) * state.iterations(),
                                               benchmark::Counter::kIsRate);
}

void BM_weight_sgemm(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  static std::vector<float> wf;
  if (wf.empty()) {
    wf.resize(kRows * kCols);
    for (size_t j = 0; j < wf.size(); ++j) wf[j] = static_cast<float>(j % 29) * 0.01f - 0.14f;
  }
  std::vector<float> x(kPromptRows * kCols), out(kPromptRows * kRows);
  for (size_t j = 0; j < x.size(); ++j) x[j] = static_cast<float>(j % 13) * 0.1f - 0.6f;
  openblas_set_num_threads(threads);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(kPromptRows), static_cast<int>(kRows),
                static_cast<int>(kCols), 1.0f, x.data(), static_cast<int>(kCols), wf.data(), static_cast<int>(kCols),
                0.0f, out.data(), static_cast<int>(kRows));
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["MAC/s"] = benchmark::Counter(static_cast<double>(kPromptRows * kRows * kCols) * state.iterations(),
                                               benchmark::Counter::kIsRate);
}
BENCHMARK(BM_weight_sgemm)->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

// The same bytes' count read by memchr for a byte that is not there.
void BM_weight_read(benchmark::State& state, kvq::ggml::WeightType type) {
  const int threads = static_cast<int>(state.range(0));
  const size_t n = Make(static_cast<uint32_t>(type)).bytes.size();
  static std::vector<uint8_t> zeros;
  if (zeros.size() < n) zeros.assign(n, 0);
  for (auto _ : state) {
    size_t found = 0;
#pragma omp parallel num_threads(threads) reduction(+ : found)
    {
      const size_t t = static_cast<size_t>(omp_get_thread_num()), nt = static_cast<size_t>(omp_get_num_threads());
      const size_t b = n * t / nt, e = n * (t + 1) / nt;
      found += std::memchr(zeros.data() + b, 1, e - b) != nullptr;
    }
    benchmark::DoNotOptimize(found);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n));
}

#define KVQ_WEIGHT_BENCH(T)                                                                                      \
  BENCHMARK_CAPTURE(BM_weight_matvec, T, kvq::ggml::WeightType::k##T)                                            \
      ->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();                       \
  BENCHMARK_CAPTURE(BM_weight_matvec_int8, T, kvq::ggml::WeightType::k##T)                                       \
      ->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();                       \
  BENCHMARK_CAPTURE(BM_weight_matmul_int8, T, kvq::ggml::WeightType::k##T)                                       \
      ->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();                       \
  BENCHMARK_CAPTURE(BM_weight_read, T, kvq::ggml::WeightType::k##T)                                              \
      ->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime()

KVQ_WEIGHT_BENCH(Q4_K);
KVQ_WEIGHT_BENCH(Q6_K);
KVQ_WEIGHT_BENCH(Q5_K);
KVQ_WEIGHT_BENCH(Q8_0);
KVQ_WEIGHT_BENCH(Q4_0);
KVQ_WEIGHT_BENCH(IQ4_XS);
KVQ_WEIGHT_BENCH(Q3_K);

}  // namespace
