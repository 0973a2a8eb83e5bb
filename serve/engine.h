// The engine of `kvq serve` (above model/ and store/, below the HTTP layer):
// continuous batching of many sequences, each with its own compressed KV
// cache, under a budget of KV bytes, with a bounded queue and a prefix store.
//
// One scheduler thread runs every model pass. Each step:
//   1. admits queued requests (in order) while the bytes their caches will
//      hold at prompt + max_tokens tokens (the scheme's least bytes, all
//      layers, and for a grouped scheme its open tokens in fp16) fit beside
//      those reserved by the running ones; an admitted request restores its
//      longest stored prefix from the prefix store;
//   2. drops the sequences whose client went away (their caches are freed);
//   3. prefills prompts in chunks, at most `step_tokens` prompt tokens a step
//      over all sequences (so a long prompt does not stall the decodes),
//      storing each full chunk of a prompt in the prefix store;
//   4. runs one decoding row for every sequence whose prompt is in, every
//      projection as one sgemm (Transformer::forward_rows), attention over
//      each sequence's own cache; samples, emits text, finishes sequences.
// Before steps 3 and 4 the bytes the caches hold (KvCache::bytes) plus what
// the step can add (a row scheme's bytes a token; for a grouped scheme a
// float32 K and V row a token and layer, more than it writes) must fit the
// budget; if not, the newest running sequence is
// preempted: its cache is freed and it goes back to the head of the queue,
// to be recomputed from its tokens (prompt and output so far) when it fits.
// So the caches never hold more than the budget.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace kvq::model {
class Checkpoint;
class Tokenizer;
class Transformer;
}  // namespace kvq::model

namespace kvq::store {
class PrefixStore;
}

namespace kvq::serve {

struct EngineOptions {
  std::string model;      // llama2.c checkpoint or GGUF
  std::string tokenizer;  // llama2.c tokenizer.bin; empty with a GGUF (its own, when kvq reads it)
  std::string kv = "fp16";
  double kv_budget_mb = 1024;  // KV bytes of all running sequences together (MiB)
  int max_seqs = 16;           // sequences running at once
  int max_queue = 64;          // requests waiting; past it a request is refused (503)
  int step_tokens = 256;       // prompt tokens prefilled per step, over all sequences
  std::optional<std::string> prompt_cache;  // a prefix store (directory, redis://..., memory:)
  int prompt_cache_chunk = 256;
  int prompt_cache_ttl = 0;
  double prompt_cache_max_mb = 0;
  std::string prompt_cache_secret;
  int threads = 0;             // OpenMP, BLAS and attention threads (0: as the process has them)
  std::string weight_dot = "int8";  // quantized weights: int8 or exact (model/transformer.h: WeightDot)
  bool calib_batched = false;  // calibrated schemes: calibration sequences side by side
  int calib_tokens = 512;      // calibrated schemes: tokens per calibration sequence (at most the context)
  // Admission (TensorRT-LLM's two capacity policies): "guaranteed" reserves
  // a grouped cache's open tokens in fp16 too, so no sequence is preempted;
  // "packed" reserves the least bytes only and preempts when the caches
  // outgrow the budget (more sequences at once, some recomputed).
  std::string admit = "guaranteed";
};

// One completion request, checked by Engine::submit.
struct Request {
  std::vector<int> prompt;  // token ids (BOS first when the prompt was text)
  int max_tokens = 16;
  double temperature = 1.0;  // 0: greedy
  double top_p = 1.0;
  uint64_t seed = 0;         // 0: a fixed default
  std::vector<std::string> stop;
  std::vector<int> stop_ids;  // tokens that end the text too (a chat template's end of turn), not emitted
};

// What a request's client receives, in order: text as it is known, then
// one final event (done) with the finish reason and the usage.
struct Event {
  std::string text;         // new text (stop strings and what follows them withheld)
  bool done = false;
  std::string finish_reason;  // "stop", "length"; with an error: "error"
  std::string error;          // non-empty: the request failed (status below)
  int status = 200;           // with an error: the HTTP status it maps to (503: the server is draining)
  int prompt_tokens = 0, completion_tokens = 0;
};

// A request in the engine: the HTTP side reads its events and may cancel it.
class Job {
 public:
  // The next event; false when none came within `timeout`.
  bool next(Event& e, std::chrono::milliseconds timeout);
  // The client went away: the engine drops the sequence at its next step.
  void cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_; }
  const Request& request() const { return req_; }
  uint64_t id() const { return id_; }

 private:
  friend class Engine;
  Job(Request r, uint64_t id) : req_(std::move(r)), id_(id) {}
  void Push(Event e);
  Request req_;
  uint64_t id_;
  std::atomic<bool> cancelled_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
};

// A refused request: 400 (it can never run: too long for the context or the
// budget, bad ids) or 503 (the queue is full, or the server is draining).
struct Refused {
  int status;
  std::string message;
  std::string param;
};

// Counters for /metrics (a snapshot).
struct Metrics {
  uint64_t requests = 0, requests_refused = 0, requests_cancelled = 0, requests_finished = 0;
  uint64_t prompt_tokens = 0, completion_tokens = 0, prefilled_tokens = 0;
  uint64_t kv_bytes = 0, kv_bytes_peak = 0, kv_reserved_bytes = 0, kv_budget_bytes = 0;
  int running = 0, queued = 0, running_peak = 0;
  uint64_t preemptions = 0;
  uint64_t prefix_lookups = 0, prefix_hits = 0, prefix_tokens_reused = 0, prefix_bytes_reused = 0;
  uint64_t prefix_chunks_stored = 0, prefix_bytes_stored = 0;
  uint64_t prefix_store_bytes = 0;  // what a memory: store holds now (after its cap's evictions)
  int prefix_store_up = 0;           // 1: the prefix store answers (after its last use); 0: none, or down until a retry
  uint64_t steps = 0;
  double step_seconds = 0, step_seconds_max = 0;
  double prefill_seconds = 0;
};

class Engine {
 public:
  // Loads the model, the tokenizer (when kvq reads the model's), calibrates
  // the scheme when it needs ranges, opens the prefix store and starts the
  // scheduler. Throws kvq::Error naming the `kvq serve` option at fault.
  explicit Engine(const EngineOptions& o);
  ~Engine();  // shutdown()
  // Stops the scheduler: queued and running requests end with a 503 error
  // event. Idempotent.
  void shutdown();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request, or says why not (nothing is queued then).
  std::shared_ptr<Job> submit(Request r, Refused* refused);
  // The prompt text's ids (BOS first); null tokenizer: kvq cannot read this model's.
  const model::Tokenizer* tokenizer() const { return tok_.get(); }
  std::vector<int> encode(const std::string& text) const;
  // The model (its config, its chat template).
  const model::Checkpoint& checkpoint() const { return *ckpt_; }
  int context_length() const;
  int vocab_size() const;
  const std::string& model_id() const { return model_id_; }
  const std::string& kv_label() const { return kv_label_; }
  // The bytes a sequence of `tokens` tokens reserves: the scheme's least
  // bytes and, for a grouped scheme, its open tokens in fp16.
  uint64_t reserve_bytes(int tokens) const;
  Metrics metrics() const;
  // Stops admitting: queued requests end with a 503 event; running ones run
  // to their end. Returns at once; idle() says when they are done.
  void drain();
  bool idle() const;

 private:
  struct Seq;
  void Loop();
  void Admit();
  bool Step();
  void Finish(Seq& s, const std::string& reason);
  void Preempt();
  void Release(size_t i);
  uint64_t CachedBytes() const;
  void StoreIfDue(Seq& s);
  void Flush();

  EngineOptions o_;
  std::unique_ptr<model::Checkpoint> ckpt_;
  std::shared_ptr<const model::Tokenizer> tok_;
  struct SchemeHolder;
  std::unique_ptr<SchemeHolder> scheme_;
  std::unique_ptr<store::PrefixStore> pstore_;
  std::unique_ptr<model::Transformer> driver_;  // the activation buffers of every pass
  std::string model_id_, kv_label_;
  uint64_t budget_ = 0, row_bytes_ = 0;
  int open_tokens_ = 0;  // a grouped scheme's tokens held open (reserved in fp16)

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Seq>> queue_;  // guarded by mu_
  std::vector<std::unique_ptr<Seq>> running_;  // scheduler thread only
  std::vector<std::pair<std::shared_ptr<Job>, Event>> outbox_;  // the step's events (scheduler thread)
  uint64_t next_id_ = 1;
  uint64_t admitted_ = 0;  // scheduler thread only
  uint64_t reserved_ = 0;
  bool stop_ = false, draining_ = false;
  Metrics m_;  // guarded by mu_
  std::thread thread_;
};

}  // namespace kvq::serve
