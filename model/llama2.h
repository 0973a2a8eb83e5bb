// llama2.c checkpoints, tokenizer and an fp32 forward pass whose K/V go
// through a kvq::KvCache (evaluation only; see ../shared/models/*/README.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvq/attention.h"
#include "kvq/cluster_bank.h"
#include "kvq/grouped_kv.h"
#include "kvq/kv_cache.h"
#include "kvq/kv_scheme.h"
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

class Tokenizer {
 public:
  // Loads a llama2.c tokenizer.bin with `vocab_size` entries. Throws
  // kvq::Error, also when vocab_size < kMinVocab: encode and generate can
  // produce BOS (1), EOS (2) and the byte-fallback ids <0xNN> = NN + 3.
  Tokenizer(const std::string& path, int vocab_size);
  // A sentencepiece vocabulary held elsewhere (a GGUF's): pieces with " "
  // for U+2581, their scores, and whether text may match each piece
  // (control and unknown tokens may not). Needs BOS 1, EOS 2 and the byte
  // pieces <0x00>..<0xFF> at ids 3..258 (the layout above); `what` names
  // the source in errors. Throws kvq::Error.
  Tokenizer(std::vector<std::string> pieces, std::vector<float> scores, const std::vector<bool>& matchable,
            const std::string& what);
  static constexpr int kBos = 1;
  static constexpr int kEos = 2;
  static constexpr int kMinVocab = 3 + 256;

  // sentencepiece-BPE encode: optional BOS, dummy " " prefix for non-empty
  // text, code points to pieces or byte-fallback ids, then merges: always the
  // best-scoring adjacent pair, the leftmost of equals (a heap over adjacent
  // pairs with a linked list of symbols: O(n log n)).
  std::vector<int> encode(const std::string& text, bool bos) const;
  // The same tokens by the original O(n^2) loop (rescan all pairs after each
  // merge); kept as the reference encode is tested against.
  std::vector<int> encode_reference(const std::string& text, bool bos) const;
  // The text of `token` following `prev` (drops the leading space after BOS,
  // maps <0xNN> pieces to raw bytes).
  std::string decode(int prev, int token) const;
  int vocab_size() const { return static_cast<int>(pieces_.size()); }
  const std::string& piece(int id) const { return pieces_[static_cast<size_t>(id)]; }

 private:
  void Index(const std::vector<bool>& matchable);
  int lookup(const std::string& s) const;
  // BOS, the " " prefix and code points or byte fallbacks, before merges.
  std::vector<int> Symbols(const std::string& text, bool bos) const;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::vector<std::pair<std::string, int>> sorted_;  // piece -> id, sorted
};

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


// Which cached tokens attention reads (SPEC §7 windowed mode). window 0:
// all of them. Otherwise the first `sinks` tokens and the last `window` are
// attended exactly; the tokens in between are dropped (bank = false, a
// sliding window with sinks) or, once a whole chunk of `chunk` tokens has
// left the window, fed to a per-layer E2 ClusterBank and attended through
// its far field (moment closure) plus its outlier tokens, exactly.
struct WindowPolicy {
  int window = 0;
  int sinks = 4;
  bool bank = false;
  int chunk = 64;
  ClusterBankOptions bank_options;
};

// The KV cache of a Transformer: any kvq::KvCache scheme name (a row scheme,
// a grouped scheme or a preset) and, for the schemes that need them, the
// calibrated ranges.
struct CacheScheme {
  std::string name = "fp32";
  std::shared_ptr<const StaticRanges> ranges;
  CacheScheme() = default;
  CacheScheme(std::string n) : name(std::move(n)) {}             // NOLINT: implicit on purpose
  CacheScheme(const char* n) : name(n) {}                        // NOLINT
  CacheScheme(KvScheme s) : name(kv_scheme_name(s)) {}           // NOLINT
  KvSchemeInfo info() const { return describe_kv_scheme(name); }
  bool operator==(const CacheScheme& o) const { return info().name == o.info().name; }
};

// Scratch state for one sequence: activations and a KV cache in `scheme`.
class Transformer {
 public:
  // Windowed policies (window > 0) need a scheme that stores rows.
  Transformer(const Checkpoint& ckpt, const CacheScheme& scheme, int max_seq, const WindowPolicy& policy = {});
  // Runs on `cache` (max_seq = cache.max_seq()). A cache that holds tokens
  // (restored by KvCache::load or from_bytes) continues its sequence: the
  // next forward() is at position cache.tokens(). The cache must be of this
  // model's geometry and RoPE; windowed policies start empty. The bytes
  // history holds the restored length only (what the cache held before is
  // not in the file).
  Transformer(const Checkpoint& ckpt, KvCache cache, const WindowPolicy& policy = {});

  // One decoding step: token at pos (positions must be fed in order from 0).
  // Returns the vocab logits (valid until the next call).
  std::span<const float> forward(int token, int pos);
  // Whole window at positions [0, tokens.size()): writes all K/V into the
  // cache and returns logits (tokens.size() x vocab, row-major). Bitwise
  // identical to calling forward() token by token.
  std::span<const float> forward_window(std::span<const int> tokens);
  // The same window through the BLAS (sgemm for every projection) and, for
  // row schemes without a window, KvCache::prefill: the numbers of
  // forward_window up to floating-point summation order.
  std::span<const float> forward_batched(std::span<const int> tokens);
  // One decoding step of several sequences at the same position: seqs[b]
  // (each a Transformer of this checkpoint without a window, at length pos)
  // takes tokens[b]; the projections run as one sgemm over the rows, each
  // row's K/V go to its own sequence's cache. Returns seqs.size() x vocab
  // logits in seqs[0]'s buffer (valid until its next call).
  static std::span<const float> forward_many(std::span<Transformer* const> seqs, std::span<const int> tokens, int pos);

  // The KV cache (one type for every scheme).
  const KvCache& cache() const { return cache_; }

  // Bytes attention state holds for the current sequence, all layers: the
  // cached tokens it still reads (in the cache's scheme), plus with a bank
  // its clusters (mean key, mean value, key covariance, A, count per head,
  // float32) and its outlier tokens (float32 K and V).
  uint64_t attention_state_bytes() const;
  // What the cache held at every length of the current sequence: element
  // T - 1 is its bytes at length T (all layers), recorded as the tokens are
  // written (a streaming cache cannot tell its past afterwards).
  const std::vector<uint64_t>& cache_bytes_history() const { return bytes_at_; }
  const Config& config() const { return cfg_; }
  // Called with every Q and K row after RoPE and every V row as they are
  // computed (layer, pos, q, k, v); empty: none.
  using KvObserver =
      std::function<void(int, int, std::span<const float>, std::span<const float>, std::span<const float>)>;
  void set_kv_observer(KvObserver f) { observer_ = std::move(f); }

 private:
  enum class Pass { kToken, kWindow, kBlas };
  struct Row {
    Transformer* seq;
    int token, pos;
  };
  std::span<const float> run(std::span<const int> tokens, int pos0, Pass pass);
  std::span<const float> Run(std::span<const Row> rows, Pass pass);
  void attention(int layer, int pos, const float* q, float* out);
  void BankChunk(int layer, int t0, int t1);
  const Config& cfg_;
  const Weights& w_;
  KvCache cache_;
  std::vector<uint64_t> bytes_at_;
  KvObserver observer_;
  RopeTable rope_;
  int max_seq_;
  WindowPolicy policy_;
  int tokens_ = 0;  // tokens of the current sequence
  struct LayerBank {
    std::unique_ptr<ClusterBank> bank;
    int banked_end = 0;                  // tokens [sinks, banked_end) went to the bank
    std::vector<float> out_k, out_v;     // outlier tokens, float32 rows
  };
  std::vector<LayerBank> banks_;
  std::vector<float> x_, xb_, xb2_, hb_, hb2_, q_, k_, v_, logits_;  // (T, width)
};

// The BLAS's threads for its own calls (the forward pass runs windows on
// OpenMP threads and each sgemm on the caller's).
void set_blas_threads(int n);
// The BLAS's sgemm rate, GFLOP/s: `threads` threads each multiplying (T x n)
// by (n x d)^T, as the forward pass does, for about `seconds`.
double measure_gemm_gflops(int T, int n, int d, int threads, double seconds);

}  // namespace kvq::model
