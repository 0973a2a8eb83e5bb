// The continuous-batching engine of `kvq serve` (serve/engine.h).
#include "serve/engine.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <malloc.h>
#include <omp.h>
#include <span>

#include "kvq/error.h"
#include "kvq/kv_cache.h"
#include "model/calibrate.h"
#include "model/checkpoint.h"
#include "model/eval.h"
#include "model/fingerprint.h"
#include "model/sampling.h"
#include "model/tokenizer.h"
#include "model/transformer.h"
#include "store/prefix_store.h"

namespace kvq::serve {

using Clock = std::chrono::steady_clock;
namespace {
double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The final event of a request that failed: `status` is the HTTP status it maps to.
Event Failed(std::string message, int status) {
  Event e;
  e.done = true;
  e.finish_reason = "error";
  e.error = std::move(message);
  e.status = status;
  return e;
}
}  // namespace

bool Job::next(Event& e, std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  if (!cv_.wait_for(lk, timeout, [&] { return !events_.empty(); })) return false;
  e = std::move(events_.front());
  events_.pop_front();
  return true;
}

void Job::Push(Event e) {
  {
    std::lock_guard lk(mu_);
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

struct Engine::SchemeHolder {
  model::CacheScheme scheme;
};

struct Engine::Seq {
  std::shared_ptr<Job> job;
  std::vector<int> ids;  // the prompt, then the tokens sampled so far
  int prompt_len = 0;
  int limit = 0;  // prompt + max_tokens: the cache's size
  int generated = 0;
  uint64_t reserved = 0;
  uint64_t rng = 0;
  uint64_t order = 0;  // admission order: the newest is preempted first
  std::unique_ptr<model::Transformer> tf;
  std::string text;  // the sampled tokens' text
  size_t sent = 0;   // of which the client has this much
  bool finished = false;
};

Engine::Engine(const EngineOptions& o) : o_(o), scheme_(std::make_unique<SchemeHolder>()) {
  KVQ_CHECK_ARG(!o.model.empty(), "--model: expected a checkpoint path");
  KVQ_CHECK_ARG(std::isfinite(o.kv_budget_mb) && o.kv_budget_mb > 0 && o.kv_budget_mb <= 1 << 24,
                "--kv-budget-mb: expected a size in MiB in (0, 2^24]");
  KVQ_CHECK_ARG(o.max_seqs >= 1 && o.max_seqs <= 4096, "--max-seqs: expected 1..4096, got ", o.max_seqs);
  KVQ_CHECK_ARG(o.max_queue >= 0 && o.max_queue <= 65536, "--max-queue: expected 0..65536, got ", o.max_queue);
  KVQ_CHECK_ARG(o.step_tokens >= 1 && o.step_tokens <= 65536, "--step-tokens: expected 1..65536, got ",
                o.step_tokens);
  KVQ_CHECK_ARG(o.threads >= 0 && o.threads <= 1024, "--threads: expected 0..1024 (0: default), got ", o.threads);
  if (o.threads > 0) model::set_blas_threads(o.threads);
  ckpt_ = std::make_unique<model::Checkpoint>(o.model);
  const model::Config& cfg = ckpt_->config();
  if (!o.tokenizer.empty() || ckpt_->tokenizer() != nullptr || !ckpt_->is_gguf()) {
    tok_ = model::load_tokenizer(*ckpt_, o.tokenizer);
  }
  const std::vector<model::CacheScheme> schemes = model::parse_cache_schemes(o.kv, "--kv");
  KVQ_CHECK_ARG(schemes.size() == 1, "--kv: expected one scheme, got '", o.kv, "'");
  scheme_->scheme = schemes.front();
  if (scheme_->scheme.info().needs_ranges) {
    model::CalibrationOptions co;
    KVQ_CHECK_ARG(o.calib_tokens >= 1, "--calib-tokens: expected >= 1, got ", o.calib_tokens);
    co.length = std::min(cfg.seq_len, o.calib_tokens);
    co.batched = o.calib_batched;
    scheme_->scheme.ranges = std::make_shared<const StaticRanges>(model::calibrate_static_ranges(*ckpt_, co));
  }
  // A preset resolves once, for the model's context: every sequence and
  // every stored prefix in the same scheme (with a small token table,
  // layer 0 as token ids: model::cache_token_table).
  const std::string asked = scheme_->scheme.name;
  scheme_->scheme.name = model::resolved_cache_scheme(*ckpt_, scheme_->scheme, cfg.seq_len);
  const KvSchemeInfo info = scheme_->scheme.info(cfg.head_size());
  kv_label_ = asked == info.name ? info.name : asked + " = " + info.name;
  budget_ = static_cast<uint64_t>(o.kv_budget_mb * 1048576.0);
  // What one token can add to a cache: a row scheme its token's bytes
  // exactly; a grouped one is given a float32 K and V row a layer (its open
  // tokens and the units outside its grid are held in fp16 or fewer bits).
  row_bytes_ = static_cast<uint64_t>(cfg.n_layers) * 2 * static_cast<uint64_t>(cfg.kv_dim()) * sizeof(float);
  KVQ_CHECK_ARG(o.admit == "guaranteed" || o.admit == "packed", "--admit: expected guaranteed or packed, got '",
                o.admit, "'");
  if (info.family != "rows" && o.admit == "guaranteed") {  // a grouped cache's tokens held open: G + sinks + recent
    const KvCache probe(info.name, cfg.n_layers, cfg.seq_len, cfg.n_kv_heads, cfg.head_size(),
                        scheme_->scheme.ranges.get(), cfg.rope,
                        info.token_layer ? model::layer0_token_table(*ckpt_) : nullptr);
    const KvRangeAlignment a = probe.range_alignment();
    open_tokens_ = a.unit + a.offset;
  }
  if (info.family == "rows") {
    row_bytes_ = static_cast<uint64_t>(std::ceil(kv_scheme_layer_bytes(info.name, 1, cfg.n_kv_heads, cfg.head_size()))) *
                 static_cast<uint64_t>(cfg.n_layers);
  }
  if (o.prompt_cache) {
    store::StoreOptions so;
    so.chunk_tokens = o.prompt_cache_chunk;
    so.max_bytes = static_cast<uint64_t>(o.prompt_cache_max_mb * 1048576.0);
    so.ttl_seconds = o.prompt_cache_ttl;
    so.model = model::model_fingerprint(o.model, o.tokenizer.empty() ? o.model : o.tokenizer);
    so.secret = o.prompt_cache_secret;
    pstore_ = std::make_unique<store::PrefixStore>(*o.prompt_cache, so);
    m_.prefix_store_up = pstore_->backend().alive() ? 1 : 0;
  }
  driver_ = std::make_unique<model::Transformer>(*ckpt_, model::CacheScheme("fp32"), 1);
  driver_->set_weight_dot(model::parse_weight_dot(o.weight_dot, "--weight-dot"));
  model_id_ = std::filesystem::path(o.model).stem().string();
  m_.kv_budget_bytes = budget_;
  thread_ = std::thread([this] { Loop(); });
}

Engine::~Engine() { shutdown(); }

void Engine::shutdown() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::vector<int> Engine::encode(const std::string& text) const {
  KVQ_CHECK_ARG(tok_ != nullptr, "prompt: this model's tokenizer is not one kvq reads (",
                ckpt_->tokenizer_problem(), "); give the prompt as token ids");
  return tok_->encode(text, /*bos=*/true);
}

int Engine::context_length() const { return ckpt_->config().seq_len; }
int Engine::vocab_size() const { return ckpt_->config().vocab_size; }

uint64_t Engine::reserve_bytes(int tokens) const {
  const model::Config& cfg = ckpt_->config();
  const double layer = kv_scheme_layer_bytes(scheme_->scheme.info(cfg.head_size()).name, tokens, cfg.n_kv_heads, cfg.head_size());
  // A grouped cache's least bytes count its tokens in groups; up to
  // open_tokens_ of them are held open in fp16 (K and V) meanwhile.
  const uint64_t open = static_cast<uint64_t>(std::min(tokens, open_tokens_)) * 2 *
                        static_cast<uint64_t>(cfg.kv_dim()) * 2;
  return (static_cast<uint64_t>(std::ceil(layer)) + open) * static_cast<uint64_t>(cfg.n_layers);
}

std::shared_ptr<Job> Engine::submit(Request r, Refused* refused) {
  auto refuse = [&](int status, std::string param, std::string message) -> std::shared_ptr<Job> {
    if (refused != nullptr) *refused = {status, std::move(message), std::move(param)};
    std::lock_guard lk(mu_);
    ++m_.requests_refused;
    return nullptr;
  };
  const int P = static_cast<int>(r.prompt.size());
  if (P == 0) return refuse(400, "prompt", "the prompt is empty");
  for (size_t i = 0; i < r.prompt.size(); ++i) {
    if (r.prompt[i] < 0 || r.prompt[i] >= vocab_size()) {
      return refuse(400, "prompt", "token id " + std::to_string(r.prompt[i]) + " at position " + std::to_string(i) +
                                       " is outside the vocabulary 0.." + std::to_string(vocab_size() - 1));
    }
  }
  if (r.max_tokens < 1) return refuse(400, "max_tokens", "max_tokens must be at least 1");
  if (static_cast<int64_t>(P) + r.max_tokens > context_length()) {
    return refuse(400, "max_tokens",
                  "This model's maximum context length is " + std::to_string(context_length()) +
                      " tokens, however you requested " + std::to_string(static_cast<int64_t>(P) + r.max_tokens) +
                      " tokens (" + std::to_string(P) + " in your prompt; " + std::to_string(r.max_tokens) +
                      " for the completion)");
  }
  if (!std::isfinite(r.temperature) || r.temperature < 0 || r.temperature > 2) {
    return refuse(400, "temperature", "temperature must be in [0, 2]");
  }
  if (!std::isfinite(r.top_p) || r.top_p <= 0 || r.top_p > 1) return refuse(400, "top_p", "top_p must be in (0, 1]");
  const uint64_t need = reserve_bytes(P + r.max_tokens);
  if (need > budget_) {
    return refuse(400, "max_tokens",
                  "the request's KV cache (" + std::to_string(P + r.max_tokens) + " tokens, " +
                      std::to_string(need) + " bytes in " + kv_label_ + ") exceeds the server's budget of " +
                      std::to_string(budget_) + " bytes");
  }
  auto s = std::make_unique<Seq>();
  s->ids = r.prompt;
  s->prompt_len = P;
  s->limit = P + r.max_tokens;
  s->reserved = need;
  s->rng = r.seed ? r.seed : 0x9E3779B97F4A7C15ull;
  std::shared_ptr<Job> job;
  {
    std::lock_guard lk(mu_);
    if (draining_ || stop_) {
      ++m_.requests_refused;
      if (refused != nullptr) *refused = {503, "the server is shutting down", ""};
      return nullptr;
    }
    // At most max_queue requests wait: those the scheduler could not admit
    // (m_.queued, at its last look) and, once one could not, every arrival.
    // Until then an arrival may take a free sequence slot.
    const size_t free_slots = m_.queued > 0 ? 0 : static_cast<size_t>(std::max(0, o_.max_seqs - m_.running));
    if (queue_.size() >= static_cast<size_t>(o_.max_queue) + free_slots) {
      ++m_.requests_refused;
      if (refused != nullptr) {
        *refused = {503, "the server is busy: " + std::to_string(queue_.size()) + " requests are queued", ""};
      }
      return nullptr;
    }
    job.reset(new Job(std::move(r), next_id_++));
    s->job = job;
    ++m_.requests;
    m_.prompt_tokens += static_cast<uint64_t>(P);
    queue_.push_back(std::move(s));
    m_.queued = static_cast<int>(queue_.size());
  }
  cv_.notify_all();
  return job;
}

Metrics Engine::metrics() const {
  std::lock_guard lk(mu_);
  return m_;
}

void Engine::drain() {
  std::deque<std::unique_ptr<Seq>> q;
  {
    std::lock_guard lk(mu_);
    draining_ = true;
    q.swap(queue_);
    m_.queued = 0;
  }
  for (auto& s : q) {
    s->job->Push(Failed("the server is shutting down", 503));
  }
  cv_.notify_all();
}

bool Engine::idle() const {
  std::lock_guard lk(mu_);
  return queue_.empty() && m_.running == 0;
}

uint64_t Engine::CachedBytes() const {
  uint64_t b = 0;
  for (const auto& s : running_) {
    if (s->tf) b += s->tf->cache().bytes();
  }
  return b;
}

void Engine::Loop() {
  // This thread's OpenMP teams, and the BLAS's (process-wide): OpenBLAS's
  // own default is every core, and after each sgemm (a prompt's prefill) its
  // idle workers spin on sched_yield for a while, taking the core the HTTP
  // threads and the client need (at one sequence, a third of the time).
  if (o_.threads > 0) omp_set_num_threads(o_.threads), model::set_blas_threads(o_.threads);
  for (;;) {
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty() || !running_.empty(); });
      if (stop_) break;
    }
    try {
      Admit();
      Step();
    } catch (const std::exception& ex) {  // a bug or an exhausted machine: fail what runs, keep serving
      std::fprintf(stderr, "kvq serve: step failed: %s\n", ex.what());
      outbox_.clear();
      for (auto& s : running_) {
        s->job->Push(Failed(std::string("the step failed: ") + ex.what(), 500));
      }
      while (!running_.empty()) Release(running_.size() - 1);
    }
  }
  std::deque<std::unique_ptr<Seq>> q;
  {
    std::lock_guard lk(mu_);
    q.swap(queue_);
  }
  for (auto& s : running_) q.push_back(std::move(s));
  running_.clear();
  for (auto& s : q) {
    s->job->Push(Failed("the server stopped", 503));
  }
}

void Engine::Admit() {
  for (;;) {
    std::unique_ptr<Seq> s;
    {
      std::lock_guard lk(mu_);
      while (!queue_.empty() && queue_.front()->job->cancelled()) {
        queue_.pop_front();
        ++m_.requests_cancelled;
      }
      if (queue_.empty() || running_.size() >= static_cast<size_t>(o_.max_seqs) ||
          reserved_ + queue_.front()->reserved > budget_) {
        m_.queued = static_cast<int>(queue_.size());
        return;
      }
      s = std::move(queue_.front());
      queue_.pop_front();
      reserved_ += s->reserved;
      m_.queued = static_cast<int>(queue_.size());
      m_.kv_reserved_bytes = reserved_;
    }
    // The sequence's cache: empty, or its prompt's longest stored prefix.
    const model::Config& cfg = ckpt_->config();
    auto empty = [&] {
      const KvSchemeInfo info = scheme_->scheme.info(cfg.head_size());
      return KvCache(info.name, cfg.n_layers, s->limit, cfg.n_kv_heads, cfg.head_size(), scheme_->scheme.ranges.get(),
                     cfg.rope, info.token_layer ? model::layer0_token_table(*ckpt_) : nullptr);
    };
    try {
      KvCache c = empty();
      if (pstore_) {
        try {
          store::LookupReport rep;
          const int64_t n = pstore_->longest_prefix(s->ids, c, static_cast<int64_t>(s->ids.size()) - 1, &rep);
          std::lock_guard lk(mu_);
          m_.prefix_store_up = pstore_->backend().alive() ? 1 : 0;
          ++m_.prefix_lookups;
          if (n > 0) {
            ++m_.prefix_hits;
            m_.prefix_tokens_reused += static_cast<uint64_t>(n);
            m_.prefix_bytes_reused += rep.bytes;
          }
        } catch (const std::exception& ex) {  // a store fault is a miss, on a cache nothing was restored into
          std::fprintf(stderr, "kvq serve: prefix store: %s\n", ex.what());
          c = empty();
        }
      }
      s->tf = std::make_unique<model::Transformer>(*ckpt_, std::move(c));
    } catch (const std::exception& ex) {  // out of memory: this request fails, the others run on
      {
        std::lock_guard lk(mu_);
        reserved_ -= s->reserved;
        m_.kv_reserved_bytes = reserved_;
      }
      s->job->Push(Failed(std::string("the sequence's cache could not be built: ") + ex.what(), 500));
      continue;
    }
    if (o_.threads > 0) s->tf->set_attention_threads(o_.threads);
    s->order = ++admitted_;
    running_.push_back(std::move(s));
    std::lock_guard lk(mu_);
    m_.running = static_cast<int>(running_.size());
    m_.running_peak = std::max(m_.running_peak, m_.running);
  }
}

void Engine::Release(size_t i) {
  std::lock_guard lk(mu_);
  reserved_ -= running_[i]->reserved;
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
  m_.running = static_cast<int>(running_.size());
  m_.kv_reserved_bytes = reserved_;
}

void Engine::Preempt() {
  size_t newest = 0;
  for (size_t i = 1; i < running_.size(); ++i) {
    if (running_[i]->order > running_[newest]->order) newest = i;
  }
  std::unique_ptr<Seq> s = std::move(running_[newest]);
  s->tf.reset();  // its cache is freed; recomputed from s->ids when it is admitted again
  std::lock_guard lk(mu_);
  reserved_ -= s->reserved;
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(newest));
  queue_.push_front(std::move(s));
  ++m_.preemptions;
  m_.running = static_cast<int>(running_.size());
  m_.queued = static_cast<int>(queue_.size());
  m_.kv_reserved_bytes = reserved_;
}

void Engine::Finish(Seq& s, const std::string& reason) {
  Event e;
  e.text = s.text.substr(s.sent);
  s.sent = s.text.size();
  e.done = true;
  e.finish_reason = reason;
  e.prompt_tokens = s.prompt_len;
  e.completion_tokens = s.generated;
  s.finished = true;
  outbox_.emplace_back(s.job, std::move(e));
  std::lock_guard lk(mu_);
  ++m_.requests_finished;
}

void Engine::StoreIfDue(Seq& s) {
  if (!pstore_) return;
  const KvCache& c = s.tf->cache();
  const int64_t T = c.tokens();
  if (T > s.prompt_len || !pstore_->plan(c).is_end(T)) return;
  try {
    uint64_t b = 0;
    const int n = pstore_->put(s.ids, c, &b);
    const std::optional<uint64_t> held = pstore_->backend().held_bytes();
    std::lock_guard lk(mu_);
    m_.prefix_store_up = pstore_->backend().alive() ? 1 : 0;
    m_.prefix_chunks_stored += static_cast<uint64_t>(n);
    m_.prefix_bytes_stored += b;
    if (held) m_.prefix_store_bytes = *held;
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "kvq serve: prefix store: %s\n", ex.what());
  }
}

bool Engine::Step() {
  const auto t0 = Clock::now();
  for (size_t i = running_.size(); i-- > 0;) {
    if (running_[i]->job->cancelled()) {
      Release(i);
      std::lock_guard lk(mu_);
      ++m_.requests_cancelled;
    }
  }
  if (running_.empty()) return false;
  // The step's plan: prompt chunks (at most step_tokens tokens in all, each
  // ending where the prefix store stores a chunk) and one decoding row for
  // every sequence whose prompt (but its last token) is in the cache.
  struct Chunk {
    Seq* s;
    int pos, n;
  };
  std::vector<Chunk> chunks;
  std::vector<Seq*> decode;
  auto plan = [&] {
    chunks.clear();
    decode.clear();
    int left = o_.step_tokens;
    for (auto& sp : running_) {
      Seq& s = *sp;
      const int n = static_cast<int>(s.ids.size());
      const int pos = s.tf->length();
      if (pos >= n - 1) {
        decode.push_back(&s);
        continue;
      }
      if (left == 0) continue;
      int take = std::min(left, n - 1 - pos);
      if (pstore_) {
        take = static_cast<int>(std::min<int64_t>(take, pstore_->plan(s.tf->cache()).next_end(pos) - pos));
      }
      chunks.push_back({&s, pos, take});
      left -= take;
    }
  };
  plan();
  // The budget: what the caches hold and what this step can add.
  for (;;) {
    uint64_t add = decode.size();
    for (const Chunk& c : chunks) add += static_cast<uint64_t>(c.n);
    const uint64_t held = CachedBytes();
    if (held + add * row_bytes_ <= budget_) break;
    if (running_.size() > 1) {
      Preempt();
      plan();
      continue;
    }
    // One sequence alone: prefill what fits, or fail it.
    const uint64_t room = held < budget_ ? (budget_ - held) / row_bytes_ : 0;
    if (!chunks.empty() && room >= 1) {
      chunks.front().n = static_cast<int>(std::min<uint64_t>(room, static_cast<uint64_t>(chunks.front().n)));
      break;
    }
    const std::shared_ptr<Job> job = running_.front()->job;
    Release(0);
    job->Push(Failed("the sequence's KV cache outgrew the server's budget", 500));
    return true;
  }
  const auto t_prefill = Clock::now();
  uint64_t prefilled = 0;
  for (const Chunk& c : chunks) {
    // No logits: a prompt's last token is decoded by a step (the plan above).
    driver_->prefill_into(*c.s->tf, std::span(c.s->ids).subspan(static_cast<size_t>(c.pos), static_cast<size_t>(c.n)),
                          c.pos, /*logits=*/false);
    prefilled += static_cast<uint64_t>(c.n);
    StoreIfDue(*c.s);
  }
  const double prefill_s = Since(t_prefill);
  uint64_t sampled = 0;
  if (!decode.empty()) {
    std::vector<model::Transformer::SeqToken> rows;
    rows.reserve(decode.size());
    for (Seq* s : decode) rows.push_back({s->tf.get(), s->ids.back(), s->tf->length()});
    const std::span<const float> logits = driver_->forward_rows(rows);
    const size_t V = static_cast<size_t>(vocab_size());
    for (size_t b = 0; b < decode.size(); ++b) {
      Seq& s = *decode[b];
      StoreIfDue(s);
      const Request& rq = s.job->request();
      const int next = model::sample_token(logits.subspan(b * V, V), rq.temperature, rq.top_p, s.rng);
      if ((tok_ && tok_->ends_text(next)) ||  // as generate: BOS for llama2.c's vocabulary, EOS / EOT for BPE
          std::find(rq.stop_ids.begin(), rq.stop_ids.end(), next) != rq.stop_ids.end()) {
        Finish(s, "stop");
        continue;
      }
      const int prev = s.ids.back();
      s.ids.push_back(next);
      ++s.generated;
      ++sampled;
      if (tok_) {
        const std::string piece = tok_->decode(prev, next);
        if (model::Tokenizer::shows_piece(piece)) s.text += piece;
      }
      // Stop strings: cut at the first; withhold a tail that may begin one.
      size_t cut = std::string::npos, hold = 0;
      for (const std::string& st : rq.stop) {
        const size_t at = s.text.find(st, s.sent);
        if (at != std::string::npos) cut = std::min(cut, at);
        for (size_t k = std::min(st.size() - 1, s.text.size() - s.sent); k > hold; --k) {
          if (s.text.compare(s.text.size() - k, k, st, 0, k) == 0) {
            hold = k;
            break;
          }
        }
      }
      if (cut != std::string::npos) {
        s.text.resize(cut);
        Finish(s, "stop");
        continue;
      }
      if (s.generated >= rq.max_tokens) {
        Finish(s, "length");
        continue;
      }
      // A character whose bytes are still coming (a byte-level token of
      // half a UTF-8 sequence) waits for the rest: every event's text is
      // whole characters.
      hold = std::max(hold, std::min(model::Tokenizer::incomplete_utf8_tail(s.text), s.text.size() - s.sent));
      Event e;
      e.text = s.text.substr(s.sent, s.text.size() - hold - s.sent);
      s.sent += e.text.size();
      outbox_.emplace_back(s.job, std::move(e));
    }
  }
  const uint64_t held = CachedBytes();
  for (size_t i = running_.size(); i-- > 0;) {
    if (running_[i]->finished) Release(i);
  }
  // Idle again: give the freed caches' pages back to the system (glibc keeps
  // freed memory in its arenas otherwise, and the RSS stays at its peak).
  if (running_.empty()) malloc_trim(0);
  const uint64_t kept = CachedBytes();
  const double step_s = Since(t0);
  std::unique_lock lk(mu_);
  ++m_.steps;
  m_.step_seconds += step_s;
  m_.step_seconds_max = std::max(m_.step_seconds_max, step_s);
  m_.prefill_seconds += prefill_s;
  m_.prefilled_tokens += prefilled;
  m_.completion_tokens += sampled;
  m_.kv_bytes_peak = std::max(m_.kv_bytes_peak, held);
  m_.kv_bytes = kept;
  lk.unlock();
  Flush();
  return true;
}

// The step's events go out after its counters and releases: a client that
// has its last event sees its sequence gone from /metrics.
void Engine::Flush() {
  for (auto& [job, e] : outbox_) job->Push(std::move(e));
  outbox_.clear();
}

}  // namespace kvq::serve
