// `kvq eval` and `kvq generate`.
#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <filesystem>
#include <fstream>
#include <map>

#include "CLI/CLI.hpp"
#include "kvq/error.h"
#include "model/calibrate.h"
#include "model/eval.h"
#include "model/llama2.h"
#include "model/receipts.h"
#include "nlohmann/json.hpp"
#include "tools/commands.h"

namespace kvq::tools {

std::string SharedDir() {
  const char* env = std::getenv("KVQ_SHARED");
  return env && *env ? env : "../shared";
}
std::string DefaultModel() { return SharedDir() + "/models/stories260K/stories260K.bin"; }
std::string DefaultTokenizer() { return SharedDir() + "/models/stories260K/tok512.bin"; }
std::string DefaultText() { return SharedDir() + "/data/tinystories-valid-dev.txt"; }

// --json is checked before any work starts: not a directory, not one of the
// run's inputs (same device and inode, so a link to an input counts), and its
// directory exists and takes a new file (one is created there and removed).
void CheckJsonPath(const std::string& path, std::initializer_list<std::string> inputs) {
  if (path.empty()) return;
  struct stat out {};
  if (::stat(path.c_str(), &out) == 0) {
    KVQ_CHECK_ARG(!S_ISDIR(out.st_mode), "--json: '", path, "' is a directory");
    for (const std::string& in : inputs) {
      struct stat st {};
      KVQ_CHECK_ARG(!(::stat(in.c_str(), &st) == 0 && st.st_dev == out.st_dev && st.st_ino == out.st_ino),
                    "--json: '", path, "' is this run's input '", in, "'; refusing to overwrite it");
    }
  }
  const auto dir = std::filesystem::path(path).parent_path();
  KVQ_CHECK_ARG(dir.empty() || std::filesystem::is_directory(dir), "--json: directory '", dir.string(),
                "' does not exist");
  std::string probe = (dir.empty() ? std::string(".kvq-json-XXXXXX") : (dir / ".kvq-json-XXXXXX").string());
  const int fd = ::mkstemp(probe.data());
  KVQ_CHECK_ARG(fd >= 0, "--json: cannot create a file in '", dir.empty() ? "." : dir.string(), "' (",
                std::strerror(errno), ")");
  ::close(fd);
  ::unlink(probe.c_str());
}

// Written to a new temporary file beside it (mkstemp: O_EXCL, so nothing
// that already sits there, a symlink included, is followed) and renamed over
// it: never a partial JSON file, never a temporary file left behind.
void WriteJson(const std::string& path, const nlohmann::json& j) {
  const auto target = std::filesystem::path(path);
  const auto dir = target.parent_path();
  std::string tmp = (dir / (target.filename().string() + ".XXXXXX")).string();
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) Fail("--json: cannot create a temporary file beside '", path, "' (", std::strerror(errno), ")");
  const mode_t mask = ::umask(0);
  ::umask(mask);
  ::fchmod(fd, 0666 & ~mask);  // as an ordinary new file, not mkstemp's 0600
  const std::string text = j.dump(2) + "\n";
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      Fail("--json: write to '", tmp, "' failed (", std::strerror(err), ")");
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0 || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    Fail("--json: cannot write '", path, "' (", std::strerror(err), ")");
  }
}

void AddModelTextOptions(CLI::App* c, ModelTextOptions& o) {
  c->add_option("--model", o.model, "llama2.c checkpoint (default: $KVQ_SHARED/models/stories260K/stories260K.bin)");
  c->add_option("--tokenizer", o.tokenizer, "llama2.c tokenizer.bin (default: .../tok512.bin)");
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
  e.tokenizer_path = o.tokenizer.empty() ? DefaultTokenizer() : o.tokenizer;
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
                       {"shared_classifier", c.shared_classifier}};
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
  c->add_option("--kv", o.kv,
                "comma-separated KV schemes or 'all': row schemes, grouped k<B>[a]v<B>g<G>[p8][m][o<N>[x<X>][w<W>]][r<R>][s<S>], calibrated "
                "k<B>v<B>c[r<R>][s<S>] and presets")
      ->default_val("all")
      ->each([&o](const std::string&) { o.kv_given = true; });
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
    return k;
  }
  g.validate("--k/--v");
  return g;
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
  CheckJsonPath(o.json, {e.model_path, e.tokenizer_path, e.text_path});
  e.per_token = o.per_token;
  KVQ_CHECK_ARG(!o.per_token || !o.json.empty(), "--per-token: expected --json FILE to write them to");
  const model::EvalReport r = model::run_eval(e);
  std::fputs(model::format_report(r).c_str(), stdout);
  std::fputs("\nStatistics against fp32 (llama-perplexity --kl-divergence; ± is the standard error of the mean):\n",
             stdout);
  std::fputs(model::format_statistics(r).c_str(), stdout);
  if (!o.json.empty()) {
    nlohmann::json j = RunJson(o, r.model_path, r.text_path, r.config, r.ctx, r.windows, r.threads);
    j["tokens"] = r.tokens;
    j["results"] = nlohmann::json::array();
    for (const auto& s : r.results) {
      j["results"].push_back({{"scheme", s.scheme.name()},
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
      if (o.per_token) {
        j["results"].back()["per_token"] = {{"nll", s.token_nll},          {"nll_fp32", s.token_nll_ref},
                                            {"kld", s.token_kld},          {"p", s.token_p},
                                            {"p_fp32", s.token_p_ref},     {"same_top", s.token_same_top}};
      }
    }
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
  CheckJsonPath(o.json, {r.model_path, r.tokenizer_path, r.text_path});
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

void AddGenerateCommand(CLI::App& app, GenerateOptions& o) {
  CLI::App* c = app.add_subcommand("generate", "Generate text with the K/V cache in a scheme (text on stdout)");
  c->add_option("--model", o.model, "llama2.c checkpoint");
  c->add_option("--tokenizer", o.tokenizer, "llama2.c tokenizer.bin");
  c->add_option("--prompt", o.prompt, "prompt text (default: empty, start from BOS)");
  c->add_option("--temperature", o.temperature, "0 = greedy (default)")->check(CLI::Range(0.0, 100.0));
  c->add_option("--seed", o.seed, "sampling seed");
  c->add_option("--steps", o.steps, "forward steps, prompt included (default 256, max seq_len)");
  c->add_option("--kv", o.kv, "KV scheme: a row scheme, a grouped scheme (k4v3g64o8r16) or a preset (kvq-4.5)")
      ->default_val("fp32");
}

int RunGenerate(const GenerateOptions& o) {
  const model::Checkpoint ckpt(o.model.empty() ? DefaultModel() : o.model);
  const model::Tokenizer tok(o.tokenizer.empty() ? DefaultTokenizer() : o.tokenizer, ckpt.config().vocab_size);
  const std::vector<model::CacheScheme> schemes = model::parse_cache_schemes(o.kv, "--kv");
  KVQ_CHECK_ARG(schemes.size() == 1, "--kv: expected one scheme, got '", o.kv, "'");
  model::CacheScheme scheme = schemes.front();
  KVQ_CHECK_ARG(o.steps >= 1 && o.steps <= ckpt.config().seq_len, "--steps: expected 1..", ckpt.config().seq_len,
                ", got ", o.steps);
  KVQ_CHECK_ARG(std::isfinite(o.temperature) && o.temperature >= 0, "--temperature: expected >= 0");
  const std::vector<int> prompt = tok.encode(o.prompt, /*bos=*/true);
  KVQ_CHECK_ARG(static_cast<int>(prompt.size()) <= o.steps, "--prompt: ", prompt.size(),
                " tokens do not fit in --steps ", o.steps);
  if (scheme.grouped && scheme.grouped->needs_ranges()) {  // ranges: never the prompt
    scheme.ranges = std::make_shared<const StaticRanges>(model::calibrate_static_ranges(ckpt));
  }
  model::Transformer tf(ckpt, scheme, o.steps);
  uint64_t rng = o.seed ? o.seed : 0x9E3779B97F4A7C15ull;
  int token = prompt[0];
  int generated = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int pos = 0; pos < o.steps; ++pos) {
    const std::span<const float> logits = tf.forward(token, pos);
    int next;
    if (pos + 1 < static_cast<int>(prompt.size())) {
      next = prompt[static_cast<size_t>(pos) + 1];
    } else {
      next = model::sample_token(logits, o.temperature, rng);
    }
    if (next == model::Tokenizer::kBos) break;  // BOS delimits sequences
    const std::string piece = tok.decode(token, next);
    // Like llama2.c's safe_printf: skip lone unprintable bytes.
    if (!(piece.size() == 1 && !std::isprint(static_cast<unsigned char>(piece[0])) &&
          !std::isspace(static_cast<unsigned char>(piece[0])))) {
      std::fputs(piece.c_str(), stdout);
    }
    token = next;
    ++generated;
  }
  std::fputs("\n", stdout);
  std::fflush(stdout);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (const GroupedKvCache* g = tf.grouped_cache()) {  // bits at the length reached, every stored bit counted
    const int64_t T = std::max<int64_t>(1, g->written(0));
    std::fprintf(stderr, "kvq generate: %d tokens, kv %s (%.3f bits/element at %lld tokens, %llu bytes), %.1f tok/s\n",
                 generated, scheme.name().c_str(), g->bits(T), static_cast<long long>(T),
                 static_cast<unsigned long long>(g->bytes(T)), generated / secs);
  } else {
    std::fprintf(stderr, "kvq generate: %d tokens, kv %s (%.3f bits/element, %zu bytes/token), %.1f tok/s\n", generated,
                 kv_scheme_name(scheme.row), tf.cache().bits_per_element(), tf.cache().bytes_per_token(),
                 generated / secs);
  }
  return 0;
}

}  // namespace kvq::tools
