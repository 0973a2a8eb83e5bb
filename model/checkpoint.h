// A checkpoint mapped from its file: llama2.c's (model/checkpoint.cc) or a GGUF's
// (model/gguf_model.cc), its Config and fp32 weights.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "model/config.h"
#include "kvq/ggml_weights.h"
#include "kvq/token_table.h"
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

// Weights in llama2.c's roles: norms and biases as float32 (L consecutive
// vectors), each layer's matrices (out, in) in the type the file stores
// them (kvq/ggml_weights.h; float32 for llama2.c files), pointing into the
// mapped file or the checkpoint's own copy.
struct Weights {
  ggml::WeightMatrix token_embedding;  // (vocab, dim)
  const float* rms_att;          // (L, dim)
  std::vector<ggml::WeightMatrix> wq;  // L x (dim, dim)
  std::vector<ggml::WeightMatrix> wk;  // L x (kv_dim, dim)
  std::vector<ggml::WeightMatrix> wv;  // L x (kv_dim, dim)
  std::vector<ggml::WeightMatrix> wo;  // L x (dim, dim)
  const float* rms_ffn;          // (L, dim)
  std::vector<ggml::WeightMatrix> w1;  // L x (hidden, dim)
  std::vector<ggml::WeightMatrix> w2;  // L x (dim, hidden)
  std::vector<ggml::WeightMatrix> w3;  // L x (hidden, dim)
  const float* rms_final;        // (dim)
  ggml::WeightMatrix wcls;             // (vocab, dim)
  const float* bq = nullptr;     // (L, dim) or null: no biases
  const float* bk = nullptr;     // (L, kv_dim)
  const float* bv = nullptr;     // (L, kv_dim)
  // Bytes the matrices hold (what the model keeps in RAM or maps).
  uint64_t matrix_bytes() const;
  // Bytes one token's pass reads: every matrix but the embedding table, of
  // which one row (the whole table when the classifier shares it).
  uint64_t token_bytes() const;
  // How many matrices are of each ggml type (the classifier once when tied).
  std::map<uint32_t, int> matrix_types() const;
  // "Q4_K x 193, Q6_K x 33: 4.58 GiB".
  std::string describe() const;
};

class Checkpoint {
 public:
  // A GGUF file (gguf.h; "GGUF" magic) is read as described in gguf_model.cc:
  // architectures llama and qwen2, matrices kept in their ggml type in the
  // mapped file (kvq/ggml_weights.h), norms and biases as float32, and
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
  // A GGUF's tokenizer.chat_template (Jinja text; model/chat_template.h), or
  // "" when it has none (llama2.c files never do).
  const std::string& chat_template() const { return chat_template_; }
  // Where layer0_token_table (model/transformer.h) keeps the table it makes
  // on first use, for every cache of this checkpoint.
  struct TokenTableSlot {
    std::mutex mu;
    std::shared_ptr<const TokenTable> table;
  };
  TokenTableSlot& token_table_slot() const { return *table_slot_; }

 private:
  void LoadGguf(const std::string& path);
  std::unique_ptr<MappedFile> file_;
  std::unique_ptr<TokenTableSlot> table_slot_ = std::make_unique<TokenTableSlot>();
  std::unique_ptr<float[]> owned_;  // GGUF: norms and biases in fp32
  std::vector<uint8_t> permuted_;   // qwen2: Q and K rows in kvq's RoPE order
  std::shared_ptr<const Tokenizer> tokenizer_;
  std::string tokenizer_problem_;
  std::string chat_template_;
  Config config_;
  Weights weights_{};
  int format_version_ = 0;
  bool gguf_ = false;
  bool add_bos_ = true;
};

// True when the file starts with GGUF's magic (false when unreadable).
bool is_gguf_file(const std::string& path);

}  // namespace kvq::model
