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
#include "model/parallel.h"

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
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) Fail("text '", path, "': cannot open (", std::strerror(errno), ")");
  if (!S_ISREG(st.st_mode)) Fail("text '", path, "': not a regular file");
  if (static_cast<uint64_t>(st.st_size) > kMaxTextBytes) {
    Fail("text '", path, "': ", static_cast<uint64_t>(st.st_size), " bytes, more than the limit of ", kMaxTextBytes,
         " (256 MiB)");
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) Fail("text '", path, "': cannot open");
  std::string out(static_cast<size_t>(st.st_size), '\0');
  f.read(out.data(), static_cast<std::streamsize>(out.size()));
  out.resize(static_cast<size_t>(f.gcount()));  // a file that shrank meanwhile
  return out;
}

EvalText load_eval_text(const Config& cfg, const std::string& tokenizer_path, const std::string& text_path,
                        int ctx, int max_windows, const std::string& story_sep) {
  Tokenizer tok(tokenizer_path, cfg.vocab_size);
  EvalText t;
  t.ctx = ctx == 0 ? cfg.seq_len : ctx;
  KVQ_CHECK_ARG(t.ctx >= 1 && t.ctx <= cfg.seq_len, "ctx: expected 1..", cfg.seq_len, " (the model's seq_len), got ",
                ctx);
  KVQ_CHECK_ARG(max_windows >= 0, "max_windows: expected >= 0, got ", max_windows);
  t.stream = tokenize_stories(tok, read_text_file(text_path), story_sep);
  t.windows = static_cast<int>(t.stream.size() / static_cast<size_t>(t.ctx + 1));
  KVQ_CHECK_ARG(t.windows > 0, "text: ", t.stream.size(), " tokens, fewer than one window of ctx + 1 = ", t.ctx + 1);
  if (max_windows > 0) t.windows = std::min(t.windows, max_windows);
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

EvalReport run_eval(const EvalOptions& o) {
  Checkpoint ckpt(o.model_path);
  const Config& cfg = ckpt.config();
  KVQ_CHECK_ARG(o.threads >= 0 && o.threads <= kMaxThreads, "threads: expected 0..", kMaxThreads, " (0: default), got ",
                o.threads);
  KVQ_CHECK_ARG(!o.schemes.empty(), "kv: expected at least one scheme");
  const EvalText text = load_eval_text(cfg, o.tokenizer_path, o.text_path, o.ctx, o.max_windows, o.story_sep);
  const int ctx = text.ctx, windows = text.windows;
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();

  std::vector<KvScheme> order = {KvScheme::Fp32};
  for (KvScheme s : o.schemes) {
    if (s != KvScheme::Fp32) order.push_back(s);
  }
  const int V = cfg.vocab_size;
  const size_t per_window = static_cast<size_t>(ctx) * static_cast<size_t>(V);
  std::vector<float> ref_logp(per_window * static_cast<size_t>(windows));
  std::vector<int> ref_top(static_cast<size_t>(ctx) * static_cast<size_t>(windows));

  EvalReport rep;
  rep.model_path = o.model_path;
  rep.text_path = o.text_path;
  rep.config = cfg;
  rep.ctx = ctx;
  rep.windows = windows;
  rep.tokens = static_cast<int64_t>(windows) * ctx;
  rep.threads = threads;
  const bool tty = o.progress && isatty(2);

  auto run_variant = [&](KvScheme scheme, const WindowPolicy& policy, const std::string& label) {
    const bool is_ref = scheme == KvScheme::Fp32 && policy.window == 0;
    std::vector<WindowStats> stats(static_cast<size_t>(windows));
    int done = 0;
    const auto t0 = std::chrono::steady_clock::now();
    { Transformer check(ckpt, scheme, ctx, policy); }  // scheme, geometry and options, before any thread starts
    ParallelErrors errors;
#pragma omp parallel num_threads(threads)
    {
      // Every thread reaches the worksharing loop, failed or not.
      std::optional<Transformer> tf;
      std::vector<float> logp;
      errors.run([&] {
        tf.emplace(ckpt, scheme, ctx, policy);
        logp.resize(static_cast<size_t>(V));
      });
#pragma omp for schedule(dynamic, 1)
      for (int w = 0; w < windows; ++w) errors.run([&] {
        if (!tf) return;
        const int* win = text.window(w);
        const std::span<const float> logits = tf->forward_window({win, static_cast<size_t>(ctx)});
        WindowStats& st = stats[static_cast<size_t>(w)];
        st.state_bytes = static_cast<double>(tf->attention_state_bytes());
        for (int t = 0; t < ctx; ++t) {
          const float* lg = logits.data() + static_cast<size_t>(t) * static_cast<size_t>(V);
          const size_t at = static_cast<size_t>(w) * per_window + static_cast<size_t>(t) * static_cast<size_t>(V);
          const size_t ti = static_cast<size_t>(w) * static_cast<size_t>(ctx) + static_cast<size_t>(t);
          const int target = win[t + 1];
          if (is_ref) {
            LogSoftmax(lg, V, ref_logp.data() + at);
            ref_top[ti] = Argmax(lg, V);
            st.nll -= ref_logp[at + static_cast<size_t>(target)];
            st.top1 += 1;
            continue;
          }
          LogSoftmax(lg, V, logp.data());
          st.nll -= logp[static_cast<size_t>(target)];
          double kl = 0;
          const float* rp = ref_logp.data() + at;
          for (int i = 0; i < V; ++i) {
            kl += std::exp(static_cast<double>(rp[i])) * (static_cast<double>(rp[i]) - logp[static_cast<size_t>(i)]);
          }
          kl = std::max(kl, 0.0);
          st.kld += kl;
          st.kld_max = std::max(st.kld_max, kl);
          st.top1 += Argmax(lg, V) == ref_top[ti];
        }
        if (tty) {
#pragma omp critical(kvq_progress)
          {
            ++done;
            std::fprintf(stderr, "\r[kvq eval] %-24s window %d/%d", label.c_str(), done, windows);
            std::fflush(stderr);
          }
        }
      });
    }
    errors.rethrow();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    SchemeResult r;
    r.scheme = scheme;
    r.label = label;
    r.policy = policy;
    double state = 0;
    double nll = 0, kld = 0;
    int64_t top1 = 0;
    for (const WindowStats& st : stats) {  // fixed order: thread count does not change sums
      state += st.state_bytes;
      nll += st.nll;
      kld += st.kld;
      top1 += st.top1;
      r.kld_max = std::max(r.kld_max, st.kld_max);
    }
    const double n = static_cast<double>(rep.tokens);
    r.mean_nll = nll / n;
    r.ppl = std::exp(r.mean_nll);
    r.kld_mean = kld / n;
    r.top1_pct = 100.0 * static_cast<double>(top1) / n;
    r.tokens_per_s = n / secs;
    // KV bytes attention holds at ctx (mean over windows); effective bits
    // per K/V element of the ctx tokens.
    r.kv_bytes = static_cast<uint64_t>(std::llround(state / windows));
    r.bits_per_element = 8.0 * static_cast<double>(r.kv_bytes) /
                         (2.0 * cfg.kv_dim() * static_cast<double>(cfg.n_layers) * static_cast<double>(ctx));
    rep.results.push_back(r);
    return r;
  };
  for (KvScheme scheme : order) run_variant(scheme, WindowPolicy{}, kv_scheme_name(scheme));
  if (o.window > 0) {
    // SPEC §7 windowed mode, fp32 cache: a sliding window with sinks, the
    // E2 bank behind the same window, and a sliding window given the bank's
    // bytes.
    WindowPolicy slide;
    slide.window = o.window;
    slide.sinks = o.sinks;
    run_variant(KvScheme::Fp32, slide, "win " + std::to_string(o.window) + "+" + std::to_string(o.sinks));
    WindowPolicy bank = slide;
    bank.bank = true;
    bank.chunk = o.window_chunk;
    bank.bank_options = o.bank;
    const SchemeResult b = run_variant(KvScheme::Fp32, bank, "e2 " + std::to_string(o.window) + "+" +
                                                                 std::to_string(o.sinks) + "+bank");
    const uint64_t per_token = 2ull * KvRowCodec(KvScheme::Fp32, cfg.kv_dim(), cfg.head_size()).row_bytes() *
                               static_cast<uint64_t>(cfg.n_layers);
    WindowPolicy equal = slide;
    equal.window = std::clamp<int>(static_cast<int>(b.kv_bytes / per_token) - o.sinks, 1, ctx);
    run_variant(KvScheme::Fp32, equal, "win " + std::to_string(equal.window) + "+" + std::to_string(o.sinks) + " =e2");
  }
  if (tty) std::fprintf(stderr, "\r%60s\r", "");
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
  std::snprintf(buf, sizeof buf,
                "model: %s (dim %d, layers %d, heads %d, kv_heads %d, head_size %d, vocab %d)\n"
                "text: %s: %lld predicted tokens, %d windows of ctx %d (+1), %d threads\n",
                r.model_path.c_str(), c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_size(), c.vocab_size,
                r.text_path.c_str(), static_cast<long long>(r.tokens), r.windows, r.ctx, r.threads);
  os << buf;
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
  return os.str();
}

}  // namespace kvq::model
