// `kvq eval` and `kvq generate`.
#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include "CLI/CLI.hpp"
#include "kvq/error.h"
#include "kvq/file.h"
#include "model/calibrate.h"
#include "model/eval.h"
#include "model/fingerprint.h"
#include "model/transformer.h"
#include "model/receipts.h"
#include "nlohmann/json.hpp"
#include "model/tokens.h"
#include "session/generate.h"
#include "src/base/names.h"
#include "tools/commands.h"

namespace kvq::tools {

constexpr NamedValue<model::EvalProtocol> kProtocols[] = {{model::EvalProtocol::kKvq, "kvq"},
                                                         {model::EvalProtocol::kLlamaPerplexity, "llama-perplexity"}};

std::string SharedDir() {
  const char* env = std::getenv("KVQ_SHARED");
  return env && *env ? env : "../shared";
}
std::string DefaultModel() { return SharedDir() + "/models/stories260K/stories260K.bin"; }
std::string DefaultTokenizer() { return SharedDir() + "/models/stories260K/tok512.bin"; }
// A GGUF carries its tokenizer (""), a llama2.c checkpoint does not.
std::string DefaultTokenizerFor(const std::string& model) {
  return model::is_gguf_file(model) ? std::string() : DefaultTokenizer();
}
std::string DefaultText() { return SharedDir() + "/data/tinystories-valid-dev.txt"; }

// Whole or not at all (kvq/file.h): never a partial JSON file, never a
// temporary file left behind.
void WriteJson(const std::string& path, const nlohmann::json& j) {
  const std::string text = j.dump(2) + "\n";
  write_file_whole(path, {reinterpret_cast<const uint8_t*>(text.data()), text.size()}, "--json");
}

void AddModelTextOptions(CLI::App* c, ModelTextOptions& o) {
  c->add_option("--model", o.model,
                "GGUF model (llama, qwen2; F32/F16/BF16/Q8_0) or llama2.c checkpoint (default: "
                "$KVQ_SHARED/models/stories260K/stories260K.bin)");
  c->add_option("--tokenizer", o.tokenizer,
                "llama2.c tokenizer.bin (default: a GGUF's own sentencepiece tokenizer, else .../tok512.bin)");
  c->add_option("--text", o.text, "evaluation text (a regular file, <= 256 MiB), stories separated by --story-sep");
  c->add_option("--story-sep", o.story_sep,
                "string between stories; each story is stripped and encoded as [BOS] + tokens ('' : the whole "
                "text is one story)")
      ->capture_default_str();
  c->add_option("--ctx", o.ctx, "context length (default: the model's seq_len)");
  c->add_option("--max-windows", o.max_windows, "at most N windows of ctx + 1 tokens (0: all)");
  c->add_option("--json", o.json, "also write the results as JSON to FILE");
  c->add_option("--threads", o.threads, "threads, 0..1024 (0: OpenMP default)");
}

// The model/text fields shared by model::EvalOptions and model::ReceiptOptions.
template <class Opts>
void FillModelText(const ModelTextOptions& o, Opts& e) {
  e.model_path = o.model.empty() ? DefaultModel() : o.model;
  e.tokenizer_path = o.tokenizer.empty() ? DefaultTokenizerFor(e.model_path) : o.tokenizer;
  e.text_path = o.text.empty() ? DefaultText() : o.text;
  e.story_sep = o.story_sep;
  e.ctx = o.ctx;
  e.max_windows = o.max_windows;
  e.threads = o.threads;
  e.progress = true;
}

// The JSON fields every model-text command reports first. format_version
// counts changes of the JSON layout (2: geometry, command line, statistics).
constexpr int kJsonFormatVersion = 2;
nlohmann::json RunJson(const ModelTextOptions& o, const std::string& model, const std::string& text,
                       const model::Config& c, int ctx, int windows, int threads) {
  nlohmann::json j;
  j["format_version"] = kJsonFormatVersion;
  j["command_line"] = o.command_line;
  j["model"] = model;
  j["model_config"] = {{"dim", c.dim},           {"hidden_dim", c.hidden_dim}, {"n_layers", c.n_layers},
                       {"n_heads", c.n_heads},   {"n_kv_heads", c.n_kv_heads}, {"head_size", c.head_size()},
                       {"vocab_size", c.vocab_size}, {"seq_len", c.seq_len},
                       {"shared_classifier", c.shared_classifier}, {"arch", c.arch},
                       {"norm_eps", c.norm_eps}, {"rope", c.rope.describe()}, {"qkv_bias", c.qkv_bias}};
  j["text"] = text;
  j["story_sep"] = o.story_sep;
  j["ctx"] = ctx;
  j["windows"] = windows;
  j["threads"] = threads;
  return j;
}

void AddBankOptions(CLI::App* c, ClusterBankOptions& b) {
  c->add_option("--max-clusters", b.max_clusters, "ClusterBankOptions::max_clusters")->capture_default_str();
  c->add_option("--birth-distance", b.birth_distance, "ClusterBankOptions::birth_distance")->capture_default_str();
  c->add_option("--merge-distance", b.merge_distance, "ClusterBankOptions::merge_distance")->capture_default_str();
  c->add_option("--outlier-top-k", b.outlier_top_k, "ClusterBankOptions::outlier_top_k")->capture_default_str();
  c->add_option("--ridge", b.ridge, "ClusterBankOptions::ridge")->capture_default_str();
  const std::map<std::string, FarFieldClosure> closures{
      {far_field_closure_name(FarFieldClosure::kTwoPoint), FarFieldClosure::kTwoPoint},
      {far_field_closure_name(FarFieldClosure::kGaussian), FarFieldClosure::kGaussian}};
  c->add_option("--closure", b.closure, "ClusterBankOptions::closure: far-field closure (two-point or gaussian)")
      ->transform(CLI::CheckedTransformer(closures))
      ->default_str(far_field_closure_name(b.closure));
}

void AddEvalCommand(CLI::App& app, EvalCliOptions& o) {
  CLI::App* c = app.add_subcommand("eval", "Perplexity, KL and top-1 of each KV scheme against fp32 on a real model");
  AddModelTextOptions(c, o);
  c->add_option("--tokens", o.tokens,
                "pre-tokenized text instead of --text: a .npy array of token ids (one row, int16..uint64) or raw "
                "little-endian uint32 ids, cut into windows of ctx + 1");
  c->add_option("--forward", o.forward,
                "exact: token-by-token numbers (bitwise what decoding computes); batched: sgemm + chunked prefill "
                "(the same up to summation order, much faster on large models); auto: batched for GGUF models")
      ->check(CLI::IsMember({"auto", "exact", "batched"}))
      ->capture_default_str();
  AddWeightDotOption(c, o.weight_dot);
  c->add_option("--kv", o.kv,
                "comma-separated KV schemes or 'all': row schemes, grouped k<B>[a]v<B>g<G>[p8][m][o<N>[x<X>][w<W>]][r<R>][s<S>], calibrated "
                "k<B>v<B>c[r<R>][s<S>] and presets; t0+<scheme>: layer 0 as token ids read through the model's layer-0 "
                "token table, the rest in <scheme>")
      ->default_val("all")
      ->each([&o](const std::string&) { o.kv_given = true; });
  c->add_option("--protocol", o.protocol,
                "kvq: llama2.c's validation protocol (stories split on --story-sep, windows of ctx + 1, every position "
                "scored); llama-perplexity: llama.cpp's (the whole file tokenized with BOS first, chunks of ctx with "
                "BOS in place of their first token, the second half of each scored, its running [1]x.xxxx line); "
                "a comma-separated list runs each in turn (kvq,llama-perplexity)")
      ->capture_default_str();
  c->add_flag("--per-token", o.per_token,
              "with --json: also every token's NLL, KLD, p(target) and argmax agreement, for each scheme and fp32");
  c->add_option("--window", o.window,
                "also evaluate windowed attention (fp32): a sliding window of N recent tokens + sinks, the same "
                "window with the E2 bank behind it, and a sliding window with the bank's bytes (0: off)");
  c->add_option("--k", o.k,
                "K scheme, chosen apart from V (llama.cpp's -ctk): g<B> (per-channel B-bit codes before RoPE in groups "
                "of --group tokens), cal<B> (per-channel static ranges calibrated on text the model generates) or a "
                "row scheme (then --v must be the same); replaces --kv");
  c->add_option("--v", o.v, "V scheme (llama.cpp's -ctv): g<B>, cal<B> or a row scheme, the same kind as --k");
  c->add_option("--group", o.group, "with --k/--v g<B>: tokens per group (a multiple of 16)")->capture_default_str();
  c->add_option("--recent", o.recent, "with --k/--v: the last R tokens are read exact (fp16)")->capture_default_str();
  c->add_option("--keep-first", o.keep_first, "with --k/--v: the first S tokens are read exact (fp16)")
      ->capture_default_str();
  c->add_option("--calib-sequences", o.calibration.sequences,
                "calibrated schemes: sequences the model generates from BOS for the ranges")
      ->capture_default_str();
  c->add_option("--calib-seed", o.calibration.seed, "calibrated schemes: sampler seed")->capture_default_str();
  c->add_option("--calib-temperature", o.calibration.temperature, "calibrated schemes: sampling temperature")
      ->capture_default_str();
  c->add_flag("--calib-batched", o.calibration.batched,
              "calibrated schemes: generate up to 16 sequences side by side (one sgemm per step: minutes instead of "
              "an hour on a 1B model; other samples, hence other ranges, than the default)");
  c->add_option("--calib-clip", o.calibration.clip,
                "calibrated schemes: share of samples left outside each channel's range at each end")
      ->capture_default_str();
  c->add_option("--sinks", o.sinks, "first tokens always attended in windowed mode")->capture_default_str();
  c->add_option("--window-chunk", o.window_chunk, "tokens per birth_and_merge chunk in windowed mode")
      ->capture_default_str();
  AddBankOptions(c, o.bank);
}

// --k / --v (+ --group, --recent, --keep-first) as one cache scheme.
model::CacheScheme KvPairScheme(const EvalCliOptions& o) {
  auto grouped_bits = [](const std::string& s, const char* prefix, int& bits) {
    const size_t n = std::strlen(prefix);
    if (s.size() != n + 1 || s.compare(0, n, prefix) != 0 || s[n] < '2' || s[n] > '8') return false;
    bits = s[n] - '0';
    return true;
  };
  GroupedKvScheme g;
  g.recent = o.recent;
  g.sinks = o.keep_first;
  if (grouped_bits(o.k, "g", g.k_bits)) {
    KVQ_CHECK_ARG(grouped_bits(o.v, "g", g.v_bits), "--v: with --k ", o.k, " expected g2..g8, got '", o.v, "'");
    g.group = o.group;
  } else if (grouped_bits(o.k, "cal", g.k_bits)) {
    KVQ_CHECK_ARG(grouped_bits(o.v, "cal", g.v_bits), "--v: with --k ", o.k, " expected cal2..cal8, got '", o.v, "'");
    g.calibrated = true;
    g.group = 16;
  } else {
    const KvScheme k = parse_kv_scheme(o.k, "--k");
    const KvScheme v = parse_kv_scheme(o.v, "--v");
    KVQ_CHECK_ARG(k == v, "--k, --v: row schemes store K and V in one scheme (got ", o.k, " and ", o.v,
                  "); K and V apart need grouped codes (g2..g8 or cal2..cal8)");
    return model::CacheScheme(k);
  }
  g.validate("--k/--v");
  return model::CacheScheme(g.name());
}

nlohmann::json EvalJson(const EvalCliOptions& o, const model::EvalReport& r) {
  nlohmann::json j = RunJson(o, r.model_path, r.text_path, r.config, r.ctx, r.windows, r.threads);
  j["tokens"] = r.tokens;
  j["protocol"] = name_of(kProtocols, r.protocol);
  j["weights"] = r.weights;
  j["weight_dot"] = model::weight_dot_name(r.weight_dot);
  j["forward"] = r.forward == model::ForwardPass::kBatched ? "batched" : "exact";
  if (r.gemm_peak_gflops > 0) {
    j["flops_per_token"] = r.flops_per_token;
    j["forward_gflops"] = r.forward_gflops;
    j["gemm_peak_gflops"] = r.gemm_peak_gflops;
  }
  j["results"] = nlohmann::json::array();
  for (const auto& s : r.results) {
    j["results"].push_back({{"scheme", s.resolved},
                            {"label", s.label},
                            {"window", s.policy.window},
                            {"sinks", s.policy.window ? s.policy.sinks : 0},
                            {"bank", s.policy.bank},
                            {"bits_per_element", s.bits_per_element},
                            {"bits_at_ctx", s.bits_at_ctx},
                            {"kv_bytes", s.kv_bytes},
                            {"ppl", s.ppl},
                            {"mean_nll", s.mean_nll},
                            {"delta_ppl", s.delta_ppl},
                            {"delta_ppl_pct", s.delta_ppl_pct},
                            {"kld_mean", s.kld_mean},
                            {"kld_max", s.kld_max},
                            {"top1_pct", s.top1_pct},
                            {"tokens_per_s", s.tokens_per_s},
                            {"ppl_se", s.ppl_se},
                            {"ln_ppl_ratio", s.ln_ratio},
                            {"ln_ppl_ratio_se", s.ln_ratio_se},
                            {"kld_se", s.kld_se},
                            {"kld_median", s.kld_median},
                            {"kld_p99", s.kld_p99},
                            {"kld_p999", s.kld_p999},
                            {"rms_dp", s.rms_dp},
                            {"rms_dp_se", s.rms_dp_se},
                            {"same_top", s.same_top},
                            {"same_top_se", s.same_top_se}});
    if (!s.running_ppl.empty()) j["results"].back()["running_ppl"] = s.running_ppl;
    if (o.per_token) {
      j["results"].back()["per_token"] = {{"nll", s.token_nll},          {"nll_fp32", s.token_nll_ref},
                                          {"kld", s.token_kld},          {"p", s.token_p},
                                          {"p_fp32", s.token_p_ref},     {"same_top", s.token_same_top}};
    }
  }
  return j;
}

int RunEval(const EvalCliOptions& o) {
  model::EvalOptions e;
  FillModelText(o, e);
  if (o.k.empty() && o.v.empty()) {
    e.schemes = model::parse_cache_schemes(o.kv, "--kv");
  } else {
    KVQ_CHECK_ARG(!o.k.empty() && !o.v.empty(), "--k, --v: expected both");
    KVQ_CHECK_ARG(!o.kv_given, "--kv: use either --kv or --k/--v");
    e.schemes = {KvPairScheme(o)};
  }
  e.calibration = o.calibration;
  e.window = o.window;
  e.sinks = o.sinks;
  e.window_chunk = o.window_chunk;
  e.bank = o.bank;
  KVQ_CHECK_ARG(o.window >= 0, "--window: expected >= 0, got ", o.window);
  KVQ_CHECK_ARG(o.sinks >= 0, "--sinks: expected >= 0, got ", o.sinks);
  KVQ_CHECK_ARG(o.window_chunk >= 1, "--window-chunk: expected >= 1, got ", o.window_chunk);
  e.tokens_path = o.tokens;
  KVQ_CHECK_ARG(o.tokens.empty() || o.text.empty(), "--tokens: use either --text or --tokens");
  // One protocol or a comma-separated list (kvq,llama-perplexity): each runs
  // in turn on the same schemes and prints its tables.
  std::vector<model::EvalProtocol> protocols;
  for (const std::string& name : split_list(o.protocol)) {
    const model::EvalProtocol p = parse_name(kProtocols, name, "--protocol");
    KVQ_CHECK_ARG(std::find(protocols.begin(), protocols.end(), p) == protocols.end(), "--protocol: '",
                  name_of(kProtocols, p), "' given twice");
    protocols.push_back(p);
  }
  KVQ_CHECK_ARG(o.window == 0 || (protocols.size() == 1 && protocols[0] == model::EvalProtocol::kKvq),
                "--window: not with --protocol llama-perplexity (windowed attention is scored over whole windows)");
  e.forward = o.forward == "batched" || (o.forward == "auto" && model::is_gguf_file(e.model_path))
                  ? model::ForwardPass::kBatched
                  : model::ForwardPass::kExact;
  e.weight_dot = model::parse_weight_dot(o.weight_dot, "--weight-dot");
  check_output_path("--json", o.json, {e.model_path, e.tokenizer_path, e.text_path, e.tokens_path});
  e.per_token = o.per_token;
  KVQ_CHECK_ARG(!o.per_token || !o.json.empty(), "--per-token: expected --json FILE to write them to");
  std::vector<nlohmann::json> runs;
  for (size_t i = 0; i < protocols.size(); ++i) {
    e.protocol = protocols[i];
    if (protocols.size() > 1) std::printf("%s== protocol %s\n", i == 0 ? "" : "\n", name_of(kProtocols, e.protocol));
    const model::EvalReport r = model::run_eval(e);
    std::fputs(model::format_report(r).c_str(), stdout);
    std::fputs("\nStatistics against fp32 (llama-perplexity --kl-divergence; ± is the standard error of the mean):\n",
               stdout);
    std::fputs(model::format_statistics(r).c_str(), stdout);
    std::fflush(stdout);
    if (!o.json.empty()) runs.push_back(EvalJson(o, r));
  }
  if (!o.json.empty()) {
    // One protocol: its object, as always; several: the first one's object
    // with every run under "protocols" (each of the same shape).
    nlohmann::json j = runs.front();
    if (runs.size() > 1) j["protocols"] = runs;
    WriteJson(o.json, j);
  }
  return 0;
}

void AddReceiptsCommand(CLI::App& app, ReceiptsCliOptions& o) {
  CLI::App* c = app.add_subcommand(
      "receipts", "E2 ClusterBank on the model's real K/V: clusters, outliers, Spearman of its residual vs int8/fp8 error");
  AddModelTextOptions(c, o);
  c->add_option("--chunk", o.chunk, "tokens per birth_and_merge chunk")->capture_default_str();
  AddBankOptions(c, o.bank);
}

int RunReceipts(const ReceiptsCliOptions& o) {
  model::ReceiptOptions r;
  FillModelText(o, r);
  r.chunk = o.chunk;
  r.bank = o.bank;
  check_output_path("--json", o.json, {r.model_path, r.tokenizer_path, r.text_path});
  const model::ReceiptReport rep = model::run_receipts(r);
  std::fputs(model::format_receipts(rep).c_str(), stdout);
  if (!o.json.empty()) {
    nlohmann::json j = RunJson(o, rep.model_path, rep.text_path, rep.config, rep.ctx, rep.windows, rep.threads);
    j["chunk"] = rep.chunk;
    j["bank"] = {{"max_clusters", rep.bank.max_clusters},   {"birth_distance", rep.bank.birth_distance},
                 {"merge_distance", rep.bank.merge_distance}, {"outlier_top_k", rep.bank.outlier_top_k},
                 {"ridge", rep.bank.ridge}, {"closure", far_field_closure_name(rep.bank.closure)}};
    j["layers"] = nlohmann::json::array();
    for (const auto& l : rep.layers) {
      j["layers"].push_back({{"layer", l.layer},
                             {"clusters_mean", l.clusters_mean},
                             {"clusters_max", l.clusters_max},
                             {"births", l.births},
                             {"merges", l.merges},
                             {"tokens", l.tokens},
                             {"outliers", l.outliers},
                             {"mean_residual", l.mean_residual},
                             {"spearman_int8_k", l.rho_int8_k},
                             {"spearman_int8_v", l.rho_int8_v},
                             {"spearman_fp8_k", l.rho_fp8_k},
                             {"spearman_fp8_v", l.rho_fp8_v},
                             {"bytes_per_token_membership", l.bytes_per_token_membership},
                             {"bytes_per_token_seed", l.bytes_per_token_seed},
                             {"fp32_bytes_per_token", l.fp32_bytes_per_token},
                             {"tails_parametric_pct", l.tails_parametric_pct}});
    }
    WriteJson(o.json, j);
  }
  return 0;
}

void AddWeightDotOption(CLI::App* c, std::string& weight_dot) {
  c->add_option("--weight-dot", weight_dot,
                "quantized weights (Q4_0 ... Q6_K, IQ4): int8 = llama.cpp's arithmetic (each activation row rounded "
                "to 8-bit blocks, integer dot products; faster), exact = float32 activations against the "
                "dequantised weights (an F32 copy's numbers)")
      ->check(CLI::IsMember({"int8", "exact"}))
      ->capture_default_str();
}

void AddPromptCacheOptions(CLI::App* c, PromptCacheCliOptions& o) {
  c->add_option("--prompt-cache", o.prompt_cache,
                "a prefix store (a directory, redis://[user:password@]host:port[/db] or memory:; alone: "
                "~/.cache/kvq/prefix): restore the longest run of the prompt's stored chunks, compute the rest, "
                "store the new full chunks (password also from KVQ_REDIS_PASSWORD, never printed)")
      ->expected(0, 1);
  c->add_option("--prompt-cache-chunk", o.prompt_cache_chunk,
                "tokens per chunk (default 256; rounded up to a multiple of the scheme's group)")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--prompt-cache-max-mb", o.prompt_cache_max_mb,
                "directory store: size cap in MiB, least recently used chunks evicted first (default: none)")
      ->check(CLI::Range(0.0, 1e9))
      ->check(CLI::Validator(
          [](const std::string& v) {
            // A cap that rounds to 0 bytes would read as "no cap".
            double mb = 0.0;
            try {
              mb = std::stod(v);
            } catch (const std::exception&) {
              return "expected a number of MiB, got " + v;
            }
            return mb == 0.0 || mb * 1048576.0 >= 1.0 ? std::string()
                                                      : "expected 0 (no cap) or at least one byte (1/1048576 MiB), got " + v;
          },
          "", "at least one byte"));
  c->add_option("--prompt-cache-ttl", o.prompt_cache_ttl, "Redis store: seconds each chunk lives (default: forever)")
      ->check(CLI::Range(0, 1 << 30));
  c->add_option("--prompt-cache-key-file", o.prompt_cache_key_file,
                "a file holding the store's secret (else KVQ_PREFIX_STORE_KEY; never printed): chunks carry an "
                "HMAC-SHA256 under it, and chunks that fail it are not restored");
}

void AddGenerateCommand(CLI::App& app, GenerateOptions& o) {
  CLI::App* c = app.add_subcommand("generate", "Generate text with the K/V cache in a scheme (text on stdout)");
  c->add_option("--model", o.model, "llama2.c checkpoint");
  c->add_option("--tokenizer", o.tokenizer, "llama2.c tokenizer.bin");
  c->add_option("--prompt", o.prompt, "prompt text (default: empty, start from BOS)");
  c->add_option("--tokens", o.tokens,
                "the prompt as token ids instead of text (a .npy file or raw little-endian uint32, as `kvq eval "
                "--tokens` reads; BOS only if the file has it); with a model whose tokenizer kvq does not read, "
                "stdout is the prompt's and the generated token ids");
  c->add_option("--threads", o.threads, "threads, 0..1024 (0: OpenMP default)")->check(CLI::Range(0, 1024));
  c->add_option("--batch", o.batch, "prompt tokens per batched pass (sgemm; default 512)")->check(CLI::Range(1, 65536));
  AddWeightDotOption(c, o.weight_dot);
  c->add_flag("--calib-batched", o.calib_batched,
              "calibrated schemes: generate the calibration sequences side by side (one sgemm per step: faster on "
              "large models, other samples)");
  c->add_option("--temperature", o.temperature, "0 = greedy (default)")->check(CLI::Range(0.0, 100.0));
  c->add_option("--seed", o.seed, "sampling seed");
  c->add_option("--steps", o.steps, "forward steps, prompt included (default 256, max seq_len)");
  c->add_option("--kv", o.kv,
                 "KV scheme: a row scheme, a grouped scheme (k4v3g64o8r16) or a preset (kvq-4.5), any of them as "
                 "t0+<scheme> (layer 0 as token ids); default fp32, with --load-cache the file's");
  c->add_option("--save-cache", o.save_cache,
                "save the KV cache of the prompt's tokens but its last (whose forward pass starts generation) to "
                "FILE: a checksummed KVQS container with the model's fingerprint and the tokens' digest");
  c->add_option("--load-cache", o.load_cache,
                "restore a cache saved by --save-cache and skip the forward pass of the prompt tokens it holds "
                "(the model's fingerprint and the prompt's first tokens must match the file's)");
  AddPromptCacheOptions(c, o);
}

// The prefix store's secret: the key file's bytes (one trailing newline
// dropped, as `openssl rand -hex 32 > f` writes one), else
// KVQ_PREFIX_STORE_KEY, else none. An empty secret is an error.
std::string StoreSecret(const std::string& key_file) {
  std::string s;
  if (!key_file.empty()) {
    const std::vector<uint8_t> b = read_file_whole(key_file, 1 << 16, "--prompt-cache-key-file");
    s.assign(b.begin(), b.end());
    if (!s.empty() && s.back() == '\n') s.pop_back();
    if (!s.empty() && s.back() == '\r') s.pop_back();
    KVQ_CHECK_ARG(!s.empty(), "--prompt-cache-key-file '", key_file, "': empty (expected a secret)");
  } else if (const char* e = std::getenv("KVQ_PREFIX_STORE_KEY")) {
    s = e;
    KVQ_CHECK_ARG(!s.empty(), "KVQ_PREFIX_STORE_KEY: set but empty (expected a secret, or unset it)");
  }
  return s;
}

int RunGenerate(const GenerateOptions& o) {
  session::GenerateOptions g;
  g.model = o.model.empty() ? DefaultModel() : o.model;
  g.tokenizer = o.tokenizer.empty() ? DefaultTokenizerFor(g.model) : o.tokenizer;
  g.prompt = o.prompt;
  g.kv = o.kv;
  g.save_cache = o.save_cache, g.load_cache = o.load_cache;
  g.prompt_cache = o.prompt_cache;
  g.prompt_cache_chunk = o.prompt_cache_chunk;
  g.prompt_cache_max_mb = o.prompt_cache_max_mb;
  g.prompt_cache_ttl = o.prompt_cache_ttl;
  if (o.prompt_cache) g.prompt_cache_secret = StoreSecret(o.prompt_cache_key_file);
  g.temperature = o.temperature;
  g.seed = o.seed;
  g.steps = o.steps;
  g.threads = o.threads;
  g.batch = o.batch;
  g.calib_batched = o.calib_batched;
  g.weight_dot = o.weight_dot;
  if (!o.tokens.empty()) g.tokens = model::read_token_file(o.tokens, std::numeric_limits<int>::max());
  const session::GenerateReport r = session::generate(
      g, [](const std::string& piece) { std::fputs(piece.c_str(), stdout); },
      [](const std::string& line) { std::fprintf(stderr, "kvq generate: %s\n", line.c_str()); });
  if (!r.has_text) {  // no tokenizer kvq reads: the ids
    for (size_t i = 0; i < r.ids.size(); ++i) std::printf("%s%d", i ? " " : "", r.ids[i]);
  }
  std::fputs("\n", stdout);
  std::fflush(stdout);
  const int decoded = r.evaluated - r.prefilled;
  std::fprintf(stderr, "kvq generate: %d tokens (%d restored, %d prefilled in %.3f s: %.1f tok/s), kv %s (%.3f "
               "bits/element at %lld tokens, %llu bytes), weights %s, %.1f tok/s\n",
               r.tokens, r.restored, r.prefilled, r.prefill_seconds,
               r.prefill_seconds > 0 ? r.prefilled / r.prefill_seconds : 0.0, r.kv.c_str(), r.bits,
               static_cast<long long>(r.cache_tokens), static_cast<unsigned long long>(r.bytes), r.weight_dot.c_str(),
               r.seconds > r.prefill_seconds ? decoded / (r.seconds - r.prefill_seconds) : 0.0);
  return 0;
}

}  // namespace kvq::tools
