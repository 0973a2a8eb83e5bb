// A checkpoint mapped from its file: llama2.c's (model/checkpoint.cc) or a GGUF's
// (model/gguf_model.cc), its Config and fp32 weights.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/tokenizer.h"

namespace kvq::model {

// Read-only memory map of a file (move-only).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);  // throws kvq::Error
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Weights point into the mapped checkpoint (llama2.c) or into the
// checkpoint's own fp32 copy (GGUF), in llama2.c's layout: one array per
// kind, layers consecutive, matrices (out, in) row-major.
struct Weights {
  const float* token_embedding;  // (vocab, dim)
  const float* rms_att;          // (L, dim)
  const float* wq;               // (L, dim, dim)
  const float* wk;               // (L, kv_dim, dim)
  const float* wv;               // (L, kv_dim, dim)
  const float* wo;               // (L, dim, dim)
  const float* rms_ffn;          // (L, dim)
  const float* w1;               // (L, hidden, dim)
  const float* w2;               // (L, dim, hidden)
  const float* w3;               // (L, hidden, dim)
  const float* rms_final;        // (dim)
  const float* wcls;             // (vocab, dim)
  const float* bq = nullptr;     // (L, dim) or null: no biases
  const float* bk = nullptr;     // (L, kv_dim)
  const float* bv = nullptr;     // (L, kv_dim)
};

class Checkpoint {
 public:
  // A GGUF file (gguf.h; "GGUF" magic) is read as described in gguf_model.cc:
  // architectures llama and qwen2, tensors F32 / F16 / BF16 / Q8_0
  // dequantised to fp32 at load (the mapping is released afterwards), and
  // its sentencepiece tokenizer when it has one.
  //
  // Maps and validates a llama2.c checkpoint, legacy (export.py version 0)
  // or export version 1 ("ak42" header, fp32): header sanity and the exact
  // file size implied by the hyper-parameters. Version 2 (Q8_0 weights) is
  // refused with a clear message. Throws kvq::Error.
  explicit Checkpoint(const std::string& path);
  const Config& config() const { return config_; }
  int format_version() const { return format_version_; }  // 0: legacy, 1: "ak42" version 1, 2 and 3: GGUF
  bool is_gguf() const { return gguf_; }
  const Weights& weights() const { return weights_; }
  // The model's own tokenizer (a GGUF's), or null; tokenizer_problem()
  // says why there is none ("" for llama2.c files, which keep it apart).
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  const std::string& tokenizer_problem() const { return tokenizer_problem_; }
  // Whether the model adds BOS to a text (GGUF: tokenizer.ggml.add_bos_token).
  bool add_bos() const { return add_bos_; }

 private:
  void LoadGguf(const std::string& path);
  std::unique_ptr<MappedFile> file_;
  std::unique_ptr<float[]> owned_;  // GGUF: the weights in fp32 (first touched by the parallel dequantisation)
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::string tokenizer_problem_;
  Config config_;
  Weights weights_{};
  int format_version_ = 0;
  bool gguf_ = false;
  bool add_bos_ = true;
};

// True when the file starts with GGUF's magic (false when unreadable).
bool is_gguf_file(const std::string& path);

}  // namespace kvq::model
