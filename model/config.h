// A model's geometry and RoPE: what a checkpoint declares and every layer reads.
#pragma once

#include <string>

#include "kvq/rope.h"

namespace kvq::model {

struct Config {
  int dim = 0, hidden_dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, vocab_size = 0, seq_len = 0;
  bool shared_classifier = true;
  std::string arch = "llama2.c";  // llama2.c, or a GGUF's general.architecture (llama, qwen2)
  float norm_eps = 1e-5f;         // RMSNorm epsilon
  RopeConfig rope;                // base and scaling (llama2.c: 10000, none)
  bool qkv_bias = false;          // Q/K/V projections add a bias (qwen2)
  int head_size() const { return dim / n_heads; }
  int kv_dim() const { return n_kv_heads * head_size(); }
};

}  // namespace kvq::model
