// The HTTP face of `kvq serve` (cpp-httplib): OpenAI's completions API over
// an Engine.
//
//   POST /v1/completions   prompt (text, or token ids), max_tokens, temperature,
//                          top_p, seed, stop, stream (server-sent events),
//                          stream_options.include_usage; usage in the answer
//   POST /v1/chat/completions  messages (system / developer, user, assistant;
//                          content a string or text parts) rendered by the
//                          chat template (HttpOptions::chat), ending at its
//                          end-of-turn token or EOS; max_tokens or
//                          max_completion_tokens (default: up to the context
//                          and the KV budget) and the fields above; tools,
//                          n > 1, logprobs, images: 400
//   POST /tokenize, /detokenize  llama-server's shapes
//                          ({"content", "add_special", "with_pieces"} ->
//                          {"tokens"}; {"tokens"} -> {"content"})
//   GET  /v1/models        the one model served, with its chat template
//   GET  /health           200 {"status":"ok"}; 503 while draining
//   GET  /metrics          Prometheus text: requests, tokens, KV bytes and
//                          budget, sequences running and queued, prefix-store
//                          reuse, step time
//
// Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}:
// 400 for a request that can never run (bad JSON, wrong types, unknown or
// unsupported fields, too long for the context or the KV budget), 404 for
// another path or model, 413 for a body over --max-body-kb, 503 with
// Retry-After when the queue is full or the server is draining.
//
// SIGTERM or SIGINT: stop admitting (queued requests get 503), let running
// ones finish (at most --drain-seconds, then they are cancelled), stop
// listening, return 0.
#pragma once

#include <functional>
#include <string>

namespace kvq::model {
struct ChatFormat;
}

namespace kvq::serve {

class Engine;

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8080;             // 0: any free port (reported to on_listening)
  int max_body_kb = 1024;
  int timeout_seconds = 30;    // a client's read and write timeout (each recv and send)
  int request_timeout_seconds = 30;  // a request's head and body must arrive within it
  int max_client_connections = 0;    // connections at once from one address (0: half of `connections`)
  int drain_seconds = 60;      // on SIGTERM, how long running requests may finish
  int connections = 0;         // connection threads (0: 256)
  // The chat route's template (null or without a template: the route
  // answers 400 with its problem). Must outlive serve_http.
  const model::ChatFormat* chat = nullptr;
};

// SIGTERM and SIGINT set a flag that serve_http watches (whichever thread
// they land on); SIGPIPE is ignored (a client gone mid-write is an error
// return, not the process's end).
void install_stop_signals();

// Serves until SIGTERM or SIGINT; on_listening gets the bound port. Returns
// the process's exit code (0 after a signal). Throws kvq::Error when it
// cannot listen.
int serve_http(Engine& engine, const HttpOptions& o, const std::function<void(int port)>& on_listening);

}  // namespace kvq::serve
