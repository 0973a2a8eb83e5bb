// The connections of `kvq serve` (serve/connection.h).
#include "serve/connection.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

namespace kvq::serve {
namespace {

using Clock = std::chrono::steady_clock;

struct ConnState {
  bool close = false;  // close_after_response() was called for this request
};
thread_local ConnState* tl_conn = nullptr;

int MsUntil(Clock::time_point t) {
  if (t == Clock::time_point::max()) return 1 << 30;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(t - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(ms, 0, 1LL << 30));
}

// poll() for one event, restarted on EINTR. > 0: ready; 0: timed out; < 0: error.
int WaitFor(int fd, short events, int ms) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, ms);
    if (r < 0 && errno == EINTR) continue;
    return r;
  }
}

// An address as text ("127.0.0.1", "::1"; an IPv4-mapped IPv6 address as IPv4).
bool AddressOf(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  const int r = peer ? getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len)
                     : getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  if (r != 0) return false;
  char text[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    inet_ntop(AF_INET, &in->sin_addr, text, sizeof text);
    port = ntohs(in->sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto* in = reinterpret_cast<const sockaddr_in6*>(&a);
    inet_ntop(AF_INET6, &in->sin6_addr, text, sizeof text);
    port = ntohs(in->sin6_port);
  } else {
    return false;
  }
  ip = text;
  if (ip.rfind("::ffff:", 0) == 0 && ip.find('.') != std::string::npos) ip = ip.substr(7);
  return true;
}

// A socket read through one buffer for the connection's life (so bytes read
// past one request are the next request's), every read bounded by the
// smaller of the recv timeout and the request's deadline.
class DeadlineStream final : public httplib::Stream {
 public:
  DeadlineStream(socket_t sock, int io_seconds) : sock_(sock), io_ms_(io_seconds * 1000) {}

  void start_request(Clock::time_point deadline) {
    deadline_ = deadline;
    timed_out_ = false;
  }
  bool timed_out() const { return timed_out_; }
  // A byte of the next request within `ms`: buffered, or on the socket.
  bool wait_for_request(int ms) const { return off_ < len_ || WaitFor(sock_, POLLIN, ms) > 0; }

  bool is_readable() const override { return off_ < len_ || WaitRead(); }
  bool is_writable() const override { return WaitFor(sock_, POLLOUT, io_ms_) > 0; }

  ssize_t read(char* ptr, size_t size) override {
    if (off_ == len_) {
      if (!WaitRead()) return -1;
      const bool direct = size >= sizeof buf_;  // large reads skip the buffer
      ssize_t r;
      do {
        r = ::recv(sock_, direct ? ptr : buf_, direct ? size : sizeof buf_, 0);
      } while (r < 0 && errno == EINTR);
      if (r <= 0 || direct) return r;
      off_ = 0;
      len_ = static_cast<size_t>(r);
    }
    const size_t n = std::min(size, len_ - off_);
    std::memcpy(ptr, buf_ + off_, n);
    off_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    ssize_t r;
    do {
      r = ::send(sock_, ptr, size, MSG_NOSIGNAL);
    } while (r < 0 && errno == EINTR);
    return r;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { AddressOf(sock_, true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { AddressOf(sock_, false, ip, port); }
  socket_t socket() const override { return sock_; }

 private:
  bool WaitRead() const {
    const int to_deadline = MsUntil(deadline_);
    if (to_deadline == 0) {
      timed_out_ = true;
      return false;
    }
    const int r = WaitFor(sock_, POLLIN, std::min(io_ms_, to_deadline));
    if (r == 0 && to_deadline <= io_ms_) timed_out_ = true;  // the wait ended at the deadline
    return r > 0;
  }

  socket_t sock_;
  int io_ms_;
  Clock::time_point deadline_ = Clock::time_point::max();
  mutable bool timed_out_ = false;
  char buf_[4096];
  size_t off_ = 0, len_ = 0;
};

void SendAll(int fd, const std::string& s, int ms) {
  size_t at = 0;
  while (at < s.size() && WaitFor(fd, POLLOUT, ms) > 0) {
    const ssize_t r = ::send(fd, s.data() + at, s.size() - at, MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return;
    at += static_cast<size_t>(r);
  }
}

// Close after an answer the client may still be sending a body to: stop
// writing, read (and drop) what arrives for up to `ms` or 8 MiB, then
// close, so the client reads the answer instead of a connection reset
// (which unread bytes at close() would send).
void LingeringClose(int fd, int ms) {
  ::shutdown(fd, SHUT_WR);
  const auto until = Clock::now() + std::chrono::milliseconds(ms);
  char sink[16384];
  size_t dropped = 0;
  while (dropped < (8u << 20) && WaitFor(fd, POLLIN, MsUntil(until)) > 0) {
    const ssize_t r = ::recv(fd, sink, sizeof sink, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    dropped += static_cast<size_t>(r);
  }
  ::close(fd);
}

}  // namespace

GuardedServer::GuardedServer(const ConnectionLimits& limits) : limits_(limits) {
  set_read_timeout(limits.io_seconds, 0);
  set_write_timeout(limits.io_seconds, 0);
  set_keep_alive_timeout(limits.keep_alive_seconds);
}

void GuardedServer::close_after_response() {
  if (tl_conn != nullptr) tl_conn->close = true;
}

bool GuardedServer::process_and_close_socket(socket_t sock) {
  std::string address;
  int port = 0;
  if (!AddressOf(sock, true, address, port)) address = "?";
  bool over = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    int& n = per_address_[address];
    over = limits_.per_client > 0 && n >= limits_.per_client;
    if (!over) ++n;
  }
  if (over) {
    ++refused_;
    const std::string& body = limits_.refusal_json;
    SendAll(sock,
            "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\nContent-Type: "
            "application/json\r\nContent-Length: " +
                std::to_string(body.size()) + "\r\n\r\n" + body,
            1000);
    // What has arrived is read, and up to 100 ms for the rest of a request
    // on its way: a close with unread bytes sends RST, and a client whose
    // request crossed the 503 lost the answer with it (a loaded machine's
    // race). A silent client holds this thread for those 100 ms at most.
    LingeringClose(sock, 100);
    return false;
  }
  ++open_;
  ConnState state;
  tl_conn = &state;
  DeadlineStream strm(sock, limits_.io_seconds);
  const auto request_time = std::chrono::seconds(limits_.request_seconds);
  bool ok = false;
  for (size_t count = keep_alive_max_count_; count > 0 && svr_sock_ != INVALID_SOCKET; --count) {
    // Wait for the request's first byte in slices (a stopping server closes
    // the connection): the first request up to its deadline, which runs
    // from the connection's start (a connection that sends nothing is cut
    // off like one that trickles), a later one up to the keep-alive time.
    const bool first = count == keep_alive_max_count_;
    const auto now = Clock::now();
    const auto wait_until = first ? now + request_time : now + std::chrono::seconds(keep_alive_timeout_sec_);
    bool more = false;
    while (!more && svr_sock_ != INVALID_SOCKET && Clock::now() < wait_until) {
      more = strm.wait_for_request(std::min(100, MsUntil(wait_until)));
    }
    if (!more) {
      if (first && Clock::now() >= wait_until) ++timed_out_;
      break;
    }
    strm.start_request(first ? now + request_time : Clock::now() + request_time);
    bool closed = false;
    state.close = false;
    ok = process_request(strm, count == 1, closed, nullptr);
    if (strm.timed_out()) {
      ++timed_out_;
      break;
    }
    if (!ok || closed || state.close) break;
  }
  tl_conn = nullptr;
  if (state.close) {
    LingeringClose(sock, 1000);
  } else {
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
  }
  --open_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = per_address_.find(address);
    if (it != per_address_.end() && --it->second <= 0) per_address_.erase(it);
  }
  return ok;
}

}  // namespace kvq::serve
