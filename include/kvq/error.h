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
#include <string_view>

namespace kvq {

// `s` as one line of valid UTF-8 that a terminal shows as it is: control
// characters (newline, ESC, NUL, DEL, C1) and bytes that are not valid
// UTF-8 become \xNN; printable ASCII and well-formed UTF-8 pass unchanged
// (so escaping twice changes nothing). Strings read from files (a saved
// cache's scheme name, a GGUF's metadata) reach messages only through this.
std::string escape_for_message(std::string_view s);

// Its message is escaped (escape_for_message): one line, whatever a file
// put into it.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(escape_for_message(what)) {}
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
