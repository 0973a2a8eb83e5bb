// The connections of `kvq serve`: cpp-httplib's server with the limits a
// server on a network needs, which httplib 0.11 (Debian 12's) lacks.
//
//   - a deadline for the whole request (head and body), not only for each
//     recv: a client trickling a byte a second is cut off at the deadline
//     (400, or nothing if its request line never came);
//   - at most `per_client` connections at once from one address: past it a
//     connection gets 503 with Retry-After and is closed at once, so one
//     client cannot take every connection thread;
//   - pipelined requests: the bytes read past one request stay buffered for
//     the next (httplib made a new stream per request and dropped them);
//   - a response sent before its request body was read (413, a refused
//     header) closes the connection after reading what the client still
//     sends for a moment, so the client sees the answer, not a reset.
//
// Handlers call close_after_response() to end the connection after the
// response they are making.
#pragma once

#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace kvq::serve {

struct ConnectionLimits {
  int io_seconds = 30;          // each recv and send
  int request_seconds = 30;     // a request's head and body, from its first byte
  int keep_alive_seconds = 5;   // idle between two requests of a connection
  int per_client = 0;           // connections at once from one address (0: no cap)
  std::string refusal_json;     // the 503's body past per_client (the caller's error shape)
};

class GuardedServer : public httplib::Server {
 public:
  explicit GuardedServer(const ConnectionLimits& limits);

  // Connections refused by the per-client cap; requests cut off by the deadline.
  uint64_t connections_refused() const { return refused_.load(); }
  uint64_t requests_timed_out() const { return timed_out_.load(); }
  int connections_open() const { return open_.load(); }

  // The connection of the request being handled on this thread closes once
  // its response is written (no-op outside a handler).
  static void close_after_response();

 private:
  bool process_and_close_socket(socket_t sock) override;

  ConnectionLimits limits_;
  std::mutex mu_;
  std::unordered_map<std::string, int> per_address_;
  std::atomic<uint64_t> refused_{0}, timed_out_{0};
  std::atomic<int> open_{0};
};

}  // namespace kvq::serve
