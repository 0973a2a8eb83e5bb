// Subcommands of the `kvq` program. Each returns the process exit code:
// 0 success, 2 bad input (a kvq::Error), 1 anything else.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kvq/cluster_bank.h"
#include "model/calibrate.h"

namespace CLI {
class App;
}

namespace kvq::tools {

struct DemoOptions {
  int tokens = 4096;
  int heads = 32;
  int head_dim = 128;
  int threads = 0;  // 0: OpenMP default
};
void AddDemoCommand(CLI::App& app, DemoOptions& opts);
int RunDemo(const DemoOptions& opts);

// Options of the commands that run the model over the evaluation text.
struct ModelTextOptions {
  std::string model, tokenizer, text, json;  // empty paths: the $KVQ_SHARED defaults
  std::string story_sep = "<|endoftext|>";
  int ctx = 0, max_windows = 0, threads = 0;
  std::string command_line;  // as typed (set by main), recorded in the JSON
};

struct EvalCliOptions : ModelTextOptions {
  std::string kv = "all";
  std::string tokens;            // --tokens: pre-tokenized ids instead of --text
  std::string forward = "auto";  // exact, batched, auto (batched for GGUF)
  std::string protocol = "kvq";  // kvq, llama-perplexity (model::EvalProtocol)
  bool per_token = false;
  int window = 0, sinks = 4, window_chunk = 64;
  ClusterBankOptions bank;
  // --k / --v (llama.cpp's -ctk / -ctv): K and V schemes chosen apart.
  std::string k, v;
  int group = 64, recent = 0, keep_first = 0;
  bool kv_given = false;  // --kv on the command line
  model::CalibrationOptions calibration;
};
void AddEvalCommand(CLI::App& app, EvalCliOptions& opts);
int RunEval(const EvalCliOptions& opts);

struct ReceiptsCliOptions : ModelTextOptions {
  int chunk = 128;
  ClusterBankOptions bank;
};
void AddReceiptsCommand(CLI::App& app, ReceiptsCliOptions& opts);
int RunReceipts(const ReceiptsCliOptions& opts);

struct GenerateOptions {
  std::string model, tokenizer, prompt;
  std::string kv;  // empty: fp32, or the loaded cache's scheme
  std::string save_cache, load_cache;
  // --prompt-cache: a directory, redis://... or memory: ("" with the flag: the default directory)
  std::optional<std::string> prompt_cache;
  int prompt_cache_chunk = 256;
  double prompt_cache_max_mb = 0;
  int prompt_cache_ttl = 0;
  std::string prompt_cache_key_file;  // the store's HMAC secret (else KVQ_PREFIX_STORE_KEY)
  double temperature = 0.0;
  uint64_t seed = 0;
  int steps = 256;
  std::string tokens;  // --tokens: the prompt as a token-id file
  int threads = 0;
  int batch = 512;
  bool calib_batched = false;
};
void AddGenerateCommand(CLI::App& app, GenerateOptions& opts);
int RunGenerate(const GenerateOptions& opts);

// $KVQ_SHARED, default ../shared.
std::string SharedDir();

}  // namespace kvq::tools
