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
// --weight-dot: how the passes multiply by quantized weights (model/transformer.h: WeightDot).
void AddWeightDotOption(CLI::App* c, std::string& weight_dot);

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
  std::string weight_dot = "exact";
};
void AddEvalCommand(CLI::App& app, EvalCliOptions& opts);
int RunEval(const EvalCliOptions& opts);

struct ReceiptsCliOptions : ModelTextOptions {
  int chunk = 128;
  ClusterBankOptions bank;
};
void AddReceiptsCommand(CLI::App& app, ReceiptsCliOptions& opts);
int RunReceipts(const ReceiptsCliOptions& opts);

// The prefix store's options (kvq generate, kvq serve).
struct PromptCacheCliOptions {
  // --prompt-cache: a directory, redis://... or memory: ("" with the flag: the default directory)
  std::optional<std::string> prompt_cache;
  int prompt_cache_chunk = 256;
  double prompt_cache_max_mb = 0;
  int prompt_cache_ttl = 0;
  std::string prompt_cache_key_file;  // the store's HMAC secret (else KVQ_PREFIX_STORE_KEY)
};
void AddPromptCacheOptions(CLI::App* c, PromptCacheCliOptions& o);
// The store's secret: --prompt-cache-key-file's bytes, else KVQ_PREFIX_STORE_KEY, else none.
std::string StoreSecret(const std::string& key_file);

struct GenerateOptions : PromptCacheCliOptions {
  std::string model, tokenizer, prompt;
  std::string kv;  // empty: fp32, or the loaded cache's scheme
  std::string save_cache, load_cache;
  double temperature = 0.0;
  uint64_t seed = 0;
  int steps = 256;
  std::string tokens;  // --tokens: the prompt as a token-id file
  int threads = 0;
  int batch = 512;
  bool calib_batched = false;
  std::string weight_dot = "int8";
};
void AddGenerateCommand(CLI::App& app, GenerateOptions& opts);
int RunGenerate(const GenerateOptions& opts);

struct ServeCliOptions : PromptCacheCliOptions {
  std::string model, tokenizer;
  std::string kv = "fp16";
  double kv_budget_mb = 1024;
  int max_seqs = 16, max_queue = 64, step_tokens = 256, threads = 0, calib_tokens = 512;
  bool calib_batched = false;
  std::string admit = "guaranteed";
  std::string host = "127.0.0.1";
  int port = 8080, max_body_kb = 1024, timeout = 30, request_timeout = 30, drain_seconds = 60, connections = 0;
  int max_client_connections = 0;
  std::string chat_template;  // --chat-template: a built-in's name or a file ("" : the GGUF's)
  std::string weight_dot = "int8";
};
void AddServeCommand(CLI::App& app, ServeCliOptions& opts);
int RunServe(const ServeCliOptions& opts);

struct ChatTemplateCliOptions {
  std::string model, tokenizer, chat_template, messages, batch;
  std::optional<std::string> bos, eos;
  bool no_generation_prompt = false, show = false;
};
void AddChatTemplateCommand(CLI::App& app, ChatTemplateCliOptions& opts);
int RunChatTemplate(const ChatTemplateCliOptions& opts);

// $KVQ_SHARED, default ../shared; the default model (stories260K) and the
// tokenizer beside a llama2.c model (empty for a GGUF).
std::string SharedDir();
std::string DefaultModel();
std::string DefaultTokenizerFor(const std::string& model);

}  // namespace kvq::tools
