// OpenAI's completions and chat completions APIs over the engine (serve/http.h).
#include "serve/http.h"

#include <httplib.h>
#include <dirent.h>
#include <netinet/in.h>
#include <signal.h>
#include <unistd.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <ctime>
#include <limits>
#include <nlohmann/json.hpp>
#include <thread>

#include "kvq/error.h"
#include "model/chat_template.h"
#include "model/tokenizer.h"
#include "serve/connection.h"
#include "serve/engine.h"

namespace kvq::serve {
namespace {

using json = nlohmann::json;

// JSON text that never throws: a string that is not UTF-8 (the bytes a
// stream holds back at its end: half a character when the length or a stop
// cut it) is written with U+FFFD in place of each bad byte.
std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json ErrorBody(const std::string& message, const std::string& type, const std::string& param = "") {
  json e = {{"message", message}, {"type", type}, {"code", nullptr}};
  e["param"] = param.empty() ? json(nullptr) : json(param);
  return {{"error", e}};
}

void SendError(httplib::Response& res, int status, const std::string& message, const std::string& param = "") {
  res.status = status;
  const char* type = status == 503 ? "server_busy" : status >= 500 ? "server_error" : "invalid_request_error";
  if (status == 503) res.set_header("Retry-After", "1");
  res.set_content(Dump(ErrorBody(message, type, param)), "application/json");
}

// A request's fields, checked against OpenAI's completions API. Fields kvq
// does not implement are accepted at their default value only.
struct Parsed {
  Request req;
  bool stream = false, include_usage = false;
  bool max_tokens_given = false;
};

// A chat message's content as the template reads it: a string, or the text
// of a list of text parts joined by newlines. False with `err` otherwise.
bool MessageText(const json& c, std::string& out, std::string& err) {
  if (c.is_string()) {
    out = c.get<std::string>();
    return true;
  }
  if (c.is_null()) {
    out.clear();
    return true;
  }
  if (!c.is_array()) {
    err = "content must be a string or an array of text parts";
    return false;
  }
  out.clear();
  for (size_t i = 0; i < c.size(); ++i) {
    const json& part = c[i];
    if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
        !part["text"].is_string()) {
      err = "content parts: only {\"type\": \"text\", \"text\": ...} is supported (no images or audio)";
      return false;
    }
    if (i > 0) out += "\n";
    out += part["text"].get<std::string>();
  }
  return true;
}

// `messages` of a chat request into the template's list: roles system
// (and OpenAI's newer "developer", read as system), user and assistant;
// content as MessageText; "name" passed through.
bool ParseMessages(const json& v, nlohmann::ordered_json& out, std::string& err) {
  if (!v.is_array() || v.empty()) {
    err = "messages must be a non-empty array";
    return false;
  }
  out = nlohmann::ordered_json::array();
  for (size_t i = 0; i < v.size(); ++i) {
    const json& m = v[i];
    const std::string at = "messages[" + std::to_string(i) + "]: ";
    if (!m.is_object()) {
      err = at + "must be an object";
      return false;
    }
    nlohmann::ordered_json o = nlohmann::ordered_json::object();
    for (auto it = m.begin(); it != m.end(); ++it) {
      const std::string& k = it.key();
      if (k == "role") {
        if (!it.value().is_string()) {
          err = at + "role must be a string";
          return false;
        }
        std::string role = it.value().get<std::string>();
        if (role == "developer") role = "system";
        if (role != "system" && role != "user" && role != "assistant") {
          err = at + "role '" + role + "' is not supported (system, developer, user, assistant; no tools)";
          return false;
        }
        o["role"] = role;
      } else if (k == "content") {
        std::string text, e;
        if (!MessageText(it.value(), text, e)) {
          err = at + e;
          return false;
        }
        o["content"] = text;
      } else if (k == "name") {
        if (!it.value().is_string()) {
          err = at + "name must be a string";
          return false;
        }
        o["name"] = it.value().get<std::string>();
      } else if (k == "tool_calls" || k == "function_call" || k == "tool_call_id" || k == "audio") {
        if (!it.value().is_null()) {
          err = at + k + " is not supported (kvq serve has no tools)";
          return false;
        }
      } else if (k != "refusal") {
        err = at + "unknown field " + k;
        return false;
      }
    }
    if (!o.contains("role")) {
      err = at + "role is required";
      return false;
    }
    if (!o.contains("content")) o["content"] = "";
    out.push_back(std::move(o));
  }
  return true;
}

// `chat`: the chat route (messages rendered by the template; max_tokens or
// max_completion_tokens); null: the completions route (prompt).
bool ParseRequest(const std::string& body, const Engine& engine, const model::ChatFormat* chat, Parsed& p,
                  std::string& err, std::string& param) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {  // a syntax error, a number out of range
    err = std::string("the body is not valid JSON: ") + e.what();
    return false;
  }
  if (!j.is_object()) {
    err = "the body must be a JSON object";
    return false;
  }
  auto fail = [&](const std::string& field, const std::string& message) {
    param = field;
    err = message;
    return false;
  };
  bool has_prompt = false;
  nlohmann::ordered_json messages;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    const json& v = it.value();
    if (k == "model") {
      if (!v.is_string()) return fail(k, "model must be a string");
    } else if (chat != nullptr && k == "messages") {
      has_prompt = true;
      std::string e;
      if (!ParseMessages(v, messages, e)) return fail(k, e);
    } else if (chat != nullptr && (k == "tools" || k == "tool_choice" || k == "functions" || k == "function_call" ||
                                   k == "parallel_tool_calls" || k == "audio" || k == "modalities" ||
                                   k == "prediction" || k == "web_search_options")) {
      if (!v.is_null()) return fail(k, k + " is not supported: kvq serve answers with text only");
    } else if (chat != nullptr && k == "response_format") {
      if (!v.is_null() && !(v.is_object() && v.size() == 1 && v.value("type", "") == "text")) {
        return fail(k, "response_format: only {\"type\": \"text\"} is supported");
      }
    } else if (chat != nullptr && (k == "logprobs" || k == "top_logprobs")) {
      if (!v.is_null() && !(v.is_boolean() && !v.get<bool>())) return fail(k, k + " is not supported");
    } else if (chat != nullptr && (k == "store" || k == "metadata" || k == "reasoning_effort" ||
                                   k == "service_tier")) {
      // accepted and ignored: nothing kvq does depends on them
    } else if (chat == nullptr && k == "prompt") {
      has_prompt = true;
      if (v.is_string() || (v.is_array() && v.size() == 1 && v[0].is_string())) {  // text, or one text in a list
        try {
          p.req.prompt = engine.encode((v.is_string() ? v : v[0]).get<std::string>());
        } catch (const Error& e) {
          return fail(k, e.what());
        }
      } else if (v.is_array() && !v.empty() && v[0].is_array()) {
        return fail(k, "several prompts in one request are not supported: send one request per prompt");
      } else if (v.is_array()) {
        for (const json& t : v) {
          if (!t.is_number_integer()) return fail(k, "prompt must be a string or an array of token ids (integers)");
          const int64_t id = t.get<int64_t>();
          if (id < 0 || id >= engine.vocab_size()) {
            return fail(k, "token id " + std::to_string(id) + " is outside the vocabulary 0.." +
                               std::to_string(engine.vocab_size() - 1));
          }
          p.req.prompt.push_back(static_cast<int>(id));
        }
      } else {
        return fail(k, "prompt must be a string or an array of token ids");
      }
    } else if (k == "max_tokens" || (chat != nullptr && k == "max_completion_tokens")) {
      if (v.is_null()) continue;
      if (!v.is_number_integer()) return fail(k, k + " must be an integer");
      const int64_t n = v.get<int64_t>();
      if (n < 1) return fail(k, k + " must be at least 1");
      if (n > std::numeric_limits<int>::max()) return fail(k, k + " must be at most the model's context");
      p.req.max_tokens = static_cast<int>(n);
      p.max_tokens_given = true;
    } else if (k == "temperature" || k == "top_p") {
      if (v.is_null()) continue;
      if (!v.is_number()) return fail(k, k + " must be a number");
      (k == "temperature" ? p.req.temperature : p.req.top_p) = v.get<double>();
    } else if (k == "seed") {
      if (v.is_null()) continue;
      if (!v.is_number_integer()) return fail(k, "seed must be an integer");
      p.req.seed = static_cast<uint64_t>(v.get<int64_t>());
    } else if (k == "stop") {
      if (v.is_null()) continue;
      std::vector<std::string> stops;
      if (v.is_string()) {
        stops.push_back(v.get<std::string>());
      } else if (v.is_array() && v.size() <= 4) {
        for (const json& s : v) {
          if (!s.is_string()) return fail(k, "stop must be a string or an array of up to 4 strings");
          stops.push_back(s.get<std::string>());
        }
      } else {
        return fail(k, "stop must be a string or an array of up to 4 strings");
      }
      for (const std::string& s : stops) {
        if (s.empty()) return fail(k, "stop strings must not be empty");
      }
      p.req.stop = std::move(stops);
    } else if (k == "stream") {
      if (v.is_null()) continue;
      if (!v.is_boolean()) return fail(k, "stream must be a boolean");
      p.stream = v.get<bool>();
    } else if (k == "stream_options") {
      if (v.is_null()) continue;
      if (!v.is_object()) return fail(k, "stream_options must be an object");
      for (auto s = v.begin(); s != v.end(); ++s) {
        if (s.key() != "include_usage" || !s.value().is_boolean()) {
          return fail(k, "stream_options: only include_usage (a boolean) is supported");
        }
        p.include_usage = s.value().get<bool>();
      }
    } else if (k == "user") {
      if (!v.is_string()) return fail(k, "user must be a string");
    } else if (k == "n" || k == "best_of") {
      if (!v.is_null() && !(v.is_number_integer() && v.get<int64_t>() == 1)) {
        return fail(k, k + ": kvq serve returns one completion per request (1)");
      }
    } else if (chat == nullptr && k == "echo") {
      if (!v.is_null() && !(v.is_boolean() && !v.get<bool>())) return fail(k, "echo is not supported (false)");
    } else if (chat == nullptr && (k == "logprobs" || k == "suffix")) {
      if (!v.is_null()) return fail(k, k + " is not supported (null)");
    } else if (k == "presence_penalty" || k == "frequency_penalty") {
      if (!v.is_null() && !(v.is_number() && v.get<double>() == 0.0)) return fail(k, k + " is not supported (0)");
    } else if (k == "logit_bias") {
      if (!v.is_null() && !(v.is_object() && v.empty())) return fail(k, "logit_bias is not supported ({})");
    } else {
      return fail(k, "Unrecognized request argument supplied: " + k);
    }
  }
  if (!has_prompt) return chat != nullptr ? fail("messages", "messages is required") : fail("prompt", "prompt is required");
  if (chat != nullptr) {
    if (chat->tmpl == nullptr) return fail("messages", chat->problem);
    if (engine.tokenizer() == nullptr) {
      return fail("messages", "this model's tokenizer is not one kvq reads: use /v1/completions with token ids");
    }
    try {
      p.req.prompt = chat->prompt_ids(*engine.tokenizer(), chat->render(messages, /*add_generation_prompt=*/true));
    } catch (const Error& e) {
      return fail("messages", e.what());
    }
    // The turn ends at the template's end-of-turn token (or its text) and at EOS.
    if (chat->end_of_turn_id >= 0) {
      p.req.stop_ids.push_back(chat->end_of_turn_id);
    } else if (!chat->end_of_turn.empty() &&
               std::find(p.req.stop.begin(), p.req.stop.end(), chat->end_of_turn) == p.req.stop.end()) {
      p.req.stop.push_back(chat->end_of_turn);
    }
    if (const int eos = engine.tokenizer()->eos_id(); eos >= 0) p.req.stop_ids.push_back(eos);
    // No max_tokens: up to the context, as far as the KV budget allows.
    if (!p.max_tokens_given) {
      const int P = static_cast<int>(p.req.prompt.size());
      int lo = 1, hi = std::max(1, engine.context_length() - P);
      const uint64_t budget = engine.metrics().kv_budget_bytes;
      while (lo < hi) {
        const int mid = lo + (hi - lo + 1) / 2;
        if (engine.reserve_bytes(P + mid) <= budget) lo = mid; else hi = mid - 1;
      }
      p.req.max_tokens = lo;
    }
  }
  if (j.contains("model") && j["model"].get<std::string>() != engine.model_id()) {
    param = "model";
    err = "The model '" + j["model"].get<std::string>() + "' does not exist (this server serves '" +
          engine.model_id() + "')";
    return false;
  }
  return true;
}

// A JSON body, or a 400 sent.
bool ParseBody(const std::string& body, httplib::Response& res, json& j) {
  try {
    j = json::parse(body);
    return true;
  } catch (const json::exception& e) {
    SendError(res, 400, std::string("the body is not valid JSON: ") + e.what());
    return false;
  }
}

json Usage(const Event& e) {
  return {{"prompt_tokens", e.prompt_tokens},
          {"completion_tokens", e.completion_tokens},
          {"total_tokens", e.prompt_tokens + e.completion_tokens}};
}

// A completions answer or stream chunk (text_completion).
json Chunk(const std::string& id, time_t created, const std::string& model, const std::string& text,
           const json& finish, const Event* usage_of) {
  json c = {{"id", id},
            {"object", "text_completion"},
            {"created", created},
            {"model", model},
            {"choices", json::array({{{"text", text}, {"index", 0}, {"logprobs", nullptr}, {"finish_reason", finish}}})}};
  if (usage_of != nullptr) c["usage"] = Usage(*usage_of);
  return c;
}

// A chat answer (chat.completion: the message) or stream chunk
// (chat.completion.chunk: a delta).
json ChatChunk(const std::string& id, time_t created, const std::string& model, const json& message_or_delta,
               bool stream, const json& finish, const Event* usage_of) {
  json choice = {{"index", 0}, {stream ? "delta" : "message", message_or_delta}, {"logprobs", nullptr},
                 {"finish_reason", finish}};
  json c = {{"id", id},
            {"object", stream ? "chat.completion.chunk" : "chat.completion"},
            {"created", created},
            {"model", model},
            {"system_fingerprint", nullptr},
            {"choices", json::array({choice})}};
  if (usage_of != nullptr) c["usage"] = Usage(*usage_of);
  return c;
}

// `refused`: the answers with an error status (a bad request, a 404, a
// 413, the engine's 400s and 503s), counted as they are sent.
std::string MetricsText(const Engine& engine, uint64_t refused, const GuardedServer& svr) {
  Metrics m = engine.metrics();
  m.requests_refused = refused;
  std::string s;
  auto add = [&](const char* name, const char* type, const char* help, auto value) {
    char line[512];
    std::snprintf(line, sizeof line, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name,
                  static_cast<double>(value));
    s += line;
  };
  add("kvq_requests_total", "counter", "Completion requests accepted.", m.requests);
  add("kvq_requests_refused_total", "counter", "Requests answered with an error status (400, 404, 413, 503).",
      m.requests_refused);
  add("kvq_requests_cancelled_total", "counter", "Requests whose client went away.",
      m.requests_cancelled);
  add("kvq_requests_finished_total", "counter", "Requests run to their end.", m.requests_finished);
  add("kvq_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", m.prompt_tokens);
  add("kvq_completion_tokens_total", "counter", "Tokens sampled.", m.completion_tokens);
  add("kvq_prefill_tokens_total", "counter", "Prompt tokens run through the batched pass.",
      m.prefilled_tokens);
  add("kvq_kv_bytes", "gauge", "Bytes the running sequences' KV caches hold.", m.kv_bytes);
  add("kvq_kv_bytes_peak", "gauge", "The most bytes the KV caches held after a step.",
      m.kv_bytes_peak);
  add("kvq_kv_reserved_bytes", "gauge", "Bytes reserved by the running sequences (at their full length).",
      m.kv_reserved_bytes);
  add("kvq_kv_budget_bytes", "gauge", "The KV budget (--kv-budget-mb).", m.kv_budget_bytes);
  add("kvq_sequences_running", "gauge", "Sequences running.", m.running);
  add("kvq_sequences_running_peak", "gauge", "The most sequences running at once.", m.running_peak);
  add("kvq_sequences_queued", "gauge", "Requests waiting.", m.queued);
  add("kvq_preemptions_total", "counter", "Sequences preempted to keep the KV budget.",
      m.preemptions);
  add("kvq_prefix_lookups_total", "counter", "Prefix-store lookups.", m.prefix_lookups);
  add("kvq_prefix_hits_total", "counter", "Lookups that restored a prefix.", m.prefix_hits);
  add("kvq_prefix_tokens_reused_total", "counter", "Prompt tokens restored from the prefix store.",
      m.prefix_tokens_reused);
  add("kvq_prefix_bytes_reused_total", "counter", "Bytes read from the prefix store.",
      m.prefix_bytes_reused);
  add("kvq_prefix_chunks_stored_total", "counter", "Chunks written to the prefix store.",
      m.prefix_chunks_stored);
  add("kvq_prefix_bytes_stored_total", "counter", "Bytes written to the prefix store.",
      m.prefix_bytes_stored);
  add("kvq_prefix_store_bytes", "gauge", "Bytes a memory: prefix store holds (0 for the others).",
      m.prefix_store_bytes);
  add("kvq_prefix_store_up", "gauge",
      "1 while the prefix store answers; 0 without one, or while it is down (Redis away: retried after 2-60 s).",
      m.prefix_store_up);
  add("kvq_steps_total", "counter", "Scheduler steps.", m.steps);
  add("kvq_step_seconds_total", "counter", "Seconds the steps took.", m.step_seconds);
  add("kvq_step_seconds_max", "gauge", "The longest step.", m.step_seconds_max);
  add("kvq_prefill_seconds_total", "counter", "Seconds of the steps' prompt prefill.", m.prefill_seconds);
  add("kvq_connections_open", "gauge", "Client connections open.", svr.connections_open());
  add("kvq_connections_refused_total", "counter",
      "Connections refused past --max-client-connections from one address (503).", svr.connections_refused());
  add("kvq_requests_timed_out_total", "counter",
      "Requests whose head and body did not arrive within --request-timeout.", svr.requests_timed_out());
  return s;
}

// Debian's cpp-httplib 0.11.4 is a compiled library whose listening socket
// has a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, fixed when it was built):
// past five connections arriving at once, the kernel drops or resets some.
// Linux lets listen() be called again on a listening socket to change its
// backlog; the socket is found among this process's by its port.
void WidenBacklog(int port) {
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return;
  while (const dirent* e = readdir(d)) {
    const int fd = std::atoi(e->d_name);
    if (fd <= 2 || fd == dirfd(d)) continue;
    int listening = 0;
    socklen_t len = sizeof listening;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) continue;
    sockaddr_storage a{};
    socklen_t alen = sizeof a;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &alen) != 0) continue;
    const int p = a.ss_family == AF_INET    ? ntohs(reinterpret_cast<const sockaddr_in*>(&a)->sin_port)
                  : a.ss_family == AF_INET6 ? ntohs(reinterpret_cast<const sockaddr_in6*>(&a)->sin6_port)
                                            : -1;
    if (p == port) ::listen(fd, SOMAXCONN);
  }
  closedir(d);
}

}  // namespace

namespace {
std::atomic<int> g_stop_signal{0};  // lock-free: set from the handler, on whichever thread it lands
// The first signal drains; a second SIGINT (the user pressing Ctrl-C
// again) exits at once. A second SIGTERM changes nothing: supervisors send
// it again while waiting, and escalate with SIGKILL themselves. _exit is
// async-signal-safe.
extern "C" void OnStopSignal(int sig) {
  if (g_stop_signal.exchange(sig) != 0 && sig == SIGINT) _exit(128 + sig);
}
}  // namespace

void install_stop_signals() {
  static_assert(std::atomic<int>::is_always_lock_free);
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
}

int serve_http(Engine& engine, const HttpOptions& o, const std::function<void(int port)>& on_listening) {
  KVQ_CHECK_ARG(o.port >= 0 && o.port <= 65535, "--port: expected 0..65535, got ", o.port);
  KVQ_CHECK_ARG(o.max_body_kb >= 1 && o.max_body_kb <= 1 << 20, "--max-body-kb: expected 1..2^20, got ",
                o.max_body_kb);
  KVQ_CHECK_ARG(o.timeout_seconds >= 1 && o.timeout_seconds <= 3600, "--timeout: expected 1..3600 s");
  KVQ_CHECK_ARG(o.drain_seconds >= 0 && o.drain_seconds <= 86400, "--drain-seconds: expected 0..86400");
  KVQ_CHECK_ARG(o.connections >= 0 && o.connections <= 65536, "--connections: expected 0..65536");
  KVQ_CHECK_ARG(o.request_timeout_seconds >= 1 && o.request_timeout_seconds <= 86400,
                "--request-timeout: expected 1..86400 s, got ", o.request_timeout_seconds);
  KVQ_CHECK_ARG(o.max_client_connections >= 0 && o.max_client_connections <= 65536,
                "--max-client-connections: expected 0..65536, got ", o.max_client_connections);
  const size_t workers = o.connections > 0 ? static_cast<size_t>(o.connections) : 256;
  ConnectionLimits limits;
  limits.io_seconds = o.timeout_seconds;
  limits.request_seconds = o.request_timeout_seconds;
  // By default one address may hold half the connection threads: the rest
  // stay free for every other client.
  limits.per_client = o.max_client_connections > 0 ? o.max_client_connections
                                                   : static_cast<int>(std::max<size_t>(1, workers / 2));
  limits.refusal_json = Dump(ErrorBody("too many connections from this address at once (--max-client-connections " +
                                           std::to_string(limits.per_client) + ")",
                                       "server_busy"));
  GuardedServer svr(limits);
  svr.new_task_queue = [workers] { return new httplib::ThreadPool(workers); };
  svr.set_payload_max_length(static_cast<size_t>(o.max_body_kb) * 1024);
  std::atomic<bool> draining{false};
  std::atomic<int> in_flight{0};
  std::atomic<uint64_t> refused{0};
  svr.set_logger([&refused](const httplib::Request&, const httplib::Response& res) {
    if (res.status >= 400) ++refused;
  });
  const time_t started = std::time(nullptr);
  const size_t max_body = static_cast<size_t>(o.max_body_kb) * 1024;

  // The body's framing, checked before a byte of it is read: a length
  // that is not a number, over the limit or given twice, a transfer coding
  // other than chunked, or both (the request-smuggling pair) are answered
  // at once and the connection closed, not after reading (or waiting for)
  // the bytes the header announces.
  svr.set_pre_routing_handler([max_body](const httplib::Request& rq, httplib::Response& res) {
    const size_t lengths = rq.get_header_value_count("Content-Length");
    const bool chunked_te = rq.has_header("Transfer-Encoding");
    std::string problem;
    int status = 400;
    if (lengths > 0 && chunked_te) {
      problem = "Transfer-Encoding and Content-Length together";
    } else if (lengths > 1) {
      problem = "Content-Length given more than once";
    } else if (chunked_te) {
      std::string te = rq.get_header_value("Transfer-Encoding");
      std::transform(te.begin(), te.end(), te.begin(), [](unsigned char c) { return std::tolower(c); });
      if (te != "chunked") {
        problem = "Transfer-Encoding '" + te + "' (only chunked)";
        status = 501;
      } else if (rq.version == "HTTP/1.0") {
        problem = "Transfer-Encoding in an HTTP/1.0 request";
      }
    } else if (lengths == 1) {
      const std::string v = rq.get_header_value("Content-Length");
      const bool digits = !v.empty() && v.size() <= 18 &&
                          std::all_of(v.begin(), v.end(), [](unsigned char c) { return c >= '0' && c <= '9'; });
      if (!digits) {
        problem = "Content-Length '" + v.substr(0, 32) + "' is not a length";
      } else if (std::stoull(v) > max_body) {
        problem = "the request body is larger than --max-body-kb (" + std::to_string(max_body / 1024) + " KiB)";
        status = 413;
      }
    }
    if (problem.empty()) return httplib::Server::HandlerResponse::Unhandled;
    SendError(res, status, problem);
    res.set_header("Connection", "close");
    GuardedServer::close_after_response();
    return httplib::Server::HandlerResponse::Handled;
  });

  svr.Get("/health", [&](const httplib::Request&, httplib::Response& res) {
    if (draining) {
      res.status = 503;
      res.set_content(R"({"status":"draining"})", "application/json");
    } else {
      res.set_content(R"({"status":"ok"})", "application/json");
    }
  });
  svr.Get("/v1/models", [&](const httplib::Request&, httplib::Response& res) {
    json m = {{"id", engine.model_id()},       {"object", "model"},
              {"created", started},            {"owned_by", "kvq"},
              {"kv", engine.kv_label()},       {"context_length", engine.context_length()},
              {"vocab_size", engine.vocab_size()},
              {"kv_bytes_at_context", engine.reserve_bytes(engine.context_length())}};
    if (o.chat != nullptr && o.chat->tmpl != nullptr) {
      m["chat_template"] = {{"origin", o.chat->origin}, {"family", o.chat->family},
                            {"end_of_turn", o.chat->end_of_turn}, {"end_of_turn_id", o.chat->end_of_turn_id}};
    } else {
      m["chat_template"] = nullptr;
      m["chat_template_problem"] = o.chat != nullptr ? o.chat->problem : "no chat template";
    }
    res.set_content(Dump(json({{"object", "list"}, {"data", json::array({m})}})), "application/json");
  });
  svr.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
    res.set_content(MetricsText(engine, refused, svr), "text/plain; version=0.0.4");
  });
  // One handler for both routes: `chat` null is /v1/completions.
  auto complete = [&](const httplib::Request& rq, const std::string& body, httplib::Response& res,
                      const model::ChatFormat* chat) {
    Parsed p;
    std::string err, param;
    if (!ParseRequest(body, engine, chat, p, err, param)) {
      SendError(res, param == "model" && err.rfind("The model", 0) == 0 ? 404 : 400, err, param);
      return;
    }
    Refused refused{};
    const std::shared_ptr<Job> job = engine.submit(p.req, &refused);
    if (!job) {
      SendError(res, refused.status, refused.message, refused.param);
      return;
    }
    const std::string id = (chat ? "chatcmpl-" : "cmpl-") + std::to_string(job->id());
    const time_t created = std::time(nullptr);
    const std::string model = engine.model_id();
    if (!p.stream) {
      ++in_flight;
      std::string text;
      Event e;
      for (;;) {
        if (!job->next(e, std::chrono::milliseconds(1000))) continue;
        text += e.text;
        if (e.done) break;
      }
      --in_flight;
      if (!e.error.empty()) {
        SendError(res, e.status, e.error);
        return;
      }
      const json answer = chat ? ChatChunk(id, created, model, {{"role", "assistant"}, {"content", text}, {"refusal", nullptr}},
                                           false, e.finish_reason, &e)
                               : Chunk(id, created, model, text, e.finish_reason, &e);
      res.set_content(Dump(answer), "application/json");
      return;
    }
    ++in_flight;
    const bool usage = p.include_usage, is_chat = chat != nullptr;
    auto first = std::make_shared<bool>(true);
    res.set_header("Cache-Control", "no-cache");
    httplib::ContentProviderWithoutLength events = [job, id, created, model, usage, is_chat, first](
                                                      size_t, httplib::DataSink& sink) {
          Event e;
          if (!job->next(e, std::chrono::milliseconds(200))) return true;  // asked again
          auto piece = [&](const std::string& text, const json& finish, const Event* u) {
            if (!is_chat) return Chunk(id, created, model, text, finish, u);
            json delta = json::object();
            if (*first) delta["role"] = "assistant";
            if (!text.empty() || (*first && finish.is_null())) delta["content"] = text;
            *first = false;
            return ChatChunk(id, created, model, delta, true, finish, u);
          };
          std::string out;
          if (!e.error.empty()) {
            out = "data: " + Dump(ErrorBody(e.error, e.status == 503 ? "server_busy" : "server_error")) + "\n\n";
          } else {
            if (!e.text.empty() || !e.done) out += "data: " + Dump(piece(e.text, nullptr, nullptr)) + "\n\n";
            if (e.done) {
              out += "data: " + Dump(piece("", e.finish_reason, nullptr)) + "\n\n";
              if (usage) {
                json u = is_chat ? ChatChunk(id, created, model, json::object(), true, nullptr, &e)
                                 : Chunk(id, created, model, "", nullptr, &e);
                u["choices"] = json::array();
                out += "data: " + Dump(u) + "\n\n";
              }
            }
          }
          if (e.done) out += "data: [DONE]\n\n";
          if (!sink.write(out.data(), out.size())) {  // the client went away
            job->cancel();
            return false;
          }
          if (e.done) sink.done();
          return true;
    };
    auto release = [job, &in_flight](bool success) {
      if (!success) job->cancel();
      --in_flight;
    };
    if (rq.version == "HTTP/1.0") {
      // HTTP/1.0 has no chunked coding: the events run to the connection's end.
      res.set_header("Connection", "close");
      GuardedServer::close_after_response();
      res.set_content_provider("text/event-stream", std::move(events), std::move(release));
    } else {
      res.set_chunked_content_provider("text/event-stream", std::move(events), std::move(release));
    }
  };
  // Every POST reads its body through a ContentReader that stops at
  // --max-body-kb: httplib's own limit holds for a Content-Length body but
  // not for a chunked one (300 MB were read into memory).
  using BodyHandler = std::function<void(const httplib::Request&, const std::string&, httplib::Response&)>;
  auto post = [&svr, max_body, &o](const char* path, BodyHandler h) {
    svr.Post(path, [h, max_body, &o](const httplib::Request& rq, httplib::Response& res,
                                    const httplib::ContentReader& read) {
      std::string body;
      bool over = false;
      const bool whole = read([&](const char* data, size_t n) {
        if (body.size() + n > max_body) {
          over = true;
          return false;
        }
        body.append(data, n);
        return true;
      });
      if (over || !whole) {
        SendError(res, over ? 413 : 400,
                  over ? "the request body is larger than --max-body-kb (" + std::to_string(max_body / 1024) + " KiB)"
                       : "the request body did not arrive whole within --request-timeout (" +
                             std::to_string(o.request_timeout_seconds) + " s)");
        res.set_header("Connection", "close");
        GuardedServer::close_after_response();
        return;
      }
      h(rq, body, res);
    });
  };
  post("/v1/completions",
       [&](const httplib::Request& rq, const std::string& body, httplib::Response& res) {
         complete(rq, body, res, nullptr);
       });
  const model::ChatFormat no_chat{};
  const model::ChatFormat& chat = o.chat ? *o.chat : no_chat;
  post("/v1/chat/completions", [&](const httplib::Request& rq, const std::string& body, httplib::Response& res) {
    if (chat.tmpl == nullptr) {
      SendError(res, 400, chat.problem.empty() ? "this server has no chat template" : chat.problem, "messages");
      return;
    }
    complete(rq, body, res, &chat);
  });
  // llama-server's shapes: {"content", "add_special", "with_pieces"} ->
  // {"tokens"}; {"tokens"} -> {"content"}.
  post("/tokenize", [&](const httplib::Request&, const std::string& body, httplib::Response& res) {
    json j;
    if (!ParseBody(body, res, j)) return;
    if (!j.is_object() || !j.contains("content") || !j["content"].is_string()) {
      SendError(res, 400, "content (a string) is required", "content");
      return;
    }
    bool add_special = false, with_pieces = false;
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& k = it.key();
      if (k == "content") continue;
      if ((k == "add_special" || k == "with_pieces" || k == "parse_special") && it.value().is_boolean()) {
        if (k == "add_special") add_special = it.value().get<bool>();
        if (k == "with_pieces") with_pieces = it.value().get<bool>();
        continue;
      }
      SendError(res, 400, "unknown or mistyped field " + k + " (content, add_special, with_pieces)", k);
      return;
    }
    const model::Tokenizer* tok = engine.tokenizer();
    if (tok == nullptr) {
      SendError(res, 400, "this model's tokenizer is not one kvq reads", "content");
      return;
    }
    const std::vector<int> ids = tok->encode(j["content"].get<std::string>(), add_special);
    json out = json::array();
    int prev = tok->bos_id();
    for (int id : ids) {
      if (with_pieces) {
        out.push_back({{"id", id}, {"piece", tok->decode(prev, id)}});
      } else {
        out.push_back(id);
      }
      prev = id;
    }
    res.set_content(Dump(json({{"tokens", out}})), "application/json");
  });
  post("/detokenize", [&](const httplib::Request&, const std::string& body, httplib::Response& res) {
    json j;
    if (!ParseBody(body, res, j)) return;
    if (!j.is_object() || !j.contains("tokens") || !j["tokens"].is_array() || j.size() != 1) {
      SendError(res, 400, "tokens (an array of token ids) is required, and nothing else", "tokens");
      return;
    }
    const model::Tokenizer* tok = engine.tokenizer();
    if (tok == nullptr) {
      SendError(res, 400, "this model's tokenizer is not one kvq reads", "tokens");
      return;
    }
    std::string text;
    int prev = tok->bos_id();
    for (const json& t : j["tokens"]) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= engine.vocab_size()) {
        SendError(res, 400, "token ids must be integers in 0.." + std::to_string(engine.vocab_size() - 1), "tokens");
        return;
      }
      const int id = static_cast<int>(t.get<int64_t>());
      if (tok->has_bos() && id == tok->bos_id()) {  // BOS is not text
        prev = id;
        continue;
      }
      const std::string piece = tok->decode(prev, id);
      if (model::Tokenizer::shows_piece(piece)) text += piece;
      prev = id;
    }
    res.set_content(Dump(json({{"content", text}})), "application/json");
  });
  svr.set_error_handler([](const httplib::Request& rq, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 404) {
      SendError(res, 404, "no route " + rq.method + " " + rq.path);
    } else if (res.status == 413) {
      SendError(res, 413, "the request body is too large");
    } else {
      SendError(res, res.status, "HTTP status " + std::to_string(res.status));
    }
  });
  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    SendError(res, 500, what);
  });

  // SO_REUSEADDR only: httplib's default sets SO_REUSEPORT, under which a
  // second server on a port in use started and took half its connections.
  svr.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  int port = o.port;
  if (port == 0) {
    port = svr.bind_to_any_port(o.host);
  } else if (!svr.bind_to_port(o.host, port)) {
    port = -1;
  }
  KVQ_CHECK_ARG(port > 0, "--port: cannot listen on ", o.host, ":", o.port, " (in use by another server?)");
  WidenBacklog(port);
  if (on_listening) on_listening(port);

  std::atomic<bool> finished{false};
  std::thread signals([&] {
    while (!finished) {
      if (g_stop_signal == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      draining = true;
      engine.drain();  // queued requests: 503; running ones run on
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(o.drain_seconds);
      while ((!engine.idle() || in_flight > 0) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      engine.shutdown();  // what still runs ends with an error event
      while (in_flight > 0 && std::chrono::steady_clock::now() < deadline + std::chrono::seconds(5)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      svr.stop();
      return;
    }
  });
  const bool ok = svr.listen_after_bind();
  finished = true;
  signals.join();
  return ok || draining ? 0 : 1;
}

}  // namespace kvq::serve
