// Internal: an enum's names as one table, read both ways (name_of for
// reports and JSON, parse_name for options: a kvq::Error naming the argument
// and listing every name). One table per enum beside its functions, instead
// of a switch for each direction.
//
//   constexpr NamedValue<QuantMode> kModes[] = {{QuantMode::Int8, "int8"}, {QuantMode::Fp8, "fp8"}};
//   name_of(kModes, QuantMode::Fp8)         -> "fp8"
//   parse_name(kModes, "int4", "mode")      -> kvq::Error "mode: expected 'int8' or 'fp8', got 'int4'"
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "kvq/error.h"

namespace kvq {

template <typename E>
struct NamedValue {
  E value;
  const char* name;
};

// The name of v, or `unknown` when the table has none (a value out of range).
template <typename E, size_t N>
const char* name_of(const NamedValue<E> (&table)[N], E v, const char* unknown = "unknown") {
  for (const NamedValue<E>& e : table) {
    if (e.value == v) return e.name;
  }
  return unknown;
}

// 'a', 'b' or 'c': the table's names for an error message.
template <typename E, size_t N>
std::string names_of(const NamedValue<E> (&table)[N]) {
  std::string s;
  for (size_t i = 0; i < N; ++i) {
    s += (i == 0 ? "'" : i + 1 == N ? " or '" : ", '") + std::string(table[i].name) + "'";
  }
  return s;
}

// The value named s; a kvq::Error "<arg>: expected <names>, got '<s>'" otherwise.
template <typename E, size_t N>
E parse_name(const NamedValue<E> (&table)[N], const std::string& s, const char* arg) {
  for (const NamedValue<E>& e : table) {
    if (s == e.name) return e.value;
  }
  Fail(arg, ": expected ", names_of(table), ", got '", s, "'");
}

// "a,b,,c" -> {"a", "b", "", "c"}: an option's comma-separated list, each
// item as written (the caller says what an empty one means).
inline std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  for (size_t at = 0; at <= list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    out.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

}  // namespace kvq
