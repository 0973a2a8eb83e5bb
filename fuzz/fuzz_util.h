// Helpers shared by the fuzz targets.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <memory>
#include <map>
#include <cstdint>
#include <string>
#include <vector>

#include "kvq/kv_cache.h"
#include "kvq/token_table.h"
#include "model/checkpoint.h"
#include "model/tokenizer.h"
#include "src/io/container.h"

namespace kvq::fuzz {

// Input byte 0 picks the reading: odd, the bytes as a whole file; even,
// the rest as a payload wrapped in a valid container header (magic, version
// 1, size, CRC32C), so that mutations get past the checksum.
inline std::vector<uint8_t> AsContainer(const uint8_t* data, size_t size, const char magic[4]) {
  if (size == 0) return {};
  if (data[0] & 1) return std::vector<uint8_t>(data + 1, data + size);
  return detail::WrapContainer(magic, 1, std::vector<uint8_t>(data + 1, data + size));
}

// The bytes as a file the loaders can open by path (an anonymous memory
// file: no disk, removed when the descriptor closes).
class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) {
    fd_ = ::memfd_create("kvq-fuzz", 0);
    if (fd_ < 0) __builtin_trap();
    for (size_t done = 0; done < size;) {
      const ssize_t n = ::write(fd_, data + done, size - done);
      if (n <= 0) __builtin_trap();
      done += static_cast<size_t>(n);
    }
  }
  ~MemFile() { ::close(fd_); }
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_ = -1;
};

// Deterministic, roughly Gaussian values (seeds and reference caches).
inline std::vector<float> Values(int n, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    const double u1 = ((seed >> 8) + 0.5) / 16777216.0;
    seed = seed * 1664525u + 1013904223u;
    const double u2 = ((seed >> 8) + 0.5) / 16777216.0;
    v[static_cast<size_t>(i)] = static_cast<float>(std::sqrt(-2 * std::log(u1)) * std::cos(6.283185307 * u2));
  }
  return v;
}

// KVQR (the prefix store's ranges): caches of 2 layers x 2 heads x 32 with
// fixed calibrated ranges, a token sequence whose first range ends at
// kRange0 and second at kRange1; seeds and fuzz_kvqr build the same ones.
constexpr int kRangeL = 2, kRangeH = 2, kRangeD = 32, kRange0 = 40, kRange1 = 90;
inline const char* const kRangeSchemes[] = {"fp16", "q8_0", "q4_0", "int8", "kvq-6.5", "kvq-4.5", "kvq-3.5",
                                            "kvq-2.5", "k3v3g32o8x3r4s2", "k4v4g16", "k4v3c", "t0+q4_0", "t0+kvq-3.5"};

// The token table of t0+ caches (seeds, KVQS and KVQR targets): 300 ids of
// kRangeH x kRangeD; a saved t0+ cache of another geometry is refused.
constexpr int kTableVocab = 300;
inline std::shared_ptr<const TokenTable> FuzzTokenTable() {
  static const std::shared_ptr<const TokenTable> t = std::make_shared<const TokenTable>(
      kTableVocab, kRangeH, kRangeD, Values(kTableVocab * kRangeH * kRangeD, 81),
      Values(kTableVocab * kRangeH * kRangeD, 82));
  return t;
}

inline const StaticRanges& RangeRanges() {
  static const StaticRanges r = [] {
    const int E = kRangeH * kRangeD;
    std::vector<std::vector<float>> ks(kRangeL), vs(kRangeL);
    for (int l = 0; l < kRangeL; ++l) ks[l] = Values(64 * E, 50 + l), vs[l] = Values(64 * E, 60 + l);
    StaticRanges x = StaticRanges::from_samples(ks, vs, kRangeH, kRangeD);
    for (size_t c = 0; c < x.k_lo.size(); ++c) x.k_weight.push_back(1.0f + static_cast<float>(c % 5));
    return x;
  }();
  return r;
}

inline KvCache RangeCache(const std::string& scheme) {
  return KvCache(scheme, kRangeL, 128, kRangeH, kRangeD, &RangeRanges(), {}, FuzzTokenTable());
}

inline std::array<uint8_t, 32> RangeId(int i) {
  std::array<uint8_t, 32> id{};
  id[0] = static_cast<uint8_t>(0xA0 + i);
  return id;
}

// The scheme's ranges [0, kRange0) and [kRange0, kRange1) of the reference sequence.
inline const std::vector<std::vector<uint8_t>>& RangeSeeds(const std::string& scheme) {
  static std::map<std::string, std::vector<std::vector<uint8_t>>> built;
  auto it = built.find(scheme);
  if (it != built.end()) return it->second;
  const int E = kRangeH * kRangeD;
  const std::vector<float> k = Values(kRange1 * E, 71), v = Values(kRange1 * E, 72);
  KvCache c = RangeCache(scheme);
  std::vector<std::vector<uint8_t>> out;
  for (int t = 0; t < kRange1; ++t) {
    for (int l = 0; l < kRangeL; ++l) {
      c.write(l, t, std::span(k).subspan(static_cast<size_t>(t) * E, E), std::span(v).subspan(static_cast<size_t>(t) * E, E),
              (7 * t) % kTableVocab);
    }
    if (t + 1 == kRange0) out.push_back(c.range_to_bytes(0, -1, RangeId(0)));
    if (t + 1 == kRange1) out.push_back(c.range_to_bytes(kRange0, -1, RangeId(1)));
  }
  return built.emplace(scheme, std::move(out)).first->second;
}

// Reads every token of every layer as attention does: traps on a
// non-finite value; returns whether every |K| and |V| is at most 1e4.
// Attention is finite for sane values; a saved cache may hold any finite
// value its scheme can (1e38 included), whose scores overflow as they would
// had they been written.
inline bool SaneValues(const KvCache& c) {
  const size_t E = static_cast<size_t>(c.n_kv_heads()) * static_cast<size_t>(c.head_dim());
  std::vector<float> k(E), v(E);
  float m = 0;
  for (int l = 0; l < c.n_layers(); ++l) {
    for (int64_t t = 0; t < c.written(l); ++t) {
      c.read(l, t, k, v);
      for (size_t i = 0; i < E; ++i) {
        if (!std::isfinite(k[i]) || !std::isfinite(v[i])) __builtin_trap();
        m = std::max({m, std::fabs(k[i]), std::fabs(v[i])});
      }
    }
  }
  return m <= 1e4f;
}

// Attends every layer of `c` with a fixed query; traps on a non-finite
// output when `finite` (the values read are sane: SaneValues).
inline void AttendEveryLayer(const KvCache& c, bool finite) {
  const size_t E = static_cast<size_t>(c.n_kv_heads()) * static_cast<size_t>(c.head_dim());
  std::vector<float> q(2 * E), out(q.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = 0.01f * static_cast<float>(i % 37) - 0.15f;
  for (int l = 0; l < c.n_layers(); ++l) {
    c.attend(l, q, 2 * c.n_kv_heads(), out);
    for (float x : out) {
      if (finite && !std::isfinite(x)) __builtin_trap();
    }
  }
}

// A loaded checkpoint (llama2.c or GGUF): reads both ends of every weight
// table it hands out, so ASan sees any table that runs past its storage.
inline void ReadWeightEnds(const model::Checkpoint& c) {
  const model::Config& cfg = c.config();
  const model::Weights& w = c.weights();
  const size_t d = static_cast<size_t>(cfg.dim), v = static_cast<size_t>(cfg.vocab_size),
               L = static_cast<size_t>(cfg.n_layers), h = static_cast<size_t>(cfg.hidden_dim),
               kv = static_cast<size_t>(cfg.kv_dim());
  volatile float sink = 0;
  auto ends = [&](const float* p, size_t n) { sink = sink + p[0] + p[n - 1]; };
  volatile uint8_t bsink = 0;
  auto mat = [&](const ggml::WeightMatrix& m, size_t rows, size_t cols) {
    if (m.rows != rows || m.cols != cols) __builtin_trap();
    bsink = static_cast<uint8_t>(bsink + m.data[0] + m.data[m.rows * m.row_bytes - 1]);
  };
  auto layers = [&](const std::vector<ggml::WeightMatrix>& ms, size_t rows, size_t cols) {
    if (ms.size() != L) __builtin_trap();
    for (const ggml::WeightMatrix& m : ms) mat(m, rows, cols);
  };
  mat(w.token_embedding, v, d), mat(w.wcls, v, d), ends(w.rms_final, d);
  ends(w.rms_att, L * d), ends(w.rms_ffn, L * d), layers(w.wq, d, d), layers(w.wo, d, d);
  layers(w.wk, kv, d), layers(w.wv, kv, d), layers(w.w1, h, d), layers(w.w2, d, h), layers(w.w3, h, d);
  if (w.bq != nullptr) ends(w.bq, L * d), ends(w.bk, L * kv), ends(w.bv, L * kv);
  (void)bsink;
  (void)sink;
}

}  // namespace kvq::fuzz
