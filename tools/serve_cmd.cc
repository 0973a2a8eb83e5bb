// `kvq serve`: an OpenAI-compatible completions server (serve/).
#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "model/chat_template.h"
#include "model/checkpoint.h"
#include "serve/engine.h"
#include "serve/http.h"
#include "tools/commands.h"

namespace kvq::tools {

// The default memory: store's cap (llama-server's host prompt cache,
// --cache-ram, defaults to 8 GiB of f16 KV).
constexpr double kDefaultServeStoreMb = 512;

void AddServeCommand(CLI::App& app, ServeCliOptions& o) {
  CLI::App* c = app.add_subcommand(
      "serve", "Serve OpenAI's completions API (POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models, /health, /metrics): continuous "
               "batching over compressed KV caches under a KV budget");
  c->add_option("--model", o.model, "GGUF model or llama2.c checkpoint (default: stories260K)");
  c->add_option("--tokenizer", o.tokenizer, "llama2.c tokenizer.bin (a GGUF carries its own)");
  c->add_option("--kv", o.kv, "KV scheme or preset of every sequence (default fp16; t0+<scheme>: layer 0 as token ids)");
  c->add_option("--kv-budget-mb", o.kv_budget_mb,
                "MiB the running sequences' KV caches may hold together (default 1024): a request waits until "
                "its cache at prompt + max_tokens fits")
      ->check(CLI::Range(1e-6, 16777216.0));
  c->add_option("--admit", o.admit,
                "guaranteed (default): a request is admitted when its cache at full length fits, a grouped cache's "
                "open tokens counted in fp16, so none is preempted; packed: least bytes only, more sequences at "
                "once, the newest preempted and recomputed when the caches outgrow the budget")
      ->check(CLI::IsMember({"guaranteed", "packed"}));
  c->add_option("--max-seqs", o.max_seqs, "sequences running at once (default 16)")->check(CLI::Range(1, 4096));
  c->add_option("--max-queue", o.max_queue, "requests waiting; past it 503 with Retry-After (default 64)")
      ->check(CLI::Range(0, 65536));
  c->add_option("--step-tokens", o.step_tokens, "prompt tokens prefilled per step, over all sequences (default 256)")
      ->check(CLI::Range(1, 65536));
  c->add_option("--threads", o.threads, "OpenMP, BLAS and attention threads (0: OpenMP default)")
      ->check(CLI::Range(0, 1024));
  c->add_flag("--calib-batched", o.calib_batched, "calibrated schemes: calibration sequences side by side");
  AddWeightDotOption(c, o.weight_dot);
  c->add_option("--calib-tokens", o.calib_tokens,
                "calibrated schemes: tokens per calibration sequence the model generates (default 512, at most its "
                "context)")
      ->check(CLI::Range(1, 1 << 24));
  c->add_option("--host", o.host, "address to listen on (default 127.0.0.1)");
  c->add_option("--port", o.port, "port (default 8080; 0: any free one, printed)")->check(CLI::Range(0, 65535));
  c->add_option("--max-body-kb", o.max_body_kb, "largest request body, KiB (default 1024; past it 413)")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--timeout", o.timeout, "a client's read and write timeout, seconds (default 30)")
      ->check(CLI::Range(1, 3600));
  c->add_option("--request-timeout", o.request_timeout,
                "seconds a request's head and body may take to arrive, from its first byte (default 30; past it "
                "400 and the connection closed)")
      ->check(CLI::Range(1, 86400));
  c->add_option("--max-client-connections", o.max_client_connections,
                "connections at once from one client address; past it 503 with Retry-After (default 0: half of "
                "--connections)")
      ->check(CLI::Range(0, 65536));
  c->add_option("--drain-seconds", o.drain_seconds,
                "on SIGTERM, seconds running requests may finish before they are cancelled (default 60)")
      ->check(CLI::Range(0, 86400));
  c->add_option("--connections", o.connections, "connection threads (default 256)")->check(CLI::Range(0, 65536));
  c->add_option("--chat-template", o.chat_template,
                "/v1/chat/completions' template: a built-in (llama3, chatml, mistral, gemma, phi3, llama2) or a file "
                "(template text or a tokenizer_config.json); default: the GGUF's tokenizer.chat_template");
  AddPromptCacheOptions(c, o);
  c->get_option("--prompt-cache")
      ->description("prefix store for prompts and conversations (default: memory:, in RAM, capped at 512 MiB by "
                    "--prompt-cache-max-mb; 'off': none; or a directory, redis://[user:password@]host:port[/db]): a "
                    "request restores its longest stored prefix and prefills the rest");
  c->get_option("--prompt-cache-max-mb")
      ->description("directory or memory: store's cap in MiB, least recently used chunks evicted first (serve's "
                    "default memory: store: 512)");
}

int RunServe(const ServeCliOptions& o) {
  serve::install_stop_signals();
  serve::EngineOptions e;
  e.model = o.model.empty() ? DefaultModel() : o.model;
  e.tokenizer = o.tokenizer.empty() ? DefaultTokenizerFor(e.model) : o.tokenizer;
  e.kv = o.kv;
  e.kv_budget_mb = o.kv_budget_mb;
  e.max_seqs = o.max_seqs;
  e.max_queue = o.max_queue;
  e.step_tokens = o.step_tokens;
  e.threads = o.threads;
  e.calib_batched = o.calib_batched;
  e.weight_dot = o.weight_dot;
  e.calib_tokens = o.calib_tokens;
  e.admit = o.admit;
  // The conversations' KV stays in RAM by default (a memory: store, least
  // recently used chunks evicted past the cap); --prompt-cache off: none.
  e.prompt_cache = o.prompt_cache;
  if (!e.prompt_cache) {
    e.prompt_cache = "memory:serve";
  } else if (*e.prompt_cache == "off") {
    e.prompt_cache.reset();
  }
  e.prompt_cache_chunk = o.prompt_cache_chunk;
  e.prompt_cache_max_mb = o.prompt_cache_max_mb;
  if (!o.prompt_cache && o.prompt_cache_max_mb == 0) e.prompt_cache_max_mb = kDefaultServeStoreMb;
  e.prompt_cache_ttl = o.prompt_cache_ttl;
  if (o.prompt_cache) e.prompt_cache_secret = StoreSecret(o.prompt_cache_key_file);
  serve::Engine engine(e);
  // The chat template: one given that kvq cannot render stops here; the
  // model's own that it cannot leaves the chat route saying why.
  const model::ChatFormat chat =
      model::chat_format(engine.tokenizer(), engine.checkpoint().chat_template(), o.chat_template, "--chat-template");
  if (chat.tmpl == nullptr) {
    std::fprintf(stderr, "kvq serve: /v1/chat/completions is off: %s\n", chat.problem.c_str());
  } else {
    std::fprintf(stderr, "kvq serve: chat template: %s (%s; a turn ends at %s)\n", chat.origin.c_str(),
                 chat.family.empty() ? "family not recognised" : chat.family.c_str(),
                 chat.end_of_turn_id >= 0 ? ("token " + std::to_string(chat.end_of_turn_id) + " " + chat.end_of_turn).c_str()
                 : !chat.end_of_turn.empty() ? ("the text " + chat.end_of_turn).c_str()
                                             : "EOS");
  }
  serve::HttpOptions h;
  h.chat = &chat;
  h.host = o.host;
  h.port = o.port;
  h.max_body_kb = o.max_body_kb;
  h.timeout_seconds = o.timeout;
  h.request_timeout_seconds = o.request_timeout;
  h.max_client_connections = o.max_client_connections;
  h.drain_seconds = o.drain_seconds;
  h.connections = o.connections;
  const int rc = serve::serve_http(engine, h, [&](int port) {
    std::fprintf(stderr,
                 "kvq serve: listening on http://%s:%d (model %s, kv %s, budget %.1f MiB: %llu bytes, max %d "
                 "sequences, queue %d, weights %s)\n",
                 o.host.c_str(), port, engine.model_id().c_str(), engine.kv_label().c_str(), o.kv_budget_mb,
                 static_cast<unsigned long long>(engine.metrics().kv_budget_bytes), o.max_seqs, o.max_queue,
                 o.weight_dot.c_str());
    std::fflush(stderr);
  });
  const serve::Metrics m = engine.metrics();
  std::fprintf(stderr, "kvq serve: stopped after %llu requests (%llu finished, %llu cancelled, %llu refused), %llu "
               "tokens out, peak KV %llu of %llu bytes\n",
               static_cast<unsigned long long>(m.requests), static_cast<unsigned long long>(m.requests_finished),
               static_cast<unsigned long long>(m.requests_cancelled),
               static_cast<unsigned long long>(m.requests_refused),
               static_cast<unsigned long long>(m.completion_tokens), static_cast<unsigned long long>(m.kv_bytes_peak),
               static_cast<unsigned long long>(m.kv_budget_bytes));
  return rc;
}

}  // namespace kvq::tools
