// The fp32 forward pass of a checkpoint whose K/V go through a kvq::KvCache
// (evaluation and generation): token by token, a window, batched (OpenBLAS sgemm +
// KvCache::prefill), several sequences side by side; the windowed attention policies.
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
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/tokenizer.h"

namespace kvq::model {

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
  // head_dim > 0: as a cache of heads that size resolves it (a preset may
  // resolve per head size).
  KvSchemeInfo info(int head_dim = 0) const { return describe_kv_scheme(name, "kv", head_dim); }
  // The same cache: the same canonical scheme, except that a preset is only
  // itself (on a model it may resolve to something other than its plain
  // scheme: model::cache_token_table).
  bool operator==(const CacheScheme& o) const {
    const bool a = grouped_kv_preset(name, 0).has_value(), b = grouped_kv_preset(o.name, 0).has_value();
    return a || b ? name == o.name : info().name == o.info().name;
  }
};

// How the passes multiply by a quantized (block-type) weight matrix.
// kExact: float32 activations against ggml's dequantised values (the fused
// kernel; the batched pass dequantises and calls sgemm): the numbers of an
// F32 copy of the file up to summation order. kInt8: llama.cpp's arithmetic
// (kvq/ggml_weights.h, matvec_int): each activation row rounded once per
// matrix to 8-bit blocks (Q8_0 / Q8_1 / Q8_K), integer block sums, faster and
// not the float numbers. F32 / F16 / BF16 matrices are float in both.
enum class WeightDot { kExact, kInt8 };
// "exact" / "int8", and back (kvq::Error naming `what` for another name).
const char* weight_dot_name(WeightDot d);
WeightDot parse_weight_dot(const std::string& name, const char* what);

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
  // forward_window / forward_batched of another sequence `seq` (a
  // Transformer of this checkpoint) on this object's activation buffers:
  // the same bits as seq's own call; the logits are in this object's buffer.
  // Several caches evaluated side by side keep one set of buffers (a
  // 128K-vocabulary window's logits alone are 256 MiB at ctx 512).
  std::span<const float> forward_window_into(Transformer& seq, std::span<const int> tokens);
  std::span<const float> forward_batched_into(Transformer& seq, std::span<const int> tokens);
  // Prompt tokens at positions [pos0, pos0 + tokens.size()), pos0 the
  // sequence's length, through the batched pass (forward_batched's numbers;
  // KvCache::prefill for caches that read any length): their K/V go into
  // the cache and only the last token's logits are computed (vocab values,
  // valid until the next call).
  std::span<const float> prefill(std::span<const int> tokens, int pos0);
  // prefill() of another sequence `seq` (a Transformer of this checkpoint)
  // on this object's activation buffers: a server keeps one set of buffers
  // for its passes and only a cache (and its RoPE table) per sequence. With
  // logits = false no logits are computed (an empty span is returned): a
  // server that decodes the prompt's last token in its next step skips a
  // vocabulary-sized product per prefill.
  std::span<const float> prefill_into(Transformer& seq, std::span<const int> tokens, int pos0, bool logits = true);
  // One decoding step of several sequences at their own lengths, on this
  // object's buffers: rows[b].seq (a Transformer of this checkpoint without
  // a window, each at most once) takes rows[b].token at position
  // rows[b].pos, its length. Several rows run every projection as one sgemm
  // (the weights read once for all of them); one row is forward()'s pass,
  // bit for bit. Returns rows.size() x vocab logits (valid until this
  // object's next call).
  struct SeqToken {
    Transformer* seq;
    int token, pos;
  };
  std::span<const float> forward_rows(std::span<const SeqToken> rows);
  // Tokens of the current sequence (its next position).
  int length() const { return tokens_; }
  // Threads of each attention call (default 1: the callers that run
  // sequences on threads of their own, as `kvq eval` does, keep it).
  void set_attention_threads(int n);
  // How this object's passes multiply by quantized weights (default kExact).
  // kInt8 runs every pass's quantized matrices through the integer path
  // (the batched pass too: it reads each weight row once for every 4 rows,
  // faster than dequantising for sgemm at 1-2 threads); a row's numbers are
  // then the same in every pass.
  void set_weight_dot(WeightDot d) { dot_ = d; }
  WeightDot weight_dot() const { return dot_; }
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
  using Row = SeqToken;
  // Rows of several sequences of this checkpoint without a window, each at
  // most once, at a position inside its cache; at_length: its length.
  void CheckRows(std::span<const Row> rows, bool at_length) const;
  // Which rows' logits a pass computes.
  enum class Logits { kAll, kLast, kNone };
  std::span<const float> run(std::span<const int> tokens, int pos0, Pass pass, Logits logits = Logits::kAll,
                             Transformer* seq = nullptr);
  std::span<const float> Run(std::span<const Row> rows, Pass pass, Logits logits = Logits::kAll);
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
  int attention_threads_ = 1;
  WeightDot dot_ = WeightDot::kExact;
  struct LayerBank {
    std::unique_ptr<ClusterBank> bank;
    int banked_end = 0;                  // tokens [sinks, banked_end) went to the bank
    std::vector<float> out_k, out_v;     // outlier tokens, float32 rows
  };
  std::vector<LayerBank> banks_;
  std::vector<float> x_, xb_, xb2_, hb_, hb2_, q_, k_, v_, logits_;  // (T, width)
  std::vector<float> wbuf_;  // the batched and window passes: a block of a quantized matrix's rows in float32
  std::vector<uint8_t> xq_;  // kInt8: an activation row in the matrix's 8-bit block format
};

// Layer 0's K (before RoPE) and V of every token id (kvq/token_table.h),
// what a t0+ cache reads: each id's embedding normed and multiplied by
// layer 0's Wk and Wv (plus biases) through the BLAS, as fp16. Made on the
// first call and kept in the checkpoint for every later one (thread-safe).
std::shared_ptr<const TokenTable> layer0_token_table(const Checkpoint& ckpt);

// The token table a cache of `scheme` is given: a t0+ scheme's always; a
// preset's when the model's table (vocab x kv_dim x 4 bytes) takes at most
// kPresetTokenTableBytes -- the preset then holds layer 0 as token ids and
// spends the bits they free on the other layers (resolve_kv_preset,
// kvq/kv_cache.h) -- and none past that (a large vocabulary's table costs
// more RAM and time to make than layer 0 saves at moderate context);
// nullptr for every other scheme.
inline constexpr double kPresetTokenTableBytes = 64.0 * 1024 * 1024;
std::shared_ptr<const TokenTable> cache_token_table(const Checkpoint& ckpt, const std::string& scheme);
// Whether presets take the token table of a model of this geometry.
bool presets_take_token_table(const Config& cfg);
// The canonical scheme a cache of `scheme` with max_seq positions is made in
// on this model (what Transformer's cache holds, without making one): a
// preset's resolution (resolve_kv_preset, with cache_token_table's table),
// any other name's canonical form.
std::string resolved_cache_scheme(const Checkpoint& ckpt, const CacheScheme& scheme, int max_seq);

// The BLAS's threads for its own calls (the forward pass runs windows on
// OpenMP threads and each sgemm on the caller's).
void set_blas_threads(int n);
int blas_threads();
// The BLAS's sgemm rate, GFLOP/s: `threads` threads each multiplying (T x n)
// by (n x d)^T, as the forward pass does, for about `seconds`.
double measure_gemm_gflops(int T, int n, int d, int threads, double seconds);

}  // namespace kvq::model
