// kvq::Error — the one exception type of kvq's public API.
//
// Two error tiers (see STYLE.md): public entry points validate their
// arguments and throw kvq::Error with a message naming the argument and what
// was expected; internal invariants use KVQ_ASSERT, which aborts with
// file:line. Kernels never throw.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace kvq {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
[[noreturn]] void AssertFail(const char* expr, const char* file, int line);

template <typename... Args>
std::string Concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

// Throws kvq::Error built from the streamed arguments.
template <typename... Args>
[[noreturn]] void Fail(const Args&... args) {
  throw Error(detail::Concat(args...));
}

}  // namespace kvq

// Always-on internal invariant check (not for argument validation).
#define KVQ_ASSERT(cond) \
  ((cond) ? (void)0 : ::kvq::detail::AssertFail(#cond, __FILE__, __LINE__))

// Argument validation: throws kvq::Error("<fn>: <msg>") when cond is false.
#define KVQ_CHECK_ARG(cond, ...) \
  do {                           \
    if (!(cond)) ::kvq::Fail(__VA_ARGS__); \
  } while (0)
