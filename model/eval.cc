#include "model/eval.h"

#include <omp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include "kvq/error.h"
#include "kvq/file.h"
#include "model/parallel.h"
#include "model/tokens.h"
#include "src/base/names.h"

namespace kvq::model {

std::vector<int> tokenize_stories(const Tokenizer& tok, const std::string& text, const std::string& sep) {
  std::vector<int> out;
  size_t start = 0;
  int stories = 0;
  // Large text says what it does: a live line on a terminal, else one line.
  const bool large = text.size() >= (size_t{1} << 20), tty = large && isatty(2);
  const auto t0 = std::chrono::steady_clock::now();
  auto last = t0;
  if (large && !tty) std::fprintf(stderr, "[kvq] tokenizing %.1f MiB of text\n", text.size() / 1048576.0);
  while (start <= text.size()) {
    if (tty && std::chrono::steady_clock::now() - last > std::chrono::milliseconds(250)) {
      last = std::chrono::steady_clock::now();
      std::fprintf(stderr, "\r[kvq] tokenizing: %.0f%% of %.1f MiB", 100.0 * start / text.size(),
                   text.size() / 1048576.0);
    }
    size_t end = sep.empty() ? std::string::npos : text.find(sep, start);
    if (end == std::string::npos) end = text.size();
    std::string story = text.substr(start, end - start);
    const size_t a = story.find_first_not_of(" \t\r\n\f\v");
    const size_t b = story.find_last_not_of(" \t\r\n\f\v");
    if (a != std::string::npos) {
      story = story.substr(a, b - a + 1);
      const std::vector<int> ids = tok.encode(story, /*bos=*/true);
      out.insert(out.end(), ids.begin(), ids.end());
      ++stories;
    }
    if (end == text.size()) break;
    start = end + sep.size();
  }
  if (large) {
    std::fprintf(stderr, "%s[kvq] tokenized %.1f MiB: %zu tokens in %.1f s\n", tty ? "\r" : "",
                 text.size() / 1048576.0, out.size(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  KVQ_CHECK_ARG(stories > 0, "text: no stories found (only whitespace", sep.empty() ? "" : " and separators '",
                sep, sep.empty() ? "" : "'", ")");
  return out;
}

std::string read_text_file(const std::string& path) {
  const std::vector<uint8_t> b = read_file_whole(path, kMaxTextBytes, "text");
  return std::string(b.begin(), b.end());
}

std::shared_ptr<const Tokenizer> load_tokenizer(const Checkpoint& ckpt, const std::string& path) {
  if (!path.empty()) return std::make_shared<const Tokenizer>(path, ckpt.config().vocab_size);
  if (ckpt.tokenizer() == nullptr) {
    Fail("tokenizer: ", ckpt.tokenizer_problem().empty() ? "the model has none of its own: pass --tokenizer or --tokens"
                                                         : ckpt.tokenizer_problem());
  }
  return {std::shared_ptr<const Tokenizer>{}, ckpt.tokenizer()};  // owned by the checkpoint
}

EvalText load_eval_text(const Checkpoint& ckpt, const std::string& tokenizer_path, const std::string& text_path,
                        const std::string& tokens_path, int ctx, int max_windows, const std::string& story_sep,
                        EvalProtocol protocol) {
  const Config& cfg = ckpt.config();
  EvalText t;
  t.ctx = ctx == 0 ? cfg.seq_len : ctx;
  KVQ_CHECK_ARG(t.ctx >= 1 && t.ctx <= cfg.seq_len, "ctx: expected 1..", cfg.seq_len, " (the model's seq_len), got ",
                ctx);
  KVQ_CHECK_ARG(max_windows >= 0, "max_windows: expected >= 0, got ", max_windows);
  const bool llama = protocol == EvalProtocol::kLlamaPerplexity;
  if (!tokens_path.empty()) {
    t.stream = read_token_file(tokens_path, cfg.vocab_size);
  } else if (llama) {  // the whole file, unstripped, as llama-perplexity tokenizes it
    t.stream = load_tokenizer(ckpt, tokenizer_path)->encode(read_text_file(text_path), /*bos=*/true);
  } else {
    t.stream = tokenize_stories(*load_tokenizer(ckpt, tokenizer_path), read_text_file(text_path), story_sep);
  }
  if (!llama) {
    t.windows = static_cast<int>(t.stream.size() / static_cast<size_t>(t.ctx + 1));
    KVQ_CHECK_ARG(t.windows > 0, "text: ", t.stream.size(), " tokens, fewer than one window of ctx + 1 = ", t.ctx + 1);
    if (max_windows > 0) t.windows = std::min(t.windows, max_windows);
    t.score_begin = 0, t.score_end = t.ctx;
    return t;
  }
  // llama-perplexity: chunks of ctx tokens, BOS first in each, the second
  // half scored; laid out as windows of ctx + 1 (the last id is not read).
  KVQ_CHECK_ARG(t.ctx >= 4, "ctx: llama-perplexity's protocol scores the second half of each chunk: expected >= 4, "
                "got ", t.ctx);
  KVQ_CHECK_ARG(t.stream.size() >= 2 * static_cast<size_t>(t.ctx), "text: ", t.stream.size(),
                " tokens; llama-perplexity's protocol needs at least 2 ctx = ", 2 * static_cast<size_t>(t.ctx));
  const int bos = t.stream.front();
  t.windows = static_cast<int>(t.stream.size() / static_cast<size_t>(t.ctx));
  if (max_windows > 0) t.windows = std::min(t.windows, max_windows);
  std::vector<int> chunks;
  chunks.reserve(static_cast<size_t>(t.windows) * static_cast<size_t>(t.ctx + 1));
  for (int w = 0; w < t.windows; ++w) {
    const size_t at = static_cast<size_t>(w) * static_cast<size_t>(t.ctx);
    chunks.push_back(bos);
    chunks.insert(chunks.end(), t.stream.begin() + static_cast<std::ptrdiff_t>(at) + 1,
                  t.stream.begin() + static_cast<std::ptrdiff_t>(at + static_cast<size_t>(t.ctx)));
    chunks.push_back(0);  // not read: the last scored position predicts the chunk's own last token
  }
  t.stream = std::move(chunks);
  t.score_begin = t.ctx / 2, t.score_end = t.ctx - 1;
  return t;
}

namespace {

// log_softmax of one logits row into out (double precision accumulation).
void LogSoftmax(const float* logits, int n, float* out) {
  float m = logits[0];
  for (int i = 1; i < n; ++i) m = std::max(m, logits[i]);
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(static_cast<double>(logits[i]) - m);
  const double lse = m + std::log(s);
  for (int i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<double>(logits[i]) - lse);
}

int Argmax(const float* x, int n) {
  return static_cast<int>(std::max_element(x, x + n) - x);
}

}  // namespace

namespace {

// One evaluated configuration: a scheme and which cached tokens it reads.
struct Variant {
  CacheScheme scheme;
  WindowPolicy policy;
  std::string label;
};

// Per-token values of one variant against the fp32 reference.
struct TokenValues {
  double nll, nll_ref, kld, p, p_ref;
  bool same_top;
};

// Sums over one window's predicted positions, reduced in window order so
// the thread count does not change any result.
struct WindowSums {
  double nll = 0, nll2 = 0, d = 0, d2 = 0, kld = 0, kld2 = 0, kld_max = 0, dp2 = 0, dp4 = 0, state_bytes = 0, secs = 0;
  double bits_ss = 0;  // grouped schemes: steady-state bits of this window's cache
  int64_t same_top = 0;
  void add(const TokenValues& v) {
    const double dd = v.nll - v.nll_ref, dp = v.p - v.p_ref;
    nll += v.nll, nll2 += v.nll * v.nll, d += dd, d2 += dd * dd;
    kld += v.kld, kld2 += v.kld * v.kld, kld_max = std::max(kld_max, v.kld);
    dp2 += dp * dp, dp4 += dp * dp * dp * dp;
    same_top += v.same_top;
  }
};

// Standard error of a mean from the sums of x and x^2 over n samples (the
// sample variance over n - 1, as llama.cpp's perplexity tool).
double MeanSe(double sum, double sum2, double n) {
  if (n < 2) return 0.0;
  const double mean = sum / n;
  return std::sqrt(std::max(0.0, (sum2 / n - mean * mean) / (n - 1)));
}

// The q-quantile with linear interpolation between order statistics
// (numpy.percentile's default); x is reordered.
double Quantile(std::vector<float>& x, double q) {
  if (x.empty()) return 0.0;
  const double pos = q * static_cast<double>(x.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  std::nth_element(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(lo), x.end());
  const double a = x[lo];
  if (lo + 1 >= x.size()) return a;
  const double b = *std::min_element(x.begin() + static_cast<std::ptrdiff_t>(lo) + 1, x.end());
  return a + (pos - static_cast<double>(lo)) * (b - a);
}

std::string Duration(double secs) {
  char buf[32];
  const long s = std::lround(std::max(0.0, secs));
  std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  return buf;
}

}  // namespace

std::vector<CacheScheme> parse_cache_schemes(const std::string& list, const char* arg) {
  std::vector<CacheScheme> out;
  auto add = [&](const std::string& name) {
    // A preset stays a preset (it resolves per head size when the cache is
    // made); any other name becomes its canonical form.
    const KvSchemeInfo info = describe_kv_scheme(name, arg);
    const bool t0 = info.token_layer;  // t0+<preset> stays one too
    const std::string bare = t0 ? name.substr(3) : name;
    CacheScheme s(grouped_kv_preset(bare, 0) ? (t0 ? "t0+" : "") + bare : info.name);
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  };
  if (list == "all") {
    for (const std::string& n : all_kv_scheme_names()) add(n);
    return out;
  }
  for (const std::string& name : split_list(list)) add(name);
  return out;
}

std::string cache_scheme_label(const CacheScheme& s) { return s.info().label; }

// Steady-state bits of a window: the mean over cache lengths T = ctx - 127
// .. ctx of 8 bytes(T) / (2 T E L), from the bytes the cache held at each
// length (Transformer::cache_bytes_history).
double SteadyStateBits(const std::vector<uint64_t>& history, int ctx, const Config& cfg) {
  const int lo = std::max(1, ctx - 127);
  double s = 0;
  for (int T = lo; T <= ctx; ++T) {
    s += 8.0 * static_cast<double>(history[static_cast<size_t>(T - 1)]) /
         (2.0 * T * cfg.kv_dim() * static_cast<double>(cfg.n_layers));
  }
  return s / (ctx - lo + 1);
}

EvalReport run_eval(const EvalOptions& o) {
  const auto t_load = std::chrono::steady_clock::now();
  Checkpoint ckpt(o.model_path);
  const Config& cfg = ckpt.config();
  KVQ_CHECK_ARG(o.threads >= 0 && o.threads <= kMaxThreads, "threads: expected 0..", kMaxThreads, " (0: default), got ",
                o.threads);
  KVQ_CHECK_ARG(!o.schemes.empty(), "kv: expected at least one scheme");
  const EvalText text =
      load_eval_text(ckpt, o.tokenizer_path, o.text_path, o.tokens_path, o.ctx, o.max_windows, o.story_sep, o.protocol);
  const int ctx = text.ctx, windows = text.windows;
  const int sb = text.score_begin, se = text.score_end, scored = text.scored();
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  const bool tty = o.progress && isatty(2), log = o.progress && !tty;

  EvalReport rep;
  rep.model_path = o.model_path;
  rep.text_path = o.tokens_path.empty() ? o.text_path : o.tokens_path;
  rep.config = cfg;
  rep.weights = ckpt.weights().describe();
  rep.forward = o.forward;
  rep.weight_dot = o.weight_dot;
  const bool batched = o.forward == ForwardPass::kBatched;
  // Windows run in parallel, one per thread: the BLAS runs on the calling
  // thread only.
  if (batched) set_blas_threads(1);
  auto fwd = [&](Transformer& tf, const int* win) {
    const std::span<const int> toks{win, static_cast<size_t>(ctx)};
    return batched ? tf.forward_batched(toks) : tf.forward_window(toks);
  };
  rep.ctx = ctx;
  rep.windows = windows;
  rep.tokens = static_cast<int64_t>(windows) * scored;
  rep.protocol = o.protocol;
  rep.threads = threads;
  const int V = cfg.vocab_size;
  const size_t n_tok = static_cast<size_t>(rep.tokens);

  // One pass over the windows evaluates every variant against the fp32
  // reference computed for that window, so only one window's reference
  // distributions exist at a time (per thread): memory is flat in the number
  // of windows. What is kept per token is the KLD as float32 (for its
  // percentiles) and, when asked, the per-token values.
  // Every configuration is built once before its pass, so a bad scheme,
  // geometry or bank option is one error line before any thread starts.
  auto check = [&](const std::vector<Variant>& vars) {
    for (const Variant& v : vars) Transformer t(ckpt, v.scheme, ctx, v.policy);
  };
  auto run_pass = [&](const std::vector<Variant>& vars, bool report_ref, const char* what) {
    const size_t nv = vars.size();
    std::vector<WindowSums> sums((nv + (report_ref ? 1 : 0)) * static_cast<size_t>(windows));
    const size_t rows = nv + (report_ref ? 1 : 0);
    std::vector<std::vector<float>> kld_tok(rows, std::vector<float>(n_tok));
    std::vector<std::vector<TokenValues>> per_tok(o.per_token ? rows : 0, std::vector<TokenValues>(n_tok));
    ParallelErrors errors;
    int done = 0;
    const auto t0 = std::chrono::steady_clock::now();
    auto last = t0;
    int next_log = 1;
#pragma omp parallel num_threads(threads)
    {
      std::optional<Transformer> ref;
      std::vector<std::optional<Transformer>> tf(nv);
      std::vector<float> ref_logp, logp;
      std::vector<int> ref_top;
      errors.run([&] {
        ref.emplace(ckpt, KvScheme::Fp32, ctx, WindowPolicy{});
        ref->set_weight_dot(o.weight_dot);
        for (size_t i = 0; i < nv; ++i) {
          tf[i].emplace(ckpt, vars[i].scheme, ctx, vars[i].policy);
          tf[i]->set_weight_dot(o.weight_dot);
        }
        ref_logp.resize(static_cast<size_t>(ctx) * static_cast<size_t>(V));
        ref_top.resize(static_cast<size_t>(ctx));
        logp.resize(static_cast<size_t>(V));
      });
#pragma omp for schedule(dynamic, 1)
      for (int w = 0; w < windows; ++w) errors.run([&] {
        if (!ref) return;
        const int* win = text.window(w);
        const size_t base = static_cast<size_t>(w) * static_cast<size_t>(scored);  // position t is base + t - sb
        auto t_var = std::chrono::steady_clock::now();
        const std::span<const float> rl = fwd(*ref, win);
        WindowSums* ws_ref = report_ref ? &sums[static_cast<size_t>(w)] : nullptr;
        for (int t = sb; t < se; ++t) {
          const float* lg = rl.data() + static_cast<size_t>(t) * static_cast<size_t>(V);
          float* lp = ref_logp.data() + static_cast<size_t>(t) * static_cast<size_t>(V);
          LogSoftmax(lg, V, lp);
          ref_top[static_cast<size_t>(t)] = Argmax(lg, V);
          if (ws_ref) {
            const double nll = -lp[win[t + 1]];
            const TokenValues tv{nll, nll, 0.0, std::exp(-nll), std::exp(-nll), true};
            ws_ref->add(tv);
            kld_tok[0][base + static_cast<size_t>(t - sb)] = 0.0f;
            if (o.per_token) per_tok[0][base + static_cast<size_t>(t - sb)] = tv;
          }
        }
        if (ws_ref) {
          ws_ref->state_bytes = static_cast<double>(ref->attention_state_bytes());
          ws_ref->bits_ss = SteadyStateBits(ref->cache_bytes_history(), ctx, cfg);
          ws_ref->secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_var).count();
        }
        for (size_t i = 0; i < nv; ++i) {
          t_var = std::chrono::steady_clock::now();
          const size_t row = i + (report_ref ? 1 : 0);
          WindowSums& ws = sums[row * static_cast<size_t>(windows) + static_cast<size_t>(w)];
          // on the reference's buffers: one set of activations and logits per thread
          const std::span<const int> toks{win, static_cast<size_t>(ctx)};
          const std::span<const float> logits =
              batched ? ref->forward_batched_into(*tf[i], toks) : ref->forward_window_into(*tf[i], toks);
          ws.state_bytes = static_cast<double>(tf[i]->attention_state_bytes());
          if (vars[i].policy.window == 0) ws.bits_ss = SteadyStateBits(tf[i]->cache_bytes_history(), ctx, cfg);
          for (int t = sb; t < se; ++t) {
            const float* lg = logits.data() + static_cast<size_t>(t) * static_cast<size_t>(V);
            const float* rp = ref_logp.data() + static_cast<size_t>(t) * static_cast<size_t>(V);
            LogSoftmax(lg, V, logp.data());
            double kl = 0;
            for (int j = 0; j < V; ++j) {
              kl += std::exp(static_cast<double>(rp[j])) * (static_cast<double>(rp[j]) - logp[static_cast<size_t>(j)]);
            }
            const int target = win[t + 1];
            const double nll = -logp[static_cast<size_t>(target)], nll_ref = -rp[target];
            const TokenValues tv{nll, nll_ref, std::max(kl, 0.0), std::exp(-nll), std::exp(-nll_ref),
                                 Argmax(lg, V) == ref_top[static_cast<size_t>(t)]};
            ws.add(tv);
            kld_tok[row][base + static_cast<size_t>(t - sb)] = static_cast<float>(tv.kld);
            if (o.per_token) per_tok[row][base + static_cast<size_t>(t - sb)] = tv;
          }
          ws.secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_var).count();
        }
        if (o.progress) {
#pragma omp critical(kvq_progress)
          {
            ++done;
            const auto now = std::chrono::steady_clock::now();
            const double el = std::chrono::duration<double>(now - t0).count();
            const double eta = el / done * (windows - done);
            const double tps = static_cast<double>(done) * ctx * static_cast<double>(rows) / el;
            if (tty && (now - last > std::chrono::milliseconds(200) || done == windows)) {
              last = now;
              std::fprintf(stderr, "\r[kvq eval] %s: window %d/%d, %zu configurations, %.0f tok/s, ETA %s   ", what,
                           done, windows, rows, tps, Duration(eta).c_str());
              std::fflush(stderr);
            } else if (log && done * 10 >= next_log * windows) {
              while (done * 10 >= next_log * windows) ++next_log;
              std::fprintf(stderr, "[kvq eval] %s: window %d/%d (%d%%), %zu configurations, %.0f tok/s, ETA %s\n",
                           what, done, windows, 100 * done / windows, rows, tps, Duration(eta).c_str());
              std::fflush(stderr);
            }
          }
        }
      });
    }
    if (tty) std::fprintf(stderr, "\r%100s\r", "");
    errors.rethrow();

    std::vector<SchemeResult> out;
    for (size_t row = 0; row < rows; ++row) {
      const Variant& v = report_ref && row == 0 ? Variant{KvScheme::Fp32, WindowPolicy{}, "fp32"}
                                                : vars[row - (report_ref ? 1 : 0)];
      WindowSums t;
      std::vector<double> running;
      for (int w = 0; w < windows; ++w) {  // fixed order: thread count does not change sums
        const WindowSums& ws = sums[row * static_cast<size_t>(windows) + static_cast<size_t>(w)];
        t.nll += ws.nll, t.nll2 += ws.nll2, t.d += ws.d, t.d2 += ws.d2, t.kld += ws.kld, t.kld2 += ws.kld2;
        if (o.protocol == EvalProtocol::kLlamaPerplexity) {
          running.push_back(std::exp(t.nll / (static_cast<double>(w + 1) * scored)));
        }
        t.kld_max = std::max(t.kld_max, ws.kld_max), t.dp2 += ws.dp2, t.dp4 += ws.dp4;
        t.state_bytes += ws.state_bytes, t.secs += ws.secs, t.same_top += ws.same_top, t.bits_ss += ws.bits_ss;
      }
      const double n = static_cast<double>(n_tok);
      SchemeResult r;
      r.scheme = v.scheme;
      r.label = v.label;
      r.resolved = resolved_cache_scheme(ckpt, v.scheme, ctx);
      r.policy = v.policy;
      r.running_ppl = std::move(running);
      r.mean_nll = t.nll / n;
      r.ppl = std::exp(r.mean_nll);
      r.ppl_se = r.ppl * MeanSe(t.nll, t.nll2, n);
      r.ln_ratio = t.d / n;
      r.ln_ratio_se = MeanSe(t.d, t.d2, n);
      r.kld_mean = t.kld / n;
      r.kld_se = MeanSe(t.kld, t.kld2, n);
      r.kld_max = t.kld_max;
      std::vector<float>& k = kld_tok[row];
      r.kld_p999 = Quantile(k, 0.999);
      r.kld_p99 = Quantile(k, 0.99);
      r.kld_median = Quantile(k, 0.5);
      r.rms_dp = std::sqrt(t.dp2 / n);
      r.rms_dp_se = r.rms_dp > 0 ? MeanSe(t.dp2, t.dp4, n) / (2 * r.rms_dp) : 0.0;
      r.same_top = static_cast<double>(t.same_top) / n;
      r.same_top_se = n > 1 ? std::sqrt(r.same_top * (1 - r.same_top) / (n - 1)) : 0.0;
      r.top1_pct = 100.0 * r.same_top;
      // Throughput as if this configuration alone ran on `threads` threads:
      // tokens over its busy thread-seconds, times the threads.
      r.tokens_per_s = t.secs > 0 ? static_cast<double>(windows) * ctx / t.secs * threads : 0.0;  // tokens read
      // KV bytes attention holds at ctx (mean over windows); effective bits
      // per K/V element of the ctx tokens.
      r.kv_bytes = static_cast<uint64_t>(std::llround(t.state_bytes / windows));
      r.bits_at_ctx = 8.0 * static_cast<double>(r.kv_bytes) /
                      (2.0 * cfg.kv_dim() * static_cast<double>(cfg.n_layers) * static_cast<double>(ctx));
      // Windowed variants hold a fixed window: bits at ctx.
      r.bits_per_element = v.policy.window == 0 ? t.bits_ss / windows : r.bits_at_ctx;
      if (o.per_token) {
        const auto& pt = per_tok[row];
        r.token_nll.resize(n_tok), r.token_nll_ref.resize(n_tok), r.token_kld.resize(n_tok);
        r.token_p.resize(n_tok), r.token_p_ref.resize(n_tok), r.token_same_top.resize(n_tok);
        for (size_t i = 0; i < n_tok; ++i) {
          r.token_nll[i] = pt[i].nll, r.token_nll_ref[i] = pt[i].nll_ref;
          r.token_kld[i] = static_cast<float>(pt[i].kld);  // the values the percentiles saw
          r.token_p[i] = pt[i].p, r.token_p_ref[i] = pt[i].p_ref, r.token_same_top[i] = pt[i].same_top;
        }
      }
      out.push_back(std::move(r));
    }
    return out;
  };

  std::vector<Variant> first;
  std::shared_ptr<const StaticRanges> ranges;
  for (CacheScheme s : o.schemes) {
    if (s.info().needs_ranges && !s.ranges) {
      if (!ranges) {
        CalibrationOptions c = o.calibration;
        if (c.length == 0) c.length = default_calibration_length(cfg, ctx);
        const auto t_cal = std::chrono::steady_clock::now();
        check_calibration_options(cfg, c);  // a bad option is one error line, before any message
        if (o.progress) {
          std::fprintf(stderr, "[kvq eval] calibrating: %d sequences of %d tokens from BOS%s\n", c.sequences, c.length,
                       c.batched ? ", side by side" : " (--calib-batched: side by side, faster on large models)");
        }
        if (c.batched) set_blas_threads(threads);  // one sequence of sgemms: the BLAS takes every thread
        ranges = std::make_shared<const StaticRanges>(calibrate_static_ranges(ckpt, c));
        if (batched) set_blas_threads(1);
        if (o.progress) {
          std::fprintf(stderr, "[kvq eval] calibrated in %.1f s\n",
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - t_cal).count());
        }
        rep.calibration_tokens = ranges->samples;
        rep.calibration = c;
      }
      s.ranges = ranges;
    }
    if (!(s == CacheScheme(KvScheme::Fp32))) first.push_back({s, WindowPolicy{}, cache_scheme_label(s)});
  }
  WindowPolicy slide;
  if (o.window > 0) {
    // SPEC §7 windowed mode, fp32 cache: a sliding window with sinks and the
    // E2 bank behind the same window; then (a second pass, since it needs
    // the bank's bytes) a sliding window given the bank's bytes.
    slide.window = o.window;
    slide.sinks = o.sinks;
    first.push_back({KvScheme::Fp32, slide, "win " + std::to_string(o.window) + "+" + std::to_string(o.sinks)});
    WindowPolicy bank = slide;
    bank.bank = true;
    bank.chunk = o.window_chunk;
    bank.bank_options = o.bank;
    first.push_back({KvScheme::Fp32, bank, "e2 " + std::to_string(o.window) + "+" + std::to_string(o.sinks) + "+bank"});
  }
  check(first);  // before the load message: an option error is stderr's only line
  const double load_secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
  if (o.progress && load_secs > 1.0) {
    std::fprintf(stderr, "[kvq eval] loaded the model and %d windows of text in %.1f s\n", windows, load_secs);
  }
  rep.results = run_pass(first, /*report_ref=*/true, "pass 1");
  if (o.window > 0) {
    const uint64_t per_token = 2ull * KvRowCodec(KvScheme::Fp32, cfg.kv_dim(), cfg.head_size()).row_bytes() *
                               static_cast<uint64_t>(cfg.n_layers);
    WindowPolicy equal = slide;
    equal.window = std::clamp<int>(static_cast<int>(rep.results.back().kv_bytes / per_token) - o.sinks, 1, ctx);
    const std::vector<Variant> second{
        {KvScheme::Fp32, equal, "win " + std::to_string(equal.window) + "+" + std::to_string(o.sinks) + " =e2"}};
    check(second);
    const std::vector<SchemeResult> eq = run_pass(second, /*report_ref=*/false, "pass 2 (=e2)");
    rep.results.push_back(eq.front());
  }
  if (batched) {
    const double L = cfg.n_layers, d = cfg.dim, kv = cfg.kv_dim(), h = cfg.hidden_dim, V = cfg.vocab_size;
    rep.flops_per_token = 2.0 * (L * (2 * d * d + 2 * kv * d + 3 * d * h) + V * d) +
                          4.0 * L * d * (ctx + 1) / 2.0;  // scores and values over the mean length
    rep.forward_gflops = rep.flops_per_token * rep.results.front().tokens_per_s / 1e9;
    rep.gemm_peak_gflops = measure_gemm_gflops(ctx, cfg.dim, cfg.hidden_dim, threads, 1.0);
  }
  const double ref_ppl = rep.results.front().ppl;
  for (SchemeResult& r : rep.results) {
    r.delta_ppl = r.ppl - ref_ppl;
    r.delta_ppl_pct = 100.0 * r.delta_ppl / ref_ppl;
  }
  return rep;
}

std::string format_bounded(double v, int decimals, bool sign) {
  char buf[64];
  if (std::isfinite(v) && std::abs(v) < 1e6) {
    std::snprintf(buf, sizeof buf, sign ? "%+.*f" : "%.*f", decimals, v);
  } else {  // a broken model's PPL (say 3e240) stays one short column
    std::snprintf(buf, sizeof buf, sign ? "%+.2e" : "%.3e", v);
  }
  return buf;
}

std::string format_report(const EvalReport& r) {
  std::ostringstream os;
  char buf[512];
  const Config& c = r.config;
  const bool llama = r.protocol == EvalProtocol::kLlamaPerplexity;
  std::snprintf(buf, sizeof buf,
                "model: %s (dim %d, layers %d, heads %d, kv_heads %d, head_size %d, vocab %d; weights %s, %s dot)\n"
                "text: %s: %lld predicted tokens, %d %s of ctx %d%s, %d threads\n",
                r.model_path.c_str(), c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_size(), c.vocab_size,
                r.weights.c_str(), weight_dot_name(r.weight_dot), r.text_path.c_str(), static_cast<long long>(r.tokens), r.windows, llama ? "chunks" : "windows", r.ctx,
                llama ? " (llama-perplexity's protocol: the whole file tokenized, BOS first in each chunk, its "
                        "second half scored)"
                      : " (+1)",
                r.threads);
  os << buf;
  if (llama) {  // llama-perplexity's running line and final estimate, per configuration
    for (const SchemeResult& s : r.results) {
      os << s.label << ": ";
      for (size_t i = 0; i < s.running_ppl.size(); ++i) {
        std::snprintf(buf, sizeof buf, "[%zu]%.4f,", i + 1, s.running_ppl[i]);
        os << buf;
      }
      std::snprintf(buf, sizeof buf, "\n%s: Final estimate: PPL = %.4f +/- %.5f\n", s.label.c_str(), s.ppl, s.ppl_se);
      os << buf;
    }
  }
  std::snprintf(buf, sizeof buf, "| %-15s | %6s | %10s | %8s | %9s | %8s | %9s | %8s | %7s | %9s |\n", "scheme",
                "bits", "KV bytes", "PPL", "dPPL", "dPPL %", "KLD mean", "KLD max", "top-1 %", "tok/s");
  os << buf;
  os << "|-----------------|--------|------------|----------|-----------|----------|-----------|----------|---------|-----------|\n";
  for (const SchemeResult& s : r.results) {
    std::snprintf(buf, sizeof buf, "| %-15s | %6.3f | %10llu | %8s | %9s | %7s%% | %9.3e | %8.2e | %7.3f | %9.0f |\n",
                  s.label.c_str(), s.bits_per_element, static_cast<unsigned long long>(s.kv_bytes),
                  format_bounded(s.ppl, 5, false).c_str(), format_bounded(s.delta_ppl, 5, true).c_str(),
                  format_bounded(s.delta_ppl_pct, 3, true).c_str(), s.kld_mean, s.kld_max, s.top1_pct,
                  s.tokens_per_s);
    os << buf;
  }
  std::snprintf(buf, sizeof buf, "fp32 mean loss (NLL/token): %.4f\n", r.results.front().mean_nll);
  os << buf;
  if (r.forward == ForwardPass::kBatched && r.gemm_peak_gflops > 0) {
    std::snprintf(buf, sizeof buf,
                  "forward: batched (sgemm + chunked prefill); fp32 row %.1f GFLOP/s (%.2f GFLOP/token) = %.0f%% of "
                  "the BLAS's sgemm peak %.1f GFLOP/s (%d x %d x %d, %d threads, same run)\n",
                  r.forward_gflops, r.flops_per_token / 1e9, 100.0 * r.forward_gflops / r.gemm_peak_gflops,
                  r.gemm_peak_gflops, r.ctx, c.dim, c.hidden_dim, r.threads);
    os << buf;
  }
  os << "bits: every stored bit, in steady state (mean over cache lengths ctx-127..ctx)\n";
  for (const SchemeResult& s : r.results) {
    const std::string& name = s.resolved;
    if (s.label != name && s.policy.window == 0) {
      os << "  " << s.label << " = " << name;
      const std::string plain = s.scheme.info(r.config.head_size()).name;
      const std::string smallest = s.scheme.info().name;
      if (name != plain) {  // a preset with layer 0 as token ids
        os << " (" << r.config.n_layers << " layers, heads of " << r.config.head_size() << ", ctx " << r.ctx
           << ", the model's token table at most " << kPresetTokenTableBytes / 1048576 << " MiB; " << plain
           << " without it)";
      } else if (name != smallest) {
        os << " (at heads of " << r.config.head_size() << "; " << smallest << " at the smallest)";
      }
      os << "\n";
    }
  }
  for (const SchemeResult& s : r.results) {
    if (s.resolved.rfind("t0+", 0) != 0) continue;
    std::snprintf(buf, sizeof buf,
                  "t0+: layer 0 held as token ids (2 bytes a token, counted) and read through the model's layer-0 "
                  "token table (%d ids x K and V of %d values, fp16: %.1f KiB, model memory shared by every cache, "
                  "not counted in KV bytes)\n",
                  r.config.vocab_size, r.config.kv_dim(),
                  4.0 * r.config.vocab_size * static_cast<double>(r.config.kv_dim()) / 1024.0);
    os << buf;
    break;
  }
  if (r.calibration_tokens > 0) {
    std::snprintf(buf, sizeof buf,
                  "calibrated ranges: %lld tokens the model generated (%d sequences from BOS, temperature %g, seed "
                  "%llu, clip %g%s), not the evaluation text\n",
                  static_cast<long long>(r.calibration_tokens), r.calibration.sequences, r.calibration.temperature,
                  static_cast<unsigned long long>(r.calibration.seed), r.calibration.clip,
                  r.calibration.batched ? ", side by side" : "");
    os << buf;
  }
  return os.str();
}

std::string format_statistics(const EvalReport& r) {
  // llama.cpp's `llama-perplexity --kl-divergence` statistics against fp32:
  // every ± is the standard error of the per-token mean.
  std::ostringstream os;
  char buf[512];
  std::snprintf(buf, sizeof buf, "| %-15s | %-20s | %-21s | %-21s | %9s | %9s | %9s | %-17s | %-16s |\n", "scheme",
                "PPL", "ln(PPL/PPL_fp32)", "KLD mean", "KLD med", "KLD p99", "KLD p99.9", "RMS dp %", "same top %");
  os << buf;
  os << "|-----------------|----------------------|-----------------------|-----------------------|-----------|"
        "-----------|-----------|-------------------|------------------|\n";
  for (const SchemeResult& s : r.results) {
    std::snprintf(buf, sizeof buf,
                  "| %-15s | %9s ± %-8.5f | %+10.6f ± %-8.6f | %10.3e ± %-8.2e | %9.2e | %9.2e | %9.2e | %7.3f ± %-7.3f | "
                  "%7.3f ± %-6.3f |\n",
                  s.label.c_str(), format_bounded(s.ppl, 5, false).c_str(), s.ppl_se, s.ln_ratio, s.ln_ratio_se,
                  s.kld_mean, s.kld_se, s.kld_median, s.kld_p99, s.kld_p999, 100 * s.rms_dp, 100 * s.rms_dp_se,
                  100 * s.same_top, 100 * s.same_top_se);
    os << buf;
  }
  return os.str();
}

}  // namespace kvq::model
