// The library half of `kvq generate` (session/generate.h).
#include "session/generate.h"

#include <chrono>
#include <cctype>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <omp.h>
#include <span>
#include <vector>

#include "kvq/error.h"
#include "kvq/file.h"
#include "kvq/kv_cache.h"
#include "model/calibrate.h"
#include "model/eval.h"
#include "model/fingerprint.h"
#include "model/transformer.h"
#include "store/prefix_store.h"

namespace kvq::session {
namespace {

std::string Format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string Format(const char* fmt, ...) {
  va_list a, b;
  va_start(a, fmt);
  va_copy(b, a);
  const int n = std::vsnprintf(nullptr, 0, fmt, a);
  va_end(a);
  std::string s(static_cast<size_t>(std::max(n, 0)) + 1, '\0');
  std::vsnprintf(s.data(), s.size(), fmt, b);
  va_end(b);
  s.resize(static_cast<size_t>(std::max(n, 0)));
  return s;
}

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The session's OpenMP and BLAS threads, set for its duration (n > 0) and
// given back after (a library call leaves the process as it found it).
class ThreadsFor {
 public:
  explicit ThreadsFor(int n) : omp_(omp_get_max_threads()), blas_(model::blas_threads()), set_(n > 0) {
    if (set_) omp_set_num_threads(n), model::set_blas_threads(n);
  }
  ~ThreadsFor() {
    if (set_) omp_set_num_threads(omp_), model::set_blas_threads(blas_);
  }
  ThreadsFor(const ThreadsFor&) = delete;
  ThreadsFor& operator=(const ThreadsFor&) = delete;

 private:
  int omp_, blas_;
  bool set_;
};

}  // namespace

GenerateReport generate(const GenerateOptions& o, const std::function<void(const std::string&)>& on_text,
                        const std::function<void(const std::string&)>& on_status) {
  auto status = [&](const std::string& s) {
    if (on_status) on_status(s);
  };
  KVQ_CHECK_ARG(!o.model.empty(), "--model: expected a checkpoint path");
  KVQ_CHECK_ARG(o.threads >= 0 && o.threads <= 1024, "--threads: expected 0..1024 (0: default), got ", o.threads);
  KVQ_CHECK_ARG(o.batch >= 1 && o.batch <= 65536, "--batch: expected 1..65536, got ", o.batch);
  const model::WeightDot dot = model::parse_weight_dot(o.weight_dot, "--weight-dot");
  KVQ_CHECK_ARG(o.tokens.empty() || o.prompt.empty(), "--tokens: not with --prompt (one prompt, as text or as ids)");
  check_output_path("--save-cache", o.save_cache, {o.model, o.tokenizer, o.load_cache});
  const ThreadsFor threads(o.threads);
  const model::Checkpoint ckpt(o.model);
  const model::Config& cfg = ckpt.config();
  // Token ids in, a model whose tokenizer kvq does not read: ids out.
  const bool ids_only = !o.tokens.empty() && o.tokenizer.empty() && ckpt.tokenizer() == nullptr;
  const std::shared_ptr<const model::Tokenizer> tok_ptr = ids_only ? nullptr : model::load_tokenizer(ckpt, o.tokenizer);
  KVQ_CHECK_ARG(o.steps >= 1 && o.steps <= cfg.seq_len, "--steps: expected 1..", cfg.seq_len, ", got ", o.steps);
  KVQ_CHECK_ARG(std::isfinite(o.temperature) && o.temperature >= 0, "--temperature: expected >= 0");
  for (size_t i = 0; i < o.tokens.size(); ++i) {
    KVQ_CHECK_ARG(o.tokens[i] >= 0 && o.tokens[i] < cfg.vocab_size, "--tokens: id ", o.tokens[i], " at position ", i,
                  " is outside the vocabulary 0..", cfg.vocab_size - 1);
  }
  const std::vector<int> prompt = o.tokens.empty() ? tok_ptr->encode(o.prompt, /*bos=*/true) : o.tokens;
  const int P = static_cast<int>(prompt.size());
  KVQ_CHECK_ARG(P <= o.steps, "--prompt: ", P, " tokens do not fit in --steps ", o.steps);
  // A saved cache holds the prompt but its last token: that token's forward
  // pass gives the logits generation starts from (so a restore always
  // evaluates it, as llama.cpp's prompt cache re-evaluates its last token).
  KVQ_CHECK_ARG(o.save_cache.empty() || P >= 2, "--save-cache: the prompt is ", P,
                " token(s); the cache holds the prompt but its last token, so give --prompt text");
  KVQ_CHECK_ARG(!o.prompt_cache || o.load_cache.empty(), "--prompt-cache: not with --load-cache (one source of the prefix)");
  std::optional<model::Digest> fingerprint;
  if (!o.save_cache.empty() || !o.load_cache.empty() || o.prompt_cache) {
    fingerprint = model::model_fingerprint(o.model, o.tokenizer.empty() ? o.model : o.tokenizer);
  }
  std::optional<store::PrefixStore> pstore;
  if (o.prompt_cache) {
    store::StoreOptions so;
    so.chunk_tokens = o.prompt_cache_chunk;
    so.max_bytes = static_cast<uint64_t>(o.prompt_cache_max_mb * 1048576.0);
    so.ttl_seconds = o.prompt_cache_ttl;
    so.model = fingerprint;
    so.secret = o.prompt_cache_secret;
    pstore.emplace(*o.prompt_cache, so);
  }
  std::optional<model::Transformer> tf;
  int start = 0;
  if (!o.load_cache.empty()) {
    KvCacheExpect e;
    if (!o.kv.empty()) e.scheme = o.kv;
    e.n_layers = cfg.n_layers, e.n_kv_heads = cfg.n_kv_heads, e.head_dim = cfg.head_size();
    e.rope = cfg.rope;
    e.model_fingerprint = fingerprint;
    e.max_seq = o.steps;
    e.token_table = [&ckpt] { return model::layer0_token_table(ckpt); };  // a t0+ cache's
    KvCacheMeta meta;
    KvCache c = KvCache::load(o.load_cache, e, &meta);
    const int n = static_cast<int>(c.tokens());
    KVQ_CHECK_ARG(meta.tokens_digest.has_value(), "--load-cache: '", o.load_cache,
                  "' carries no token-ids digest (expected a file written by kvq generate --save-cache)");
    KVQ_CHECK_ARG(n < P, "--load-cache: the file holds ", n, " tokens; the prompt (", P,
                  " tokens with BOS) must start with them and have at least one more");
    KVQ_CHECK_ARG(model::tokens_digest(std::span(prompt).first(static_cast<size_t>(n))) == *meta.tokens_digest,
                  "--load-cache: the prompt's first ", n, " tokens are not the ones '", o.load_cache, "' holds");
    status(Format("restored %d tokens from %s (kv %s, %llu bytes), evaluating %d prompt token(s)", n,
                  o.load_cache.c_str(), c.info().label.c_str(), static_cast<unsigned long long>(c.bytes()), P - n));
    tf.emplace(ckpt, std::move(c));
    start = n;
  } else {
    const std::vector<model::CacheScheme> schemes = model::parse_cache_schemes(o.kv.empty() ? "fp32" : o.kv, "--kv");
    KVQ_CHECK_ARG(schemes.size() == 1, "--kv: expected one scheme, got '", o.kv, "'");
    model::CacheScheme scheme = schemes.front();
    if (scheme.info().needs_ranges) {  // ranges: never the prompt
      model::CalibrationOptions co;
      // Ranges are per layer and channel: 512 tokens a sequence measure them
      // whatever the prompt and --steps (a 16K prompt calibrated on 16K-token
      // sequences took minutes before the prompt was read).
      co.length = model::default_calibration_length(cfg, 0);
      co.batched = o.calib_batched;
      const auto t_cal = Clock::now();
      scheme.ranges = std::make_shared<const StaticRanges>(model::calibrate_static_ranges(ckpt, co));
      status(Format("calibrated %s's ranges on %d sequences of %d tokens the model generated%s in %.1f s",
                    o.kv.c_str(), co.sequences, co.length, co.batched ? " side by side" : "", Since(t_cal)));
    }
    tf.emplace(ckpt, scheme, o.steps);
  }
  // The prefix store: the longest stored run of full chunks of the prompt
  // but its last token (whose forward pass gives the first logits).
  store::LookupReport lookup;
  if (pstore) {
    KvCache c = tf->cache().Copy();
    if (pstore->longest_prefix(prompt, c, P - 1, &lookup) > 0) {
      tf.emplace(ckpt, std::move(c));
      start = static_cast<int>(lookup.tokens);
    }
  }
  if (o.threads > 0) tf->set_attention_threads(o.threads);
  tf->set_weight_dot(dot);
  GenerateReport r;
  r.weight_dot = model::weight_dot_name(dot);
  r.restored = start;
  r.has_text = tok_ptr != nullptr;
  r.ids = prompt;
  double store_s = 0;
  auto store_if_due = [&] {
    const int64_t T = tf->cache().tokens();
    if (!pstore || T > P || !pstore->plan(tf->cache()).is_end(T)) return;
    const auto t0 = Clock::now();
    uint64_t b = 0;
    r.stored_chunks += pstore->put(prompt, tf->cache(), &b);
    r.stored_bytes += b;
    store_s += Since(t0);
  };
  auto save_if_due = [&] {
    if (o.save_cache.empty() || tf->cache().tokens() != P - 1) return;
    KvCacheMeta meta;
    meta.model_fingerprint = fingerprint;
    meta.tokens_digest = model::tokens_digest(std::span(prompt).first(static_cast<size_t>(P - 1)));
    tf->cache().save(o.save_cache, -1, meta);
    status(Format("saved %d tokens to %s (%llu bytes: %llu the cache holds, %.3f bits/element)", P - 1,
                  o.save_cache.c_str(), static_cast<unsigned long long>(std::filesystem::file_size(o.save_cache)),
                  static_cast<unsigned long long>(tf->cache().bytes()), tf->cache().bits()));
  };
  save_if_due();
  uint64_t rng = o.seed ? o.seed : 0x9E3779B97F4A7C15ull;
  // Each token's text as it is known: the prompt's, then the sampled ones
  // (BOS itself gives nothing).
  auto text = [&](int prev, int next) {
    if (!tok_ptr) return;
    const std::string piece = tok_ptr->decode(prev, next);
    if (!model::Tokenizer::shows_piece(piece)) return;  // a lone ASCII control byte
    r.text += piece;
    if (on_text) on_text(piece);
  };
  const auto t0 = Clock::now();
  // The prompt but its last token: batched passes of at most o.batch tokens,
  // each ending where the prefix store stores a chunk (and, through
  // save_if_due, at P - 1, where --save-cache saves).
  int pos = start;
  while (pos < P - 1) {
    int stop = std::min(P - 1, pos + o.batch);
    if (pstore) stop = static_cast<int>(std::min<int64_t>(stop, pstore->plan(tf->cache()).next_end(pos)));
    tf->prefill(std::span(prompt).subspan(static_cast<size_t>(pos), static_cast<size_t>(stop - pos)), pos);
    r.evaluated += stop - pos;
    r.prefilled += stop - pos;
    pos = stop;
    save_if_due();
    store_if_due();
  }
  r.prefill_seconds = Since(t0) - store_s;
  // The first token is text too unless it is BOS (a tokenizer that adds
  // none, add_bos_token = false as Qwen's: its first token was lost).
  if (tok_ptr && P > 0 && !(tok_ptr->has_bos() && prompt[0] == tok_ptr->bos_id())) text(tok_ptr->bos_id(), prompt[0]);
  for (int i = 0; i < pos; ++i) text(prompt[static_cast<size_t>(i)], prompt[static_cast<size_t>(i) + 1]);
  int token = prompt[static_cast<size_t>(pos)];
  for (; pos < o.steps; ++pos) {
    const std::span<const float> logits = tf->forward(token, pos);
    ++r.evaluated;
    save_if_due();
    store_if_due();
    if (pstore && pos + 1 == P) {
      const double prefill = Since(t0) - store_s;
      status(Format("prompt cache: reused %d of %d prompt tokens (%s, chunks of %d, the first %lld; lookup %.2f ms, "
                    "restore %.2f ms, prefill of %d tokens %.2f ms; stored %d chunk(s), %llu bytes, in %.2f ms)",
                    start, P, pstore->backend().describe().c_str(), pstore->chunk_tokens(tf->cache()),
                    static_cast<long long>(pstore->plan(tf->cache()).end(0)), 1e3 * lookup.lookup_s,
                    1e3 * lookup.restore_s, P - start, 1e3 * prefill, r.stored_chunks,
                    static_cast<unsigned long long>(r.stored_bytes), 1e3 * store_s));
    }
    const int next = pos + 1 < P ? prompt[static_cast<size_t>(pos) + 1] : model::sample_token(logits, o.temperature, rng);
    if (tok_ptr && tok_ptr->ends_text(next)) break;  // BOS delimits llama2.c's sequences; EOS / EOT a BPE model's
    if (pos + 1 >= P) r.ids.push_back(next);
    text(token, next);
    token = next;
  }
  r.seconds = Since(t0);
  // Bits at the length reached, every stored bit counted.
  const KvCache& cache = tf->cache();
  const KvSchemeInfo& info = cache.info();
  r.kv = info.label == info.name ? info.name : info.label + " = " + info.name;
  r.tokens = start + r.evaluated;
  r.bits = cache.bits();
  r.bytes = cache.bytes();
  r.cache_tokens = cache.tokens();
  return r;
}

}  // namespace kvq::session
