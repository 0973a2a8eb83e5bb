// The perplexity receipt (SPEC §7): llama2.c's validation protocol run with
// the K/V cache stored in each scheme, compared with fp32.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvq/kv_scheme.h"
#include "model/calibrate.h"
#include "model/transformer.h"

namespace kvq::model {

// Limits of a run, checked before any work: evaluation text (a regular
// file, read whole) and threads (0: OpenMP's default).
inline constexpr uint64_t kMaxTextBytes = uint64_t{256} << 20;
inline constexpr int kMaxThreads = 1024;

inline const std::string kDefaultStorySep = "<|endoftext|>";

// Splits on `sep` (empty: the whole text is one story), strips each story,
// skips empty ones, encodes each as [BOS] + tokens and concatenates. Throws
// kvq::Error when no story. Text of 1 MiB or more reports its progress on
// stderr.
std::vector<int> tokenize_stories(const Tokenizer& tok, const std::string& text,
                                  const std::string& sep = kDefaultStorySep);
// The whole file; throws kvq::Error naming the path when it cannot be read,
// is not a regular file (a FIFO, /dev/zero, a directory) or is larger than
// kMaxTextBytes.
std::string read_text_file(const std::string& path);

// How the text becomes windows and which positions are scored:
// - kKvq (llama2.c's validation protocol, SPEC §7): stories split on the
//   separator, stripped, [BOS] + tokens each, concatenated; non-overlapping
//   windows of ctx + 1 tokens; every position scored.
// - kLlamaPerplexity (llama.cpp's llama-perplexity): the whole file
//   tokenized as one text with BOS first (or the ids of --tokens, whose first
//   id is taken as BOS); chunks of ctx tokens, each with BOS in place of its
//   first token; the second half of each chunk scored (positions ctx/2 ..
//   ctx-2 predicting ctx/2+1 .. ctx-1); at least 2 ctx tokens.
enum class EvalProtocol { kKvq, kLlamaPerplexity };

// The evaluation stream cut into windows of ctx + 1 tokens (ctx 0: the
// model's seq_len; max_windows 0: every full window), the model reading the
// first ctx of each; positions [score_begin, score_end) are scored, each
// predicting the next token of its window.
struct EvalText {
  std::vector<int> stream;
  int ctx = 0, windows = 0;
  int score_begin = 0, score_end = 0;
  const int* window(int w) const { return stream.data() + static_cast<size_t>(w) * static_cast<size_t>(ctx + 1); }
  int scored() const { return score_end - score_begin; }
};
// The tokenizer at `path`, or (path empty) the model's own; a kvq::Error
// saying why when there is none (e.g. a GGUF with a BPE tokenizer: use
// --tokens).
std::shared_ptr<const Tokenizer> load_tokenizer(const Checkpoint& ckpt, const std::string& path);
// The evaluation stream of a model: the ids in `tokens_path` (tokens.h)
// when it is set, else `text_path` tokenized as the protocol says by
// load_tokenizer.
EvalText load_eval_text(const Checkpoint& ckpt, const std::string& tokenizer_path, const std::string& text_path,
                        const std::string& tokens_path, int ctx, int max_windows,
                        const std::string& story_sep = kDefaultStorySep,
                        EvalProtocol protocol = EvalProtocol::kKvq);

// How eval runs a window: exact = token by token's numbers (the llama2.c
// loop, bitwise what decoding computes); batched = sgemm and chunked
// prefill (Transformer::forward_batched: the same up to summation order).
enum class ForwardPass { kExact, kBatched };

// v with `decimals` decimals (and a sign when asked) while |v| < 1e6, else
// in scientific notation: at most 10 characters for any double.
std::string format_bounded(double v, int decimals, bool sign);

struct EvalOptions {
  std::string model_path, tokenizer_path, text_path;
  std::string tokens_path;  // pre-tokenized ids instead of text (tokens.h)
  ForwardPass forward = ForwardPass::kExact;
  WeightDot weight_dot = WeightDot::kExact;  // quantized weights (transformer.h)
  std::string story_sep = kDefaultStorySep;  // empty: the whole text is one story
  EvalProtocol protocol = EvalProtocol::kKvq;
  std::vector<CacheScheme> schemes;  // fp32 is always computed as the reference
  int ctx = 0;                    // 0: the model's seq_len
  int max_windows = 0;            // 0: all full windows
  int threads = 0;                // 0: OpenMP default
  bool progress = false;          // progress on stderr (a live line on a terminal, else every 10%)
  bool per_token = false;         // keep every token's values in the results
  // Windowed mode (SPEC §7), when window > 0: extra rows for an fp32 cache
  // read through a sliding window of `window` recent tokens + `sinks`, the
  // same window with E2's bank behind it (chunks of window_chunk tokens),
  // and a sliding window holding as many bytes as the bank run did.
  int window = 0;
  int sinks = 4;
  int window_chunk = 64;
  ClusterBankOptions bank;
  // Calibrated grouped schemes without ranges get them from text the model
  // generates (calibrate.h), once per run.
  CalibrationOptions calibration;
};

struct SchemeResult {
  CacheScheme scheme;
  std::string label;     // the scheme's name (a preset's), or the windowed variant
  // The canonical scheme its caches were made in: a preset's resolution at
  // this model's head size and ctx (with layer 0 as token ids where the
  // model gives presets its token table: model::cache_token_table).
  std::string resolved;
  WindowPolicy policy;
  // Stored bits per K/V element in steady state: the mean over cache lengths
  // ctx - 127 .. ctx of what the cache held (windowed variants: at ctx);
  // bits_at_ctx: at ctx.
  double bits_per_element = 0, bits_at_ctx = 0;
  uint64_t kv_bytes = 0;  // bytes attention holds at ctx, all layers (mean over windows)
  double mean_nll = 0, ppl = 0, delta_ppl = 0, delta_ppl_pct = 0;
  double kld_mean = 0, kld_max = 0, top1_pct = 0, tokens_per_s = 0;
  // llama-perplexity's statistics against fp32; *_se: the standard error of
  // the per-token mean (sample variance over n - 1).
  double ppl_se = 0;                     // PPL * se(NLL)
  double ln_ratio = 0, ln_ratio_se = 0;  // mean of NLL - NLL_fp32 = ln(PPL / PPL_fp32)
  double kld_se = 0, kld_median = 0, kld_p99 = 0, kld_p999 = 0;  // percentiles: linear interpolation
  double rms_dp = 0, rms_dp_se = 0;      // RMS of p(target) - p_fp32(target); se by the delta method
  double same_top = 0, same_top_se = 0;  // share of tokens whose argmax is fp32's
  // Per-token values (EvalOptions::per_token), window order.
  std::vector<double> token_nll, token_nll_ref, token_p, token_p_ref;
  std::vector<float> token_kld;
  std::vector<uint8_t> token_same_top;
  // llama-perplexity's protocol: the perplexity over the chunks so far,
  // after each chunk (its running [1]x.xxxx,[2]... line).
  std::vector<double> running_ppl;
};

struct EvalReport {
  std::string model_path, text_path;
  Config config;
  std::string weights;  // the matrices' types and bytes (Weights::describe)
  ForwardPass forward = ForwardPass::kExact;
  WeightDot weight_dot = WeightDot::kExact;
  // The forward pass's arithmetic: FLOPs per predicted token (matrix
  // products and attention at the mean length), the fp32 row's rate, and
  // the BLAS's own sgemm rate on the model's largest projection with the
  // same threads, measured in the same run (batched pass only; else 0).
  double flops_per_token = 0, forward_gflops = 0, gemm_peak_gflops = 0;
  int ctx = 0;
  int windows = 0;
  int64_t tokens = 0;  // predicted positions = windows * scored positions per window
  EvalProtocol protocol = EvalProtocol::kKvq;
  int threads = 1;
  int64_t calibration_tokens = 0;     // tokens the static ranges were measured on (0: none)
  CalibrationOptions calibration;
  std::vector<SchemeResult> results;  // fp32 first, then the requested order
};

// "all" (every row scheme, then the grouped presets) or a comma-separated
// list of KvCache scheme names (row schemes, grouped scheme names, presets;
// kv_cache.h); duplicates removed, order kept. Throws kvq::Error naming
// `arg` on an unknown name.
std::vector<CacheScheme> parse_cache_schemes(const std::string& list, const char* arg = "kv");
// The label eval prints: a preset's name, else the scheme's name.
std::string cache_scheme_label(const CacheScheme& s);

EvalReport run_eval(const EvalOptions& opts);
// A table in the style of llama.cpp's perplexity tool.
std::string format_report(const EvalReport& r);
// The second table: llama-perplexity --kl-divergence statistics with errors.
std::string format_statistics(const EvalReport& r);

}  // namespace kvq::model
