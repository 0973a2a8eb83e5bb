// Rotary position embedding (RoPE) as Llama-family models apply it: pairs
// (2p, 2p + 1) of each head rotated by the angle pos * f_p, with the
// frequencies f_p = theta^(-2p / head_dim), optionally rescaled (linear
// position interpolation, or Llama 3's per-frequency rule). One
// definition, shared by the model's forward pass and the caches that keep
// keys in a rotated frame (grouped_kv.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvq {

struct RopeConfig {
  enum class Scaling : uint8_t { kNone = 0, kLinear = 1, kLlama3 = 2 };  // append-only (saved caches)
  float theta = 10000.0f;  // base (llama2.c, Llama 2: 10000; Llama 3: 500000)
  Scaling scaling = Scaling::kNone;
  float factor = 1.0f;           // linear and llama3: the context extension factor
  float low_freq_factor = 1.0f;  // llama3
  float high_freq_factor = 4.0f; // llama3
  int original_context = 8192;   // llama3: the pre-training context length
  // Throws kvq::Error naming `arg` unless the fields are in range.
  void validate(const char* arg = "rope") const;
  std::string describe() const;
  // The fields the scaling does not read set to their defaults (one
  // spelling per rotation: what a cache holds and saves).
  RopeConfig canonical() const;
  bool operator==(const RopeConfig&) const = default;
};

// The head_dim / 2 angular frequencies f_p of a head (float, as the model
// computes them: the angle at position pos is pos * f_p in float).
std::vector<float> rope_frequencies(int head_dim, const RopeConfig& rope);

// cos / sin of the angle at every position [0, max_seq): the table the
// forward pass rotates with.
class RopeTable {
 public:
  // Throws kvq::Error unless max_seq >= 1 and head_dim is even and >= 2.
  RopeTable(int max_seq, int head_dim, const RopeConfig& rope = {});
  int max_seq() const { return max_seq_; }
  int head_dim() const { return head_dim_; }
  const RopeConfig& config() const { return config_; }
  const float* cos(int pos) const { return cos_.data() + static_cast<size_t>(pos) * (head_dim_ / 2); }
  const float* sin(int pos) const { return sin_.data() + static_cast<size_t>(pos) * (head_dim_ / 2); }
  // Rotates n_heads heads of x (head-major) in place to position pos.
  void apply(float* x, int n_heads, int pos) const;

 private:
  int max_seq_, head_dim_;
  RopeConfig config_;
  std::vector<float> cos_, sin_;  // (max_seq, head_dim / 2)
};

// A RopeTable of at least max_seq positions for head_dim and rope, shared
// by every caller alive that asks for the same rotation (a position's
// entries do not depend on the table's length: one covering the longest
// request serves all). Held only while a caller holds it. Thread-safe.
std::shared_ptr<const RopeTable> shared_rope_table(int max_seq, int head_dim, const RopeConfig& rope);

// The rotation at one position: x' = R(pos) x for n_heads heads, or x' =
// R(pos)^T x (transpose = true), with cos / sin per pair.
void rope_rotate(float* x, int n_heads, int head_dim, const float* cos, const float* sin, bool transpose);

}  // namespace kvq
