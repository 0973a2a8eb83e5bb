// The Jinja subset of chat templates (model/chat_template.h): a lexer with
// jinja2's whitespace rules, a recursive-descent parser with jinja2's
// precedence, and a tree-walking renderer with Python's value semantics,
// every step of it counted against ChatTemplateLimits.
#include "model/chat_template.h"

#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/locid.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <ctime>
#include <map>
#include <string_view>
#include <unordered_map>

#include "kvq/error.h"
#include "kvq/file.h"
#include "model/tokenizer.h"

namespace kvq::model {
namespace {

// ---- UTF-8 ---------------------------------------------------------------

bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : -1;
    if (n < 0 || i + static_cast<size_t>(n) >= s.size()) return false;
    char32_t cp = n == 0 ? c : c & (0x3F >> n);
    for (int k = 1; k <= n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      if ((d >> 6) != 2) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += static_cast<size_t>(n) + 1;
  }
  return true;
}

// Code points of valid UTF-8 (every string here is: JSON input and the
// template's source are checked).
std::u32string decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int n = c < 0x80 ? 0 : c < 0xE0 ? 1 : c < 0xF0 ? 2 : 3;
    char32_t cp = n == 0 ? c : c & (0x3F >> n);
    for (int k = 1; k <= n && i + k < s.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += n + 1;
  }
  return out;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) append_utf8(out, c);
  return out;
}

// Python's str.isspace() (what str.strip() and str.split() remove).
bool py_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Python's str.strip / lstrip / rstrip; `chars` null: whitespace.
std::string py_strip(std::string_view s, const std::u32string* chars, bool left, bool right) {
  const std::u32string u = decode(s);
  auto drop = [&](char32_t c) { return chars ? chars->find(c) != std::u32string::npos : py_space(c); };
  size_t b = 0, e = u.size();
  if (left)
    while (b < e && drop(u[b])) ++b;
  if (right)
    while (e > b && drop(u[e - 1])) --e;
  return encode(std::u32string_view(u).substr(b, e - b));
}

std::string icu_case(std::string_view s, int how) {  // 0 upper, 1 lower
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(s.data(), static_cast<int32_t>(s.size())));
  if (how == 0)
    u.toUpper(icu::Locale::getRoot());
  else
    u.toLower(icu::Locale::getRoot());
  std::string out;
  u.toUTF8String(out);
  return out;
}

bool cased(char32_t c) { return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_CASED); }

// Python's str.title(): a cased character after an uncased one is
// titlecased, every other cased character lowercased.
std::string py_title(std::string_view s) {
  std::u32string u = decode(s);
  bool prev_cased = false;
  for (char32_t& c : u) {
    const bool cs = cased(c);
    c = static_cast<char32_t>(prev_cased ? u_tolower(static_cast<UChar32>(c)) : u_totitle(static_cast<UChar32>(c)));
    prev_cased = cs;
  }
  return encode(u);
}

// jinja2's |title: words begin after spaces, '-', '(', '{', '[' and '<'.
std::string jinja_title(std::string_view s) {
  std::u32string u = decode(s);
  bool start = true;
  for (char32_t& c : u) {
    const bool sep = py_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    if (sep) {
      start = true;
      continue;
    }
    c = static_cast<char32_t>(start ? u_toupper(static_cast<UChar32>(c)) : u_tolower(static_cast<UChar32>(c)));
    start = false;
  }
  return encode(u);
}

std::string py_capitalize(std::string_view s) {
  std::u32string u = decode(s);
  for (size_t i = 0; i < u.size(); ++i)
    u[i] = static_cast<char32_t>(i == 0 ? u_totitle(static_cast<UChar32>(u[i])) : u_tolower(static_cast<UChar32>(u[i])));
  return encode(u);
}

// Python's repr(float).
std::string py_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::scientific);
  std::string_view t(buf, static_cast<size_t>(r.ptr - buf));
  std::string sign;
  if (!t.empty() && t[0] == '-') {
    sign = "-";
    t.remove_prefix(1);
  }
  const size_t e = t.find('e');
  std::string digits;
  for (char c : t.substr(0, e))
    if (c != '.') digits.push_back(c);
  int exp = 0;
  std::from_chars(t.data() + e + 1 + (t[e + 1] == '+' ? 1 : 0), t.data() + t.size(), exp);
  const int decpt = exp + 1;
  const int nd = static_cast<int>(digits.size());
  std::string out = sign;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
    } else if (decpt >= nd) {
      out += digits + std::string(static_cast<size_t>(decpt - nd), '0') + ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(decpt)) + "." + digits.substr(static_cast<size_t>(decpt));
    }
  } else {
    out += digits.substr(0, 1);
    if (nd > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return out;
}

// ---- values --------------------------------------------------------------

enum class K : uint8_t { Undef, None, Bool, Int, Float, Str, List, Dict, Ns, Func };

struct Value;
using List = std::vector<Value>;
struct Dict;

struct Value {
  K k = K::Undef;
  bool tuple = false;  // a List that prints as a tuple
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::shared_ptr<const std::string> s;  // Str; Undef: the name that was undefined; Func: its name
  std::shared_ptr<const List> l;
  std::shared_ptr<Dict> d;  // Dict (never changed once made) and Ns (its attributes, set by `set ns.a`)

  static Value none() { Value v; v.k = K::None; return v; }
  static Value boolean(bool x) { Value v; v.k = K::Bool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.k = K::Int; v.i = x; return v; }
  static Value real(double x) { Value v; v.k = K::Float; v.f = x; return v; }
  static Value undef(std::string what) {
    Value v;
    v.s = std::make_shared<const std::string>(std::move(what));
    return v;
  }
  const std::string& str() const { return *s; }
  bool is_num() const { return k == K::Int || k == K::Float || k == K::Bool; }
  bool is_intlike() const { return k == K::Int || k == K::Bool; }
  int64_t as_int() const { return k == K::Bool ? (b ? 1 : 0) : i; }
  double as_real() const { return k == K::Float ? f : static_cast<double>(as_int()); }
};

struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(std::string_view key) const {
    for (const auto& [k, v] : items)
      if (k == key) return &v;
    return nullptr;
  }
  void set(const std::string& key, Value v) {
    for (auto& [k, old] : items)
      if (k == key) {
        old = std::move(v);
        return;
      }
    items.emplace_back(key, std::move(v));
  }
};

const char* type_name(const Value& v) {
  switch (v.k) {
    case K::Undef: return "undefined";
    case K::None: return "none";
    case K::Bool: return "boolean";
    case K::Int: return "integer";
    case K::Float: return "float";
    case K::Str: return "string";
    case K::List: return v.tuple ? "tuple" : "list";
    case K::Dict: return "dict";
    case K::Ns: return "namespace";
    case K::Func: return "function";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.k) {
    case K::Undef:
    case K::None: return false;
    case K::Bool: return v.b;
    case K::Int: return v.i != 0;
    case K::Float: return v.f != 0;
    case K::Str: return !v.s->empty();
    case K::List: return !v.l->empty();
    case K::Dict: return !v.d->items.empty();
    case K::Ns:
    case K::Func: return true;
  }
  return false;
}

bool equal(const Value& a, const Value& b) {
  if (a.is_num() && b.is_num()) {
    if (a.k == K::Float || b.k == K::Float) return a.as_real() == b.as_real();
    return a.as_int() == b.as_int();
  }
  if (a.k != b.k) return false;
  switch (a.k) {
    case K::Undef:
    case K::None: return true;
    case K::Str: return *a.s == *b.s;
    case K::List:
      if (a.tuple != b.tuple || a.l->size() != b.l->size()) return false;
      for (size_t i = 0; i < a.l->size(); ++i)
        if (!equal((*a.l)[i], (*b.l)[i])) return false;
      return true;
    case K::Dict:
      if (a.d->items.size() != b.d->items.size()) return false;
      for (const auto& [k, v] : a.d->items) {
        const Value* o = b.d->find(k);
        if (!o || !equal(v, *o)) return false;
      }
      return true;
    default: return a.d == b.d && a.s == b.s;
  }
}

void py_repr_str(std::string& out, const std::string& s) {
  const bool has_sq = s.find('\'') != std::string::npos, has_dq = s.find('"') != std::string::npos;
  const char q = has_sq && !has_dq ? '"' : '\'';
  out.push_back(q);
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == q || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (u < 0x20 || u == 0x7F) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02x", u);
      out += b;
    } else {
      out.push_back(c);
    }
  }
  out.push_back(q);
}

void to_text(std::string& out, const Value& v, bool repr);

void to_text(std::string& out, const Value& v, bool repr) {
  switch (v.k) {
    case K::Undef: if (repr) out += "Undefined"; return;
    case K::None: out += "None"; return;
    case K::Bool: out += v.b ? "True" : "False"; return;
    case K::Int: out += std::to_string(v.i); return;
    case K::Float: out += py_float(v.f); return;
    case K::Str:
      if (repr)
        py_repr_str(out, *v.s);
      else
        out += *v.s;
      return;
    case K::List: {
      out.push_back(v.tuple ? '(' : '[');
      for (size_t i = 0; i < v.l->size(); ++i) {
        if (i) out += ", ";
        to_text(out, (*v.l)[i], true);
      }
      if (v.tuple && v.l->size() == 1) out.push_back(',');
      out.push_back(v.tuple ? ')' : ']');
      return;
    }
    case K::Dict: {
      out.push_back('{');
      bool first = true;
      for (const auto& [k, x] : v.d->items) {
        if (!first) out += ", ";
        first = false;
        py_repr_str(out, k);
        out += ": ";
        to_text(out, x, true);
      }
      out.push_back('}');
      return;
    }
    case K::Ns: out += "<Namespace>"; return;
    case K::Func: out += "<function " + *v.s + ">"; return;
  }
}

// ---- the template's tree -------------------------------------------------

struct Expr;
using ExprP = std::unique_ptr<Expr>;
struct Expr {
  enum Op {
    Lit, Name, ListLit, TupleLit, DictLit, Attr, Item, Slice, Call, Filter, Test, Neg, Pos, Not, Bin, And, Or,
    Cond, Compare
  } op;
  int line = 0;
  Value lit;
  std::string name;                 // Name, Attr, Filter, Test, Bin's operator
  std::vector<ExprP> a;             // operands, arguments (a null: an omitted slice bound)
  std::vector<std::string> kwname;  // keyword arguments' names ...
  std::vector<ExprP> kwval;         // ... and values
  std::vector<std::string> cmp;     // Compare: the operators between a[i] and a[i+1]
  bool negate = false;              // Test: `is not`
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;
struct Stmt {
  enum Kind { Text, Output, If, For, Set, SetBlock, Break, Continue, Scope } kind;
  int line = 0;
  std::string text;                 // Text
  ExprP expr;                       // Output, Set's value, For's iterable
  std::vector<std::pair<ExprP, Body>> branches;  // If
  Body body, else_body;             // For, SetBlock, Scope (generation), If's else
  std::vector<std::string> targets; // For, Set: names; Set of `ns.attr`: {ns, attr} with ns_attr
  bool ns_attr = false, tuple_target = false;
  ExprP filter;                     // For: its `if`
};

// ---- lexer ---------------------------------------------------------------

struct Tok {
  enum T { Data, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, Str, Int, Float, Op, End } t;
  std::string s;
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

bool ws_ascii(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

// Python's str.rstrip() / lstrip() on whitespace, for the `-` markers.
std::string rstrip_ws(const std::string& s) { return py_strip(s, nullptr, false, true); }

// Bytes of whitespace (Python's \s) at s[pos..].
size_t ws_span(std::string_view s, size_t pos) {
  size_t p = pos;
  while (p < s.size()) {
    if (ws_ascii(s[p]) || (s[p] >= 0x1C && s[p] <= 0x1F)) {
      ++p;
      continue;
    }
    const auto c = static_cast<unsigned char>(s[p]);
    if (c < 0x80) break;
    const int n = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    if (p + n > s.size()) break;
    const std::u32string u = decode(s.substr(p, n));
    if (u.size() != 1 || !py_space(u[0])) break;
    p += n;
  }
  return p - pos;
}

class Lexer {
 public:
  Lexer(const std::string& src, const std::string& what, int max_tokens) : what_(what), max_tokens_(max_tokens) {
    // jinja2: newlines normalised to \n, one trailing newline dropped.
    src_.reserve(src.size());
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i] == '\r') {
        src_.push_back('\n');
        if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
      } else {
        src_.push_back(src[i]);
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Tok> run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      // The first tag opener.
      size_t p = pos;
      char kind = 0;
      while (true) {
        p = src_.find('{', p);
        if (p == std::string::npos || p + 1 >= src_.size()) {
          p = std::string::npos;
          break;
        }
        const char n = src_[p + 1];
        if (n == '{' || n == '%' || n == '#') {
          kind = n;
          break;
        }
        ++p;
      }
      if (p == std::string::npos) {
        data(src_.substr(pos), pos);
        break;
      }
      std::string text = src_.substr(pos, p - pos);
      size_t q = p + 2;
      char sign = 0;
      if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) sign = src_[q++];
      if (sign == '-') {
        text = rstrip_ws(text);
      } else if (sign != '+' && kind != '{') {  // lstrip_blocks
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if (l_pos > 0 || line_starting) {
          bool blank = true;
          for (size_t k = l_pos; k < text.size(); ++k)
            if (text[k] != ' ' && text[k] != '\t') blank = false;
          if (blank) text.resize(l_pos);
        }
      }
      data(text, pos);
      if (kind == '#') {
        pos = comment(q, &line_starting);
        continue;
      }
      if (kind == '%' && is_raw(q)) {
        pos = raw(q, &line_starting);
        continue;
      }
      push(kind == '{' ? Tok::VarBegin : Tok::BlockBegin, "", p);
      pos = tag(q, kind, &line_starting);
    }
    push(Tok::End, "", src_.size());
    return std::move(toks_);
  }

 private:
  [[noreturn]] void fail(size_t pos, const std::string& msg) const {
    Fail(what_, ": line ", line_of(pos), ": ", msg);
  }
  int line_of(size_t pos) const {
    return 1 + static_cast<int>(std::count(src_.begin(), src_.begin() + static_cast<std::ptrdiff_t>(std::min(pos, src_.size())), '\n'));
  }
  void push(Tok::T t, std::string s, size_t pos) {
    if (static_cast<int>(toks_.size()) >= max_tokens_) fail(pos, "more than " + std::to_string(max_tokens_) + " tokens");
    Tok k;
    k.t = t;
    k.s = std::move(s);
    k.line = line_of(pos);
    toks_.push_back(std::move(k));
  }
  void data(const std::string& text, size_t pos) {
    if (!text.empty()) push(Tok::Data, text, pos);
  }

  // After a comment's `{#`: its end (`#}`, `-#}` with the whitespace after,
  // `+#}`; trim_blocks: one newline after `#}`).
  size_t comment(size_t q, bool* line_starting) {
    for (size_t p = q; p + 1 < src_.size(); ++p) {
      if ((src_[p] == '-' || src_[p] == '+') && src_.compare(p + 1, 2, "#}") == 0) {
        size_t e = p + 3;
        if (src_[p] == '-') e += ws_span(src_, e);
        *line_starting = e > 0 && src_[e - 1] == '\n';
        return e;
      }
      if (src_.compare(p, 2, "#}") == 0) {
        size_t e = p + 2;
        if (e < src_.size() && src_[e] == '\n') ++e;
        *line_starting = src_[e - 1] == '\n';
        return e;
      }
    }
    fail(q, "a comment `{#` without its `#}`");
  }

  bool is_raw(size_t q) const {
    size_t p = q + ws_span(src_, q);
    if (src_.compare(p, 3, "raw") != 0) return false;
    p += 3;
    p += ws_span(src_, p);
    return src_.compare(p, 2, "%}") == 0 || src_.compare(p, 3, "-%}") == 0;
  }

  size_t raw(size_t q, bool* line_starting) {
    size_t p = q + ws_span(src_, q) + 3;
    p += ws_span(src_, p);
    if (src_[p] == '-') {
      p += 3;
      p += ws_span(src_, p);
    } else {
      p += 2;
    }
    // `{%[-+]? endraw [-]?%}`
    for (size_t s = p; (s = src_.find("{%", s)) != std::string::npos; ++s) {
      size_t e = s + 2;
      const char sign = e < src_.size() && (src_[e] == '-' || src_[e] == '+') ? src_[e] : 0;
      if (sign) ++e;
      e += ws_span(src_, e);
      if (src_.compare(e, 6, "endraw") != 0) continue;
      e += 6;
      e += ws_span(src_, e);
      std::string body = src_.substr(p, s - p);
      if (sign == '-') body = rstrip_ws(body);
      if (src_.compare(e, 3, "-%}") == 0) {
        e += 3;
        e += ws_span(src_, e);
      } else if (src_.compare(e, 2, "%}") == 0) {
        e += 2;
        if (e < src_.size() && src_[e] == '\n') ++e;
      } else {
        continue;
      }
      data(body, p);
      *line_starting = src_[e - 1] == '\n';
      return e;
    }
    fail(q, "a `{% raw %}` without its `{% endraw %}`");
  }

  // The tokens of a tag's inside, through its end.
  size_t tag(size_t p, char kind, bool* line_starting) {
    const char close = kind == '{' ? '}' : '%';
    const Tok::T end_t = kind == '{' ? Tok::VarEnd : Tok::BlockEnd;
    int open = 0;  // brackets open: jinja2 does not end a tag inside them
    while (true) {
      p += ws_span(src_, p);
      if (p >= src_.size()) fail(p, std::string("a tag opened with `{") + kind + "` is not closed");
      const char c = src_[p];
      // Ends (not inside brackets): `-X}` (and the whitespace after), `+%}`,
      // `X}` (trim_blocks: one newline after `%}`).
      if (open == 0 && (c == '-' || (c == '+' && kind == '%')) && p + 2 < src_.size() && src_[p + 1] == close &&
          src_[p + 2] == '}') {
        push(end_t, "", p);
        size_t e = p + 3;
        if (c == '-') e += ws_span(src_, e);
        *line_starting = src_[e - 1] == '\n';
        return e;
      }
      if (open == 0 && c == close && p + 1 < src_.size() && src_[p + 1] == '}') {
        push(end_t, "", p);
        size_t e = p + 2;
        if (kind == '%' && e < src_.size() && src_[e] == '\n') ++e;
        *line_starting = src_[e - 1] == '\n';
        return e;
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = p;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        push(Tok::Name, src_.substr(p, e - p), p);
        p = e;
        continue;
      }
      if (std::isdigit(static_cast<unsigned char>(c))) {
        p = number(p);
        continue;
      }
      if (c == '\'' || c == '"') {
        p = string(p);
        continue;
      }
      static const char* ops2[] = {"//", "**", "==", "!=", ">=", "<="};
      bool two = false;
      for (const char* o : ops2)
        if (src_.compare(p, 2, o) == 0) {
          push(Tok::Op, o, p);
          p += 2;
          two = true;
          break;
        }
      if (two) continue;
      if (std::strchr("+-/*%~[](){}<>=.:|,;", c) && c != 0) {
        if (c == '(' || c == '[' || c == '{') ++open;
        if ((c == ')' || c == ']' || c == '}') && open > 0) --open;
        push(Tok::Op, std::string(1, c), p);
        ++p;
        continue;
      }
      fail(p, std::string("unexpected character '") + escape_for_message(std::string(1, c)) + "' in a tag");
    }
  }

  size_t number(size_t p) {
    auto digits = [&](size_t q) {
      // (\d+_)*\d+
      size_t e = q;
      while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) {
        while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
        if (e + 1 < src_.size() && src_[e] == '_' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) ++e;
      }
      return e;
    };
    size_t e = digits(p);
    bool is_float = false;
    if (e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
      e = digits(e + 1);
      is_float = true;
    }
    if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t x = e + 1;
      if (x < src_.size() && (src_[x] == '+' || src_[x] == '-')) ++x;
      if (x < src_.size() && std::isdigit(static_cast<unsigned char>(src_[x]))) {
        e = digits(x);
        is_float = true;
      }
    }
    std::string t;
    for (size_t k = p; k < e; ++k)
      if (src_[k] != '_') t.push_back(src_[k]);
    if (is_float) {
      double v = 0;
      std::from_chars(t.data(), t.data() + t.size(), v);
      push(Tok::Float, t, p);
      toks_.back().f = v;
    } else {
      int64_t v = 0;
      const auto r = std::from_chars(t.data(), t.data() + t.size(), v);
      if (r.ec != std::errc()) fail(p, "integer literal " + t + " out of range");
      push(Tok::Int, t, p);
      toks_.back().i = v;
    }
    return e;
  }

  // A string literal with Python's escapes (unicode-escape).
  size_t string(size_t p) {
    const char q = src_[p];
    std::string out;
    size_t e = p + 1;
    auto hex = [&](size_t at, int n) -> char32_t {
      if (at + static_cast<size_t>(n) > src_.size()) fail(at, "a truncated \\x, \\u or \\U escape");
      char32_t v = 0;
      for (int k = 0; k < n; ++k) {
        const char h = src_[at + static_cast<size_t>(k)];
        const int d = std::isdigit(static_cast<unsigned char>(h)) ? h - '0'
                      : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                      : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
        if (d < 0) fail(at, "a malformed \\x, \\u or \\U escape");
        v = v * 16 + static_cast<char32_t>(d);
      }
      return v;
    };
    while (true) {
      if (e >= src_.size()) fail(p, "a string literal is not closed");
      const char c = src_[e];
      if (c == q) break;
      if (c != '\\') {
        out.push_back(c);
        ++e;
        continue;
      }
      if (e + 1 >= src_.size()) fail(p, "a string literal is not closed");
      const char n = src_[e + 1];
      e += 2;
      switch (n) {
        case '\n': break;
        case '\\': out.push_back('\\'); break;
        case '\'': out.push_back('\''); break;
        case '"': out.push_back('"'); break;
        case 'a': out.push_back('\a'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'v': out.push_back('\v'); break;
        case 'x': append_utf8(out, hex(e, 2)); e += 2; break;
        case 'u': {
          const char32_t v = hex(e, 4);
          if (v >= 0xD800 && v <= 0xDFFF) fail(e, "a surrogate \\u escape");
          append_utf8(out, v);
          e += 4;
          break;
        }
        case 'U': {
          const char32_t v = hex(e, 8);
          if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) fail(e, "a \\U escape out of range");
          append_utf8(out, v);
          e += 8;
          break;
        }
        default:
          if (n >= '0' && n <= '7') {
            char32_t v = static_cast<char32_t>(n - '0');
            for (int k = 0; k < 2 && e < src_.size() && src_[e] >= '0' && src_[e] <= '7'; ++k, ++e)
              v = v * 8 + static_cast<char32_t>(src_[e] - '0');
            append_utf8(out, v);
          } else {  // Python keeps an unknown escape as it is
            out.push_back('\\');
            --e;
          }
      }
    }
    push(Tok::Str, out, p);
    return e + 1;
  }

  std::string src_;
  const std::string& what_;
  int max_tokens_;
  std::vector<Tok> toks_;
};

// ---- parser --------------------------------------------------------------

const char* const kFilters[] = {
    "trim", "length", "count", "first", "last", "join", "default", "d", "upper", "lower", "title", "capitalize",
    "replace", "string", "int", "float", "abs", "list", "reverse", "tojson", "items", "selectattr", "rejectattr",
    "select", "reject", "map", "unique", "sort", "safe", "min", "max", "sum"};
const char* const kTests[] = {
    "defined", "undefined", "none", "string", "number", "integer", "float", "boolean", "mapping", "iterable",
    "sequence", "callable", "true", "false", "odd", "even", "divisibleby", "equalto", "eq", "==", "ne", "!=",
    "lt", "<", "le", "<=", "gt", ">", "ge", ">=", "in", "lower", "upper", "sameas"};

template <size_t N>
bool known(const char* const (&names)[N], const std::string& n) {
  for (const char* x : names)
    if (n == x) return true;
  return false;
}

class Parser {
 public:
  Parser(std::vector<Tok> toks, const std::string& what, int max_depth)
      : t_(std::move(toks)), what_(what), max_depth_(max_depth) {}

  Body parse_template() {
    Body b = body({});
    if (cur().t != Tok::End) fail("an unexpected tag");
    return b;
  }

 private:
  struct Depth {
    Parser& p;
    explicit Depth(Parser& p) : p(p) {
      if (++p.depth_ > p.max_depth_)
        p.fail("nesting deeper than " + std::to_string(p.max_depth_) + " (expressions and blocks)");
    }
    ~Depth() { --p.depth_; }
  };

  const Tok& cur() const { return t_[pos_]; }
  const Tok& look(size_t k = 1) const { return t_[std::min(pos_ + k, t_.size() - 1)]; }
  void next() {
    if (pos_ + 1 < t_.size()) ++pos_;
  }
  [[noreturn]] void fail(const std::string& msg) const { Fail(what_, ": line ", cur().line, ": ", msg); }
  bool is_op(const char* o) const { return cur().t == Tok::Op && cur().s == o; }
  bool is_name(const char* n) const { return cur().t == Tok::Name && cur().s == n; }
  bool skip_op(const char* o) {
    if (!is_op(o)) return false;
    next();
    return true;
  }
  bool skip_name(const char* n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }
  void expect_op(const char* o) {
    if (!skip_op(o)) fail(std::string("expected '") + o + "'");
  }
  std::string expect_name() {
    if (cur().t != Tok::Name) fail("expected a name");
    std::string n = cur().s;
    next();
    return n;
  }
  void expect_block_end() {
    if (cur().t != Tok::BlockEnd) fail("expected the end of the tag (%})");
    next();
  }
  ExprP node(Expr::Op op) {
    auto e = std::make_unique<Expr>();
    e->op = op;
    e->line = cur().line;
    return e;
  }

  // Statements up to a `{% name %}` in `ends` (left unconsumed, after its
  // `{%`).
  Body body(const std::vector<std::string>& ends) {
    Depth d(*this);
    Body out;
    while (true) {
      const Tok& tk = cur();
      if (tk.t == Tok::End) {
        if (!ends.empty()) fail("the template ends inside a block (expected {% " + ends.back() + " %})");
        return out;
      }
      if (tk.t == Tok::Data) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Text;
        s->line = tk.line;
        s->text = tk.s;
        out.push_back(std::move(s));
        next();
        continue;
      }
      if (tk.t == Tok::VarBegin) {
        next();
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Output;
        s->line = tk.line;
        s->expr = tuple(true);
        if (cur().t != Tok::VarEnd) fail("expected the end of the output (}})");
        next();
        out.push_back(std::move(s));
        continue;
      }
      if (tk.t != Tok::BlockBegin) fail("unexpected token");
      next();
      if (cur().t != Tok::Name) fail("expected a statement name after {%");
      const std::string kw = cur().s;
      if (std::find(ends.begin(), ends.end(), kw) != ends.end()) return out;
      out.push_back(statement());
    }
  }

  std::unique_ptr<Stmt> statement() {
    const std::string kw = cur().s;
    auto s = std::make_unique<Stmt>();
    s->line = cur().line;
    next();
    if (kw == "if") {
      s->kind = Stmt::If;
      ExprP c = tuple(false);
      expect_block_end();
      while (true) {
        Body b = body({"elif", "else", "endif"});
        s->branches.emplace_back(std::move(c), std::move(b));
        const std::string e = cur().s;
        next();
        if (e == "elif") {
          c = tuple(false);
          expect_block_end();
          continue;
        }
        if (e == "else") {
          expect_block_end();
          s->else_body = body({"endif"});
          next();
        }
        expect_block_end();
        break;
      }
    } else if (kw == "for") {
      s->kind = Stmt::For;
      const bool paren = skip_op("(");
      s->targets.push_back(expect_name());
      while (skip_op(",")) {
        s->tuple_target = true;
        if (is_name("in") || is_op(")")) break;
        s->targets.push_back(expect_name());
      }
      if (paren) {
        expect_op(")");
        s->tuple_target = true;
      }
      if (!skip_name("in")) fail("expected 'in' in a for");
      s->expr = tuple(false, /*stop_at_recursive=*/true);
      if (skip_name("if")) s->filter = expression(true);
      if (is_name("recursive")) fail("recursive loops are not supported");
      expect_block_end();
      {
        LoopGuard g(loops_);
        s->body = body({"else", "endfor"});
      }
      if (cur().s == "else") {
        next();
        expect_block_end();
        s->else_body = body({"endfor"});
      }
      next();
      expect_block_end();
    } else if (kw == "set") {
      std::string n = expect_name();
      if (skip_op(".")) {
        s->ns_attr = true;
        s->targets = {n, expect_name()};
      } else {
        s->targets.push_back(n);
        while (skip_op(",")) {
          s->tuple_target = true;
          if (is_op("=")) break;
          s->targets.push_back(expect_name());
        }
      }
      if (skip_op("=")) {
        s->kind = Stmt::Set;
        s->expr = tuple(true);
        expect_block_end();
      } else {
        if (s->ns_attr || s->tuple_target) fail("a block set takes one name");
        if (is_op("|")) fail("filters on a block set are not supported");
        s->kind = Stmt::SetBlock;
        expect_block_end();
        s->body = body({"endset"});
        next();
        expect_block_end();
      }
    } else if (kw == "break" || kw == "continue") {
      if (loops_ == 0) fail("'" + kw + "' outside a loop");
      s->kind = kw == "break" ? Stmt::Break : Stmt::Continue;
      expect_block_end();
    } else if (kw == "generation") {  // Hugging Face's marker of assistant text
      s->kind = Stmt::Scope;
      expect_block_end();
      s->body = body({"endgeneration"});
      next();
      expect_block_end();
    } else {
      --pos_;
      fail("the statement '" + kw +
           "' is not supported (kvq's chat templates: if, for, set, break, continue, raw, generation)");
    }
    return s;
  }

  // Loop bodies count for break / continue.
  struct LoopGuard {
    int& n;
    explicit LoopGuard(int& n) : n(n) { ++n; }
    ~LoopGuard() { --n; }
  };

  ExprP tuple(bool with_cond, bool stop_at_recursive = false) {
    const int line = cur().line;
    std::vector<ExprP> items;
    bool comma = false;
    while (true) {
      if (!items.empty()) {
        if (!skip_op(",")) break;
        comma = true;
      }
      if (cur().t == Tok::VarEnd || cur().t == Tok::BlockEnd || is_op(")") || is_op("=") ||
          (stop_at_recursive && (is_name("if") || is_name("recursive"))))
        break;
      items.push_back(with_cond ? expression(true) : expression(false));
    }
    if (items.empty()) fail("expected an expression");
    if (!comma) return std::move(items[0]);
    auto e = std::make_unique<Expr>();
    e->op = Expr::TupleLit;
    e->line = line;
    e->a = std::move(items);
    return e;
  }

 public:
  int loops_ = 0;

 private:
  ExprP expression(bool with_cond) {
    Depth d(*this);
    ExprP e = or_expr();
    while (with_cond && is_name("if")) {
      next();
      auto c = node(Expr::Cond);
      ExprP test = or_expr();
      ExprP other;
      if (skip_name("else")) other = expression(true);
      c->a.push_back(std::move(e));
      c->a.push_back(std::move(test));
      c->a.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }
  // `a or b` / `a and b`: left-associative, `sub` the tighter level.
  ExprP logical(Expr::Op op, const char* word, ExprP (Parser::*sub)()) {
    ExprP l = (this->*sub)();
    while (is_name(word)) {
      auto n = node(op);
      next();
      n->a.push_back(std::move(l));
      n->a.push_back((this->*sub)());
      l = std::move(n);
    }
    return l;
  }
  ExprP or_expr() { return logical(Expr::Or, "or", &Parser::and_expr); }
  ExprP and_expr() { return logical(Expr::And, "and", &Parser::not_expr); }
  ExprP not_expr() {
    if (is_name("not")) {
      Depth d(*this);
      auto n = node(Expr::Not);
      next();
      n->a.push_back(not_expr());
      return n;
    }
    return compare();
  }
  ExprP compare() {
    ExprP first = math1();
    std::unique_ptr<Expr> c;
    while (true) {
      std::string op;
      if (cur().t == Tok::Op && (cur().s == "==" || cur().s == "!=" || cur().s == "<" || cur().s == "<=" ||
                                 cur().s == ">" || cur().s == ">=")) {
        op = cur().s;
        next();
      } else if (is_name("in")) {
        op = "in";
        next();
      } else if (is_name("not") && look().t == Tok::Name && look().s == "in") {
        op = "not in";
        next();
        next();
      } else {
        break;
      }
      if (!c) {
        c = node(Expr::Compare);
        c->a.push_back(std::move(first));
      }
      c->cmp.push_back(op);
      c->a.push_back(math1());
    }
    return c ? std::move(c) : std::move(first);
  }
  ExprP binary(ExprP l, const std::string& op, ExprP r) {
    auto n = node(Expr::Bin);
    n->name = op;
    n->a.push_back(std::move(l));
    n->a.push_back(std::move(r));
    return n;
  }
  ExprP math1() {
    ExprP l = concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = cur().s;
      next();
      l = binary(std::move(l), op, concat());
    }
    return l;
  }
  ExprP concat() {
    ExprP l = math2();
    while (is_op("~")) {
      next();
      l = binary(std::move(l), "~", math2());
    }
    return l;
  }
  ExprP math2() {
    ExprP l = power();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = cur().s;
      next();
      l = binary(std::move(l), op, power());
    }
    return l;
  }
  ExprP power() {
    ExprP l = unary(true);
    while (is_op("**")) {
      next();
      l = binary(std::move(l), "**", unary(true));
    }
    return l;
  }
  ExprP unary(bool with_filter) {
    Depth d(*this);
    ExprP e;
    if (is_op("-") || is_op("+")) {
      auto n = node(is_op("-") ? Expr::Neg : Expr::Pos);
      next();
      n->a.push_back(unary(false));
      e = std::move(n);
    } else {
      e = postfix(primary());
    }
    if (with_filter) e = filters(std::move(e));
    return e;
  }
  ExprP primary() {
    Depth d(*this);
    const Tok& tk = cur();
    if (tk.t == Tok::Name) {
      const std::string n = tk.s;
      if (n == "true" || n == "True" || n == "false" || n == "False") {
        auto e = node(Expr::Lit);
        e->lit = Value::boolean(n[0] == 't' || n[0] == 'T');
        next();
        return e;
      }
      if (n == "none" || n == "None") {
        auto e = node(Expr::Lit);
        e->lit = Value::none();
        next();
        return e;
      }
      auto e = node(Expr::Name);
      e->name = n;
      next();
      return e;
    }
    if (tk.t == Tok::Str) {
      auto e = node(Expr::Lit);
      std::string s = tk.s;
      next();
      while (cur().t == Tok::Str) {  // adjacent literals concatenate
        s += cur().s;
        next();
      }
      e->lit.k = K::Str;
      e->lit.s = std::make_shared<const std::string>(std::move(s));
      return e;
    }
    if (tk.t == Tok::Int || tk.t == Tok::Float) {
      auto e = node(Expr::Lit);
      e->lit = tk.t == Tok::Int ? Value::integer(tk.i) : Value::real(tk.f);
      next();
      return e;
    }
    if (is_op("(")) {
      next();
      if (skip_op(")")) {
        auto e = node(Expr::TupleLit);
        return e;
      }
      ExprP inner = tuple(true);
      expect_op(")");
      return inner;
    }
    if (is_op("[") || is_op("{")) {  // [a, b] or {k: v, ...}; a trailing comma is allowed
      const bool dict = is_op("{");
      const char* close = dict ? "}" : "]";
      auto e = node(dict ? Expr::DictLit : Expr::ListLit);
      next();
      while (!is_op(close)) {
        if (!e->a.empty()) {
          expect_op(",");
          if (is_op(close)) break;
        }
        e->a.push_back(expression(true));
        if (dict) {
          expect_op(":");
          e->a.push_back(expression(true));
        }
      }
      next();
      return e;
    }
    fail("expected a value");
  }
  void call_args(Expr& e) {
    expect_op("(");
    int n = 0;
    while (!is_op(")")) {
      if (n++ > 0) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*") || is_op("**")) fail("*args and **kwargs are not supported");
      if (cur().t == Tok::Name && look().t == Tok::Op && look().s == "=") {
        e.kwname.push_back(cur().s);
        next();
        next();
        e.kwval.push_back(expression(true));
      } else {
        if (!e.kwval.empty()) fail("a positional argument after a keyword argument");
        e.a.push_back(expression(true));
      }
    }
    next();
  }
  ExprP call_of(ExprP callee) {
    auto n = node(Expr::Call);
    n->a.push_back(std::move(callee));
    call_args(*n);
    return n;
  }
  ExprP postfix(ExprP e) {
    while (true) {
      if (is_op(".")) {
        next();
        auto n = node(Expr::Attr);
        if (cur().t == Tok::Name) {
          n->name = cur().s;
        } else if (cur().t == Tok::Int) {  // x.0: an item
          n->op = Expr::Item;
          auto k = node(Expr::Lit);
          k->lit = Value::integer(cur().i);
          n->a.push_back(std::move(e));
          n->a.push_back(std::move(k));
          next();
          e = std::move(n);
          continue;
        } else {
          fail("expected an attribute name after '.'");
        }
        next();
        n->a.push_back(std::move(e));
        e = std::move(n);
      } else if (is_op("[")) {
        next();
        e = subscript(std::move(e));
      } else if (is_op("(")) {
        e = call_of(std::move(e));
      } else {
        return e;
      }
    }
  }
  ExprP subscript(ExprP obj) {
    Depth d(*this);
    ExprP parts[3];
    int n = 0;
    bool is_slice = false;
    while (true) {
      if (is_op(":")) {
        is_slice = true;
        next();
        ++n;
        if (n > 2) fail("a slice takes at most three parts");
        continue;
      }
      if (is_op("]")) break;
      if (is_op(",")) fail("tuple subscripts are not supported");
      if (parts[n]) fail("expected ':' or ']'");
      parts[n] = expression(true);
    }
    next();
    if (!is_slice) {
      if (!parts[0]) fail("an empty subscript");
      auto e = node(Expr::Item);
      e->a.push_back(std::move(obj));
      e->a.push_back(std::move(parts[0]));
      return e;
    }
    auto e = node(Expr::Slice);
    e->a.push_back(std::move(obj));
    for (auto& p : parts) e->a.push_back(std::move(p));
    return e;
  }
  std::string dotted_name() {
    std::string n = expect_name();
    while (is_op(".") && look().t == Tok::Name) {
      next();
      n += "." + cur().s;
      next();
    }
    return n;
  }
  ExprP filters(ExprP e) {
    while (true) {
      if (is_op("|")) {
        next();
        auto n = node(Expr::Filter);
        n->name = dotted_name();
        if (!known(kFilters, n->name)) fail("the filter '" + n->name + "' is not supported");
        n->a.push_back(std::move(e));
        if (is_op("(")) call_args(*n);
        e = std::move(n);
      } else if (is_name("is")) {
        next();
        auto n = node(Expr::Test);
        n->negate = skip_name("not");
        n->name = dotted_name();
        if (!known(kTests, n->name)) fail("the test '" + n->name + "' is not supported");
        n->a.push_back(std::move(e));
        if (is_op("(")) {
          call_args(*n);
        } else if ((cur().t == Tok::Name || cur().t == Tok::Str || cur().t == Tok::Int || cur().t == Tok::Float ||
                    is_op("(") || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          if (is_name("is")) fail("'is' cannot follow a test's bare argument");
          n->a.push_back(postfix(primary()));
        }
        e = std::move(n);
      } else if (is_op("(")) {
        e = call_of(std::move(e));
      } else {
        return e;
      }
    }
  }

  std::vector<Tok> t_;
  size_t pos_ = 0;
  const std::string& what_;
  int max_depth_;
  int depth_ = 0;
};

// ---- renderer ------------------------------------------------------------

enum class Flow { Normal, Break, Continue };

class Renderer {
 public:
  Renderer(const std::string& what, const ChatTemplateLimits& lim) : what_(what), lim_(lim) {}

  std::string out;
  std::vector<std::unordered_map<std::string, Value>> frames{1};

  void run(const Body& b) { exec(b); }

  Value from_json(const nlohmann::ordered_json& j, int depth = 0) {
    if (depth > lim_.max_depth) fail(0, "the input nests deeper than " + std::to_string(lim_.max_depth));
    switch (j.type()) {
      case nlohmann::ordered_json::value_t::null: return Value::none();
      case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
      case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
      case nlohmann::ordered_json::value_t::number_unsigned: {
        const uint64_t u = j.get<uint64_t>();
        return u <= static_cast<uint64_t>(INT64_MAX) ? Value::integer(static_cast<int64_t>(u))
                                                      : Value::real(static_cast<double>(u));
      }
      case nlohmann::ordered_json::value_t::number_float: return Value::real(j.get<double>());
      case nlohmann::ordered_json::value_t::string: return make_str(j.get<std::string>());
      case nlohmann::ordered_json::value_t::array: {
        List l;
        for (const auto& x : j) l.push_back(from_json(x, depth + 1));
        return make_list(std::move(l));
      }
      case nlohmann::ordered_json::value_t::object: {
        auto d = std::make_shared<Dict>();
        for (auto it = j.begin(); it != j.end(); ++it) d->set(it.key(), from_json(it.value(), depth + 1));
        Value v;
        v.k = K::Dict;
        v.d = std::move(d);
        return v;
      }
      default: fail(0, "the input holds a value JSON cannot (binary)");
    }
  }

  Value make_str(std::string s) {
    charge(s.size());
    Value v;
    v.k = K::Str;
    v.s = std::make_shared<const std::string>(std::move(s));
    return v;
  }
  Value make_list(List l, bool tuple = false) {
    charge(l.size() * sizeof(Value));
    Value v;
    v.k = K::List;
    v.tuple = tuple;
    v.l = std::make_shared<const List>(std::move(l));
    return v;
  }
  Value make_func(const char* name) {
    Value v;
    v.k = K::Func;
    v.s = std::make_shared<const std::string>(name);
    return v;
  }

 private:
  [[noreturn]] void fail(int line, const std::string& msg) const {
    if (line > 0) Fail(what_, ": line ", line, ": ", msg);
    Fail(what_, ": ", msg);
  }
  void charge(uint64_t bytes) {
    work_ += bytes;
    if (work_ > lim_.max_work_bytes)
      Fail(what_, ": the render made more than ", lim_.max_work_bytes, " bytes of strings and lists");
  }
  void step(int line) {
    if (++steps_ > lim_.max_steps) fail(line, "the render took more than " + std::to_string(lim_.max_steps) + " steps");
  }
  void emit(const std::string& s) {
    if (out.size() + s.size() > lim_.max_output_bytes)
      Fail(what_, ": the rendered prompt is longer than ", lim_.max_output_bytes, " bytes");
    out += s;
  }
  std::string text(const Value& v) {
    if (v.k == K::Str) return *v.s;
    std::string s;
    to_text(s, v, false);
    charge(s.size());
    return s;
  }

  // ---- statements
  Flow exec(const Body& b) {
    for (const auto& s : b) {
      const Flow f = exec(*s);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  void assign(const Stmt& s, const std::string& name, Value v) {
    frames.back()[name] = std::move(v);
    (void)s;
  }

  void assign_targets(const Stmt& s, Value v) {
    if (!s.tuple_target) {
      assign(s, s.targets[0], std::move(v));
      return;
    }
    std::vector<Value> items = iterate(v, s.line);
    if (items.size() != s.targets.size())
      fail(s.line, "cannot unpack " + std::to_string(items.size()) + " values into " +
                       std::to_string(s.targets.size()) + " names");
    for (size_t i = 0; i < items.size(); ++i) assign(s, s.targets[i], std::move(items[i]));
  }

  Flow exec(const Stmt& s) {
    step(s.line);
    switch (s.kind) {
      case Stmt::Text: emit(s.text); return Flow::Normal;
      case Stmt::Output: emit(text(eval(*s.expr))); return Flow::Normal;
      case Stmt::If:
        for (const auto& [c, b] : s.branches)
          if (truthy(eval(*c))) return exec(b);
        return exec(s.else_body);
      case Stmt::Set: {
        Value v = eval(*s.expr);
        if (s.ns_attr) {
          const Value* ns = lookup(s.targets[0]);
          if (!ns || ns->k != K::Ns) fail(s.line, "'" + s.targets[0] + "' is not a namespace: cannot set its attribute");
          ns->d->set(s.targets[1], std::move(v));
        } else {
          assign_targets(s, std::move(v));
        }
        return Flow::Normal;
      }
      case Stmt::SetBlock: {
        std::string saved;
        saved.swap(out);
        const Flow f = exec(s.body);
        std::string made;
        made.swap(out);
        out.swap(saved);
        if (f != Flow::Normal) fail(s.line, "break or continue inside a block set");
        assign(s, s.targets[0], make_str(std::move(made)));
        return Flow::Normal;
      }
      case Stmt::Break: return Flow::Break;
      case Stmt::Continue: return Flow::Continue;
      case Stmt::Scope: return exec(s.body);
      case Stmt::For: return exec_for(s);
    }
    return Flow::Normal;
  }

  Flow exec_for(const Stmt& s) {
    const Value seq = eval(*s.expr);
    if (seq.k != K::Undef && seq.k != K::Str && seq.k != K::List && seq.k != K::Dict)
      fail(s.line, std::string("cannot loop over a value of type ") + type_name(seq));
    std::vector<Value> items = iterate(seq, s.line);
    if (s.filter) {
      std::vector<Value> kept;
      for (auto& it : items) {
        frames.emplace_back();
        assign_targets(s, it);
        const bool keep = truthy(eval(*s.filter));
        frames.pop_back();
        if (keep) kept.push_back(std::move(it));
      }
      items = std::move(kept);
    }
    if (items.empty()) return exec(s.else_body);
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      step(s.line);
      frames.emplace_back();
      auto loop = std::make_shared<Dict>();
      loop->items.reserve(11);
      loop->items.emplace_back("index", Value::integer(i + 1));
      loop->items.emplace_back("index0", Value::integer(i));
      loop->items.emplace_back("revindex", Value::integer(n - i));
      loop->items.emplace_back("revindex0", Value::integer(n - i - 1));
      loop->items.emplace_back("first", Value::boolean(i == 0));
      loop->items.emplace_back("last", Value::boolean(i == n - 1));
      loop->items.emplace_back("length", Value::integer(n));
      loop->items.emplace_back("depth", Value::integer(1));
      loop->items.emplace_back("depth0", Value::integer(0));
      if (i > 0) loop->items.emplace_back("previtem", items[static_cast<size_t>(i - 1)]);
      if (i + 1 < n) loop->items.emplace_back("nextitem", items[static_cast<size_t>(i + 1)]);
      Value lv;
      lv.k = K::Dict;
      lv.d = std::move(loop);
      frames.back()["loop"] = std::move(lv);
      assign_targets(s, items[static_cast<size_t>(i)]);
      const Flow f = exec(s.body);
      frames.pop_back();
      if (f == Flow::Break) break;
    }
    return Flow::Normal;
  }

  // ---- expressions
  const Value* lookup(const std::string& name) const {
    for (auto it = frames.rbegin(); it != frames.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return &f->second;
    }
    return nullptr;
  }

  [[noreturn]] void undefined_error(int line, const Value& v) const {
    fail(line, "'" + (v.s ? *v.s : std::string("value")) + "' is undefined");
  }

  std::vector<Value> iterate(const Value& v, int line) {
    std::vector<Value> out;
    switch (v.k) {
      case K::Undef: return out;
      case K::List: return *v.l;
      case K::Dict:
        for (const auto& [k, x] : v.d->items) out.push_back(make_str(k));
        return out;
      case K::Str: {
        const std::u32string u = decode(*v.s);
        charge(u.size() * sizeof(Value));
        for (char32_t c : u) {
          std::string one;
          append_utf8(one, c);
          out.push_back(make_str(std::move(one)));
        }
        return out;
      }
      default: fail(line, std::string("a value of type ") + type_name(v) + " is not iterable");
    }
  }

  int64_t index_arg(const Value& v, int line, const char* what) {
    if (!v.is_intlike()) fail(line, std::string(what) + " must be an integer, not " + type_name(v));
    return v.as_int();
  }

  Value attr(const Value& obj, const std::string& name, int line) {
    if (obj.k == K::Undef) fail(line, "'" + *obj.s + "' is undefined (reading its attribute '" + name + "')");
    if (obj.k == K::Dict || obj.k == K::Ns) {
      const Value* v = obj.d->find(name);
      if (v) return *v;
    }
    return Value::undef(name);
  }

  Value item(const Value& obj, const Value& key, int line) {
    if (obj.k == K::Undef) fail(line, "'" + *obj.s + "' is undefined (reading an item of it)");
    if (obj.k == K::Dict || obj.k == K::Ns) {
      if (key.k == K::Str) {
        const Value* v = obj.d->find(*key.s);
        if (v) return *v;
        return Value::undef(*key.s);
      }
      return Value::undef("item");
    }
    if ((obj.k == K::List || obj.k == K::Str) && key.is_intlike()) {
      int64_t i = key.as_int();
      if (obj.k == K::List) {
        const int64_t n = static_cast<int64_t>(obj.l->size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value::undef("index");
        return (*obj.l)[static_cast<size_t>(i)];
      }
      const std::u32string u = decode(*obj.s);
      const int64_t n = static_cast<int64_t>(u.size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::undef("index");
      std::string one;
      append_utf8(one, u[static_cast<size_t>(i)]);
      return make_str(std::move(one));
    }
    if (key.k == K::Str) return attr(obj, *key.s, line);
    return Value::undef("item");
  }

  Value slice(const Value& obj, const Expr& e) {
    const Value* bounds[3] = {nullptr, nullptr, nullptr};
    Value b[3];
    for (int k = 0; k < 3; ++k)
      if (e.a[static_cast<size_t>(k + 1)]) {
        b[k] = eval(*e.a[static_cast<size_t>(k + 1)]);
        if (b[k].k != K::None) bounds[k] = &b[k];
      }
    int64_t step_v = bounds[2] ? index_arg(*bounds[2], e.line, "a slice's step") : 1;
    if (step_v == 0) fail(e.line, "a slice's step cannot be zero");
    size_t n = 0;
    std::u32string u;
    if (obj.k == K::Str) {
      u = decode(*obj.s);
      n = u.size();
    } else if (obj.k == K::List) {
      n = obj.l->size();
    } else if (obj.k == K::Undef) {
      undefined_error(e.line, obj);
    } else {
      fail(e.line, std::string("cannot slice a value of type ") + type_name(obj));
    }
    const int64_t len = static_cast<int64_t>(n);
    auto norm = [&](const Value* v, int64_t dflt, bool is_stop) -> int64_t {
      if (!v) return dflt;
      int64_t x = index_arg(*v, e.line, "a slice's bound");
      if (x < 0) x += len;
      if (step_v > 0) return std::clamp<int64_t>(x, 0, len);
      (void)is_stop;
      return std::clamp<int64_t>(x, -1, len - 1);
    };
    const int64_t start = norm(bounds[0], step_v > 0 ? 0 : len - 1, false);
    const int64_t stop = norm(bounds[1], step_v > 0 ? len : -1, true);
    std::vector<size_t> idx;
    if (step_v > 0)
      for (int64_t i = start; i < stop; i += step_v) idx.push_back(static_cast<size_t>(i));
    else
      for (int64_t i = start; i > stop; i += step_v) idx.push_back(static_cast<size_t>(i));
    if (obj.k == K::Str) {
      std::u32string r;
      for (size_t i : idx) r.push_back(u[i]);
      return make_str(encode(r));
    }
    List l;
    for (size_t i : idx) l.push_back((*obj.l)[i]);
    return make_list(std::move(l), obj.tuple);
  }

  Value eval(const Expr& e) {
    step(e.line);
    switch (e.op) {
      case Expr::Lit: return e.lit;
      case Expr::Name: {
        const Value* v = lookup(e.name);
        return v ? *v : Value::undef(e.name);
      }
      case Expr::ListLit:
      case Expr::TupleLit: {
        List l;
        for (const auto& x : e.a) l.push_back(eval(*x));
        return make_list(std::move(l), e.op == Expr::TupleLit);
      }
      case Expr::DictLit: {
        auto d = std::make_shared<Dict>();
        for (size_t i = 0; i + 1 < e.a.size(); i += 2) {
          Value k = eval(*e.a[i]);
          if (k.k != K::Str) fail(e.line, "dict keys must be strings here");
          d->set(*k.s, eval(*e.a[i + 1]));
        }
        charge(d->items.size() * sizeof(Value));
        Value v;
        v.k = K::Dict;
        v.d = std::move(d);
        return v;
      }
      case Expr::Attr: return attr(eval(*e.a[0]), e.name, e.line);
      case Expr::Item: {
        const Value o = eval(*e.a[0]);
        return item(o, eval(*e.a[1]), e.line);
      }
      case Expr::Slice: return slice(eval(*e.a[0]), e);
      case Expr::Call: return call(e);
      case Expr::Filter: return filter(e);
      case Expr::Test: {
        const bool r = test(e);
        return Value::boolean(e.negate ? !r : r);
      }
      case Expr::Neg:
      case Expr::Pos: {
        const Value v = eval(*e.a[0]);
        if (!v.is_num()) fail(e.line, std::string("bad operand type for unary ") + (e.op == Expr::Neg ? "-" : "+") + ": " + type_name(v));
        if (e.op == Expr::Pos) return v.k == K::Float ? v : Value::integer(v.as_int());
        if (v.k == K::Float) return Value::real(-v.f);
        if (v.as_int() == INT64_MIN) fail(e.line, "integer overflow");
        return Value::integer(-v.as_int());
      }
      case Expr::Not: return Value::boolean(!truthy(eval(*e.a[0])));
      case Expr::And: {
        Value l = eval(*e.a[0]);
        return truthy(l) ? eval(*e.a[1]) : l;
      }
      case Expr::Or: {
        Value l = eval(*e.a[0]);
        return truthy(l) ? l : eval(*e.a[1]);
      }
      case Expr::Cond:
        if (truthy(eval(*e.a[1]))) return eval(*e.a[0]);
        return e.a[2] ? eval(*e.a[2]) : Value::undef("else");
      case Expr::Compare: {
        Value l = eval(*e.a[0]);
        for (size_t i = 0; i < e.cmp.size(); ++i) {
          Value r = eval(*e.a[i + 1]);
          if (!compare(l, e.cmp[i], r, e.line)) return Value::boolean(false);
          l = std::move(r);
        }
        return Value::boolean(true);
      }
      case Expr::Bin: return binop(e.name, eval(*e.a[0]), eval(*e.a[1]), e.line);
    }
    return Value();
  }

  bool contains(const Value& hay, const Value& needle, int line) {
    switch (hay.k) {
      case K::Undef: return false;
      case K::Str:
        if (needle.k != K::Str) fail(line, std::string("'in <string>' needs a string, not ") + type_name(needle));
        return hay.s->find(*needle.s) != std::string::npos;
      case K::List:
        for (const auto& x : *hay.l) {
          step(line);
          if (equal(x, needle)) return true;
        }
        return false;
      case K::Dict:
      case K::Ns: return needle.k == K::Str && hay.d->find(*needle.s) != nullptr;
      default: fail(line, std::string("'in' needs a container, not ") + type_name(hay));
    }
  }

  // Python's ordering: -1, 0, 1.
  int order(const Value& a, const Value& b, int line) {
    if (a.is_num() && b.is_num()) {
      if (a.k == K::Float || b.k == K::Float) {
        const double x = a.as_real(), y = b.as_real();
        return x < y ? -1 : x > y ? 1 : 0;
      }
      return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int() ? 1 : 0;
    }
    if (a.k == K::Str && b.k == K::Str) {
      const int c = a.s->compare(*b.s);
      return c < 0 ? -1 : c > 0 ? 1 : 0;
    }
    if (a.k == K::List && b.k == K::List) {
      const size_t n = std::min(a.l->size(), b.l->size());
      for (size_t i = 0; i < n; ++i) {
        step(line);
        if (!equal((*a.l)[i], (*b.l)[i])) return order((*a.l)[i], (*b.l)[i], line);
      }
      return a.l->size() < b.l->size() ? -1 : a.l->size() > b.l->size() ? 1 : 0;
    }
    fail(line, std::string("cannot order ") + type_name(a) + " and " + type_name(b));
  }

  bool compare(const Value& l, const std::string& op, const Value& r, int line) {
    if (op == "==") return equal(l, r);
    if (op == "!=") return !equal(l, r);
    if (op == "in") return contains(r, l, line);
    if (op == "not in") return !contains(r, l, line);
    const int c = order(l, r, line);
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;
  }

  Value checked_int(__int128 v, int line) {
    if (v > INT64_MAX || v < INT64_MIN) fail(line, "integer overflow");
    return Value::integer(static_cast<int64_t>(v));
  }

  Value repeat(const Value& seq, int64_t n, int line) {
    if (n < 0) n = 0;
    if (seq.k == K::Str) {
      const uint64_t total = static_cast<uint64_t>(seq.s->size()) * static_cast<uint64_t>(n);
      if (n > 0 && total / static_cast<uint64_t>(n) != seq.s->size()) fail(line, "a repeated string too long");
      charge(total);
      std::string r;
      r.reserve(total);
      for (int64_t i = 0; i < n; ++i) r += *seq.s;
      return make_str(std::move(r));
    }
    const uint64_t total = static_cast<uint64_t>(seq.l->size()) * static_cast<uint64_t>(n);
    charge(total * sizeof(Value));
    List l;
    for (int64_t i = 0; i < n; ++i) l.insert(l.end(), seq.l->begin(), seq.l->end());
    return make_list(std::move(l), seq.tuple);
  }

  Value binop(const std::string& op, const Value& l, const Value& r, int line) {
    if (op == "~") return make_str(text(l) + text(r));
    if (l.k == K::Undef) undefined_error(line, l);
    if (r.k == K::Undef) undefined_error(line, r);
    if (op == "+") {
      if (l.k == K::Str && r.k == K::Str) {
        charge(l.s->size() + r.s->size());
        return make_str(*l.s + *r.s);
      }
      if (l.k == K::List && r.k == K::List) {
        List x = *l.l;
        x.insert(x.end(), r.l->begin(), r.l->end());
        return make_list(std::move(x), l.tuple);
      }
    }
    if (op == "*") {
      if ((l.k == K::Str || l.k == K::List) && r.is_intlike()) return repeat(l, r.as_int(), line);
      if ((r.k == K::Str || r.k == K::List) && l.is_intlike()) return repeat(r, l.as_int(), line);
    }
    if (!l.is_num() || !r.is_num())
      fail(line, "unsupported operand types for " + op + ": " + type_name(l) + " and " + type_name(r));
    const bool real = l.k == K::Float || r.k == K::Float;
    if (op == "/") {
      if (r.as_real() == 0) fail(line, "division by zero");
      return Value::real(l.as_real() / r.as_real());
    }
    if (real) {
      const double x = l.as_real(), y = r.as_real();
      if (op == "+") return Value::real(x + y);
      if (op == "-") return Value::real(x - y);
      if (op == "*") return Value::real(x * y);
      if (op == "**") return Value::real(std::pow(x, y));
      if (y == 0) fail(line, "division by zero");
      if (op == "//") return Value::real(std::floor(x / y));
      double m = std::fmod(x, y);
      if (m != 0 && ((m < 0) != (y < 0))) m += y;
      return Value::real(m);
    }
    const __int128 x = l.as_int(), y = r.as_int();
    if (op == "+") return checked_int(x + y, line);
    if (op == "-") return checked_int(x - y, line);
    if (op == "*") return checked_int(x * y, line);
    if (op == "**") {
      if (y < 0) return Value::real(std::pow(static_cast<double>(x), static_cast<double>(y)));
      __int128 acc = 1;
      for (__int128 k = 0; k < y; ++k) {
        step(line);
        acc *= x;
        if (acc > INT64_MAX || acc < INT64_MIN) fail(line, "integer overflow");
        if (acc == 0 || acc == 1) break;
      }
      if (acc == 1 && x == -1 && (y % 2) == 1) acc = -1;
      return checked_int(acc, line);
    }
    if (y == 0) fail(line, "division by zero");
    __int128 q = x / y, m = x % y;
    if (m != 0 && ((m < 0) != (y < 0))) {
      q -= 1;
      m += y;
    }
    return checked_int(op == "//" ? q : m, line);
  }

  // ---- calls: globals and methods
  struct Args {
    std::vector<Value> pos;
    std::vector<std::pair<std::string, Value>> kw;
    const Value* get(size_t i, const char* name) const {
      if (i < pos.size()) return &pos[i];
      for (const auto& [k, v] : kw)
        if (k == name) return &v;
      return nullptr;
    }
  };
  Args args(const Expr& e, size_t first) {
    Args a;
    for (size_t i = first; i < e.a.size(); ++i) a.pos.push_back(eval(*e.a[i]));
    for (size_t i = 0; i < e.kwval.size(); ++i) a.kw.emplace_back(e.kwname[i], eval(*e.kwval[i]));
    return a;
  }
  const std::string& str_arg(const Value* v, int line, const char* what) {
    if (!v || v->k != K::Str) fail(line, std::string(what) + " must be a string");
    return *v->s;
  }

  Value call(const Expr& e) {
    const Expr& callee = *e.a[0];
    if (callee.op == Expr::Attr) {
      const Value obj = eval(*callee.a[0]);
      if (obj.k == K::Undef) undefined_error(e.line, obj);
      if (obj.k == K::Str) return str_method(*obj.s, callee.name, args(e, 1), e.line);
      if (obj.k == K::Dict) {
        const Args a = args(e, 1);
        if (callee.name == "items") {
          List l;
          for (const auto& [k, v] : obj.d->items) l.push_back(make_list({make_str(k), v}, true));
          return make_list(std::move(l));
        }
        if (callee.name == "keys" || callee.name == "values") {
          List l;
          for (const auto& [k, v] : obj.d->items) l.push_back(callee.name == "keys" ? make_str(k) : v);
          return make_list(std::move(l));
        }
        if (callee.name == "get") {
          const Value* k = a.get(0, "key");
          if (!k) fail(e.line, "get() takes a key");
          const Value* v = k->k == K::Str ? obj.d->find(*k->s) : nullptr;
          if (v) return *v;
          const Value* d = a.get(1, "default");
          return d ? *d : Value::none();
        }
      }
      fail(e.line, std::string("a ") + type_name(obj) + " has no method '" + callee.name + "' here");
    }
    const Value f = eval(callee);
    if (f.k == K::Undef) undefined_error(e.line, f);
    if (f.k != K::Func) fail(e.line, std::string("a value of type ") + type_name(f) + " is not callable");
    const Args a = args(e, 1);
    const std::string& n = *f.s;
    if (n == "raise_exception") {
      const Value* m = a.get(0, "message");
      Fail(what_, ": raise_exception: ", m ? text(*m) : std::string());
    }
    if (n == "namespace") {
      auto d = std::make_shared<Dict>();
      if (!a.pos.empty()) {
        if (a.pos.size() > 1 || a.pos[0].k != K::Dict) fail(e.line, "namespace() takes one dict or keywords");
        d->items = a.pos[0].d->items;
      }
      for (const auto& [k, v] : a.kw) d->set(k, v);
      Value v;
      v.k = K::Ns;
      v.d = std::move(d);
      return v;
    }
    if (n == "range") {
      if (a.pos.empty() || a.pos.size() > 3 || !a.kw.empty()) fail(e.line, "range() takes 1 to 3 integers");
      int64_t start = 0, stop = 0, st = 1;
      if (a.pos.size() == 1) {
        stop = index_arg(a.pos[0], e.line, "range()'s argument");
      } else {
        start = index_arg(a.pos[0], e.line, "range()'s argument");
        stop = index_arg(a.pos[1], e.line, "range()'s argument");
        if (a.pos.size() == 3) st = index_arg(a.pos[2], e.line, "range()'s step");
      }
      if (st == 0) fail(e.line, "range()'s step cannot be zero");
      const __int128 span = st > 0 ? (static_cast<__int128>(stop) - start + st - 1) / st
                                   : (static_cast<__int128>(start) - stop + (-st) - 1) / (-st);
      const __int128 cnt = span > 0 ? span : 0;
      if (cnt > static_cast<__int128>(lim_.max_work_bytes / sizeof(Value)))
        fail(e.line, "range() of more items than the render's bound");
      charge(static_cast<uint64_t>(cnt) * sizeof(Value));
      List l;
      l.reserve(static_cast<size_t>(cnt));
      for (__int128 k = 0; k < cnt; ++k) l.push_back(Value::integer(static_cast<int64_t>(start + k * st)));
      return make_list(std::move(l));
    }
    if (n == "strftime_now") {
      const std::string& fmt = str_arg(a.get(0, "format"), e.line, "strftime_now()'s format");
      const std::time_t t = std::time(nullptr);
      std::tm tm{};
      localtime_r(&t, &tm);
      char buf[256];
      const size_t len = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
      return make_str(std::string(buf, len));
    }
    fail(e.line, "unknown function " + n);
  }

  std::u32string chars_arg(const Value* v, int line) {
    if (!v || v->k == K::None) return {};
    if (v->k != K::Str) fail(line, "strip's argument must be a string or none");
    return decode(*v->s);
  }

  bool starts_or_ends(const std::string& s, const Value* v, bool end, int line) {
    if (!v) fail(line, "startswith / endswith takes a prefix");
    auto one = [&](const Value& p) {
      if (p.k != K::Str) fail(line, "startswith / endswith takes strings");
      const std::string& x = *p.s;
      if (x.size() > s.size()) return false;
      return end ? s.compare(s.size() - x.size(), x.size(), x) == 0 : s.compare(0, x.size(), x) == 0;
    };
    if (v->k == K::List) {
      for (const auto& p : *v->l)
        if (one(p)) return true;
      return false;
    }
    return one(*v);
  }

  Value split(const std::string& s, const Value* sepv, int64_t maxsplit, int line) {
    List parts;
    if (!sepv || sepv->k == K::None) {
      const std::u32string u = decode(s);
      size_t i = 0;
      int64_t done = 0;
      while (true) {
        while (i < u.size() && py_space(u[i])) ++i;
        if (i >= u.size()) break;
        if (maxsplit >= 0 && done >= maxsplit) {
          size_t e = u.size();
          while (e > i && py_space(u[e - 1])) --e;
          parts.push_back(make_str(encode(std::u32string_view(u).substr(i, e - i))));
          break;
        }
        size_t j = i;
        while (j < u.size() && !py_space(u[j])) ++j;
        parts.push_back(make_str(encode(std::u32string_view(u).substr(i, j - i))));
        ++done;
        i = j;
      }
      return make_list(std::move(parts));
    }
    const std::string& sep = str_arg(sepv, line, "split()'s separator");
    if (sep.empty()) fail(line, "split(): empty separator");
    size_t i = 0;
    int64_t done = 0;
    while (true) {
      step(line);
      const size_t j = (maxsplit >= 0 && done >= maxsplit) ? std::string::npos : s.find(sep, i);
      if (j == std::string::npos) {
        parts.push_back(make_str(s.substr(i)));
        break;
      }
      parts.push_back(make_str(s.substr(i, j - i)));
      ++done;
      i = j + sep.size();
    }
    return make_list(std::move(parts));
  }

  std::string replace(const std::string& s, const std::string& from, const std::string& to, int64_t count, int line) {
    std::string r;
    if (from.empty()) {  // Python: between every character
      const std::u32string u = decode(s);
      int64_t done = 0;
      for (size_t i = 0; i <= u.size(); ++i) {
        if (count < 0 || done < count) {
          r += to;
          ++done;
        }
        if (i < u.size()) append_utf8(r, u[i]);
        charge(to.size() + 4);
      }
      return r;
    }
    size_t i = 0;
    int64_t done = 0;
    while (true) {
      step(line);
      const size_t j = (count >= 0 && done >= count) ? std::string::npos : s.find(from, i);
      if (j == std::string::npos) {
        r.append(s, i, std::string::npos);
        break;
      }
      r.append(s, i, j - i);
      r += to;
      charge(to.size() + (j - i));
      ++done;
      i = j + from.size();
    }
    return r;
  }

  int64_t int_opt(const Value* v, int64_t dflt, int line, const char* what) {
    if (!v || v->k == K::None) return dflt;
    return index_arg(*v, line, what);
  }

  Value str_method(const std::string& s, const std::string& m, const Args& a, int line) {
    if (m == "strip" || m == "lstrip" || m == "rstrip") {
      const std::u32string c = chars_arg(a.get(0, "chars"), line);
      const bool has = a.get(0, "chars") && a.get(0, "chars")->k != K::None;
      return make_str(py_strip(s, has ? &c : nullptr, m != "rstrip", m != "lstrip"));
    }
    if (m == "split") return split(s, a.get(0, "sep"), int_opt(a.get(1, "maxsplit"), -1, line, "maxsplit"), line);
    if (m == "startswith") return Value::boolean(starts_or_ends(s, a.get(0, "prefix"), false, line));
    if (m == "endswith") return Value::boolean(starts_or_ends(s, a.get(0, "suffix"), true, line));
    if (m == "upper") return make_str(icu_case(s, 0));
    if (m == "lower") return make_str(icu_case(s, 1));
    if (m == "title") return make_str(py_title(s));
    if (m == "capitalize") return make_str(py_capitalize(s));
    if (m == "replace")
      return make_str(replace(s, str_arg(a.get(0, "old"), line, "replace()'s old"),
                              str_arg(a.get(1, "new"), line, "replace()'s new"),
                              int_opt(a.get(2, "count"), -1, line, "replace()'s count"), line));
    if (m == "find" || m == "count") {
      const std::string& sub = str_arg(a.get(0, "sub"), line, "find() / count()'s argument");
      if (m == "find") {
        const size_t p = s.find(sub);
        if (p == std::string::npos) return Value::integer(-1);
        return Value::integer(static_cast<int64_t>(decode(s.substr(0, p)).size()));
      }
      if (sub.empty()) return Value::integer(static_cast<int64_t>(decode(s).size()) + 1);
      int64_t n = 0;
      for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
      return Value::integer(n);
    }
    if (m == "join") {
      const Value* it = a.get(0, "iterable");
      if (!it) fail(line, "join() takes an iterable");
      std::string r;
      bool first = true;
      for (const auto& x : iterate(*it, line)) {
        if (x.k != K::Str) fail(line, "join() takes strings");
        if (!first) r += s;
        first = false;
        r += *x.s;
        charge(x.s->size() + s.size());
      }
      return make_str(std::move(r));
    }
    fail(line, "a string has no method '" + m + "' here");
  }

  // ---- filters
  Value lookup_path(const Value& obj, const std::string& path, int line) {
    Value v = obj;
    size_t i = 0;
    while (true) {
      const size_t j = path.find('.', i);
      const std::string part = path.substr(i, j == std::string::npos ? std::string::npos : j - i);
      if (v.k == K::Undef) return v;
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
      if (digits && v.k == K::List)
        v = item(v, Value::integer(std::stoll(part)), line);
      else
        v = item(v, make_str(part), line);
      if (j == std::string::npos) return v;
      i = j + 1;
    }
  }

  bool run_test(const std::string& name, const Value& v, const std::vector<Value>& targs, int line) {
    auto arg = [&](size_t i) -> const Value& {
      if (i >= targs.size()) fail(line, "the test '" + name + "' takes an argument");
      return targs[i];
    };
    if (name == "defined") return v.k != K::Undef;
    if (name == "undefined") return v.k == K::Undef;
    if (name == "none") return v.k == K::None;
    if (name == "string") return v.k == K::Str;
    if (name == "number") return v.is_num();
    if (name == "integer") return v.k == K::Int;
    if (name == "float") return v.k == K::Float;
    if (name == "boolean") return v.k == K::Bool;
    if (name == "mapping") return v.k == K::Dict;
    if (name == "iterable") return v.k == K::Str || v.k == K::List || v.k == K::Dict || v.k == K::Undef;
    if (name == "sequence") return v.k == K::Str || v.k == K::List || v.k == K::Dict || v.k == K::Undef;
    if (name == "callable") return v.k == K::Func || v.k == K::Undef;  // jinja2's Undefined is callable
    if (name == "true") return v.k == K::Bool && v.b;
    if (name == "false") return v.k == K::Bool && !v.b;
    if (name == "odd" || name == "even") {
      if (!v.is_intlike()) fail(line, "the test '" + name + "' needs an integer");
      const bool odd = (v.as_int() % 2) != 0;
      return name == "odd" ? odd : !odd;
    }
    if (name == "divisibleby") {
      const Value& n = arg(0);
      if (!v.is_intlike() || !n.is_intlike()) fail(line, "divisibleby needs integers");
      if (n.as_int() == 0) fail(line, "divisibleby 0");
      return v.as_int() % n.as_int() == 0;
    }
    if (name == "equalto" || name == "eq" || name == "==") return equal(v, arg(0));
    if (name == "ne" || name == "!=") return !equal(v, arg(0));
    if (name == "sameas") {
      const Value& o = arg(0);
      if (v.k != o.k) return false;
      if (v.k == K::None || v.k == K::Undef) return true;
      if (v.k == K::Bool) return v.b == o.b;
      return equal(v, o) && (v.s == o.s && v.l == o.l && v.d == o.d);
    }
    if (name == "lt" || name == "<") return order(v, arg(0), line) < 0;
    if (name == "le" || name == "<=") return order(v, arg(0), line) <= 0;
    if (name == "gt" || name == ">") return order(v, arg(0), line) > 0;
    if (name == "ge" || name == ">=") return order(v, arg(0), line) >= 0;
    if (name == "in") return contains(arg(0), v, line);
    if (name == "lower" || name == "upper") {
      if (v.k != K::Str) return false;
      bool any_cased = false;
      for (char32_t c : decode(*v.s)) {
        const UChar32 u = static_cast<UChar32>(c);
        if (u_isupper(u) || u_istitle(u)) {
          if (name == "lower") return false;
          any_cased = true;
        } else if (u_islower(u)) {
          if (name == "upper") return false;
          any_cased = true;
        }
      }
      return any_cased;
    }
    fail(line, "unknown test " + name);
  }

  bool test(const Expr& e) {
    const Value v = eval(*e.a[0]);
    std::vector<Value> targs;
    for (size_t i = 1; i < e.a.size(); ++i) targs.push_back(eval(*e.a[i]));
    return run_test(e.name, v, targs, e.line);
  }

  // ---- tojson (Hugging Face's: json.dumps, ensure_ascii=False)
  void json(std::string& out, const Value& v, int indent, int level, int line) {
    step(line);
    if (level > lim_.max_depth) fail(line, "tojson nests too deep");
    auto nl = [&](int lv) {
      if (indent < 0) return;
      out.push_back('\n');
      out.append(static_cast<size_t>(indent) * static_cast<size_t>(lv), ' ');
    };
    switch (v.k) {
      case K::None: out += "null"; return;
      case K::Bool: out += v.b ? "true" : "false"; return;
      case K::Int: out += std::to_string(v.i); return;
      case K::Float:
        if (std::isnan(v.f))
          out += "NaN";
        else if (std::isinf(v.f))
          out += v.f < 0 ? "-Infinity" : "Infinity";
        else
          out += py_float(v.f);
        return;
      case K::Str: json_str(out, *v.s); return;
      case K::List:
        if (v.l->empty()) {
          out += "[]";
          return;
        }
        out.push_back('[');
        for (size_t i = 0; i < v.l->size(); ++i) {
          if (i) out += indent < 0 ? ", " : ",";
          nl(level + 1);
          json(out, (*v.l)[i], indent, level + 1, line);
        }
        nl(level);
        out.push_back(']');
        return;
      case K::Dict: {
        if (v.d->items.empty()) {
          out += "{}";
          return;
        }
        out.push_back('{');
        bool first = true;
        for (const auto& [k, x] : v.d->items) {
          if (!first) out += indent < 0 ? ", " : ",";
          first = false;
          nl(level + 1);
          json_str(out, k);
          out += ": ";
          json(out, x, indent, level + 1, line);
        }
        nl(level);
        out.push_back('}');
        return;
      }
      default: fail(line, std::string("tojson: a value of type ") + type_name(v) + " is not JSON serializable");
    }
  }
  static void json_str(std::string& out, const std::string& s) {
    out.push_back('"');
    for (char c : s) {
      const auto u = static_cast<unsigned char>(c);
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        default:
          if (u < 0x20) {
            char b[8];
            std::snprintf(b, sizeof(b), "\\u%04x", u);
            out += b;
          } else {
            out.push_back(c);
          }
      }
    }
    out.push_back('"');
  }

  // Sort / unique key: strings compared case-insensitively unless asked.
  Value sort_key(const Value& v, bool case_sensitive) {
    if (!case_sensitive && v.k == K::Str) return make_str(icu_case(*v.s, 1));
    return v;
  }

  Value filter(const Expr& e) {
    const Value v = eval(*e.a[0]);
    const Args a = args(e, 1);
    const std::string& n = e.name;
    const int line = e.line;
    auto flag = [&](size_t i, const char* name) {
      const Value* x = a.get(i, name);
      return x && truthy(*x);
    };
    if (n == "safe") return v;
    if (n == "trim") {
      const Value* c = a.get(0, "chars");
      const std::u32string cs = chars_arg(c, line);
      return make_str(py_strip(text(v), c && c->k != K::None ? &cs : nullptr, true, true));
    }
    if (n == "length" || n == "count") {
      switch (v.k) {
        case K::Undef: return Value::integer(0);
        case K::Str: return Value::integer(static_cast<int64_t>(decode(*v.s).size()));
        case K::List: return Value::integer(static_cast<int64_t>(v.l->size()));
        case K::Dict:
        case K::Ns: return Value::integer(static_cast<int64_t>(v.d->items.size()));
        default: fail(line, std::string("a value of type ") + type_name(v) + " has no length");
      }
    }
    if (n == "first" || n == "last") {
      std::vector<Value> items = iterate(v, line);
      if (items.empty()) return Value::undef(n);
      return n == "first" ? items.front() : items.back();
    }
    if (n == "join") {
      const Value* sep = a.get(0, "d");
      const Value* at = a.get(1, "attribute");
      const std::string d = sep ? text(*sep) : std::string();
      std::string r;
      bool first = true;
      for (const auto& x : iterate(v, line)) {
        step(line);
        if (!first) r += d;
        first = false;
        r += text(at && at->k != K::None ? lookup_path(x, text(*at), line) : x);
        charge(d.size());
      }
      return make_str(std::move(r));
    }
    if (n == "default" || n == "d") {
      const bool use = v.k == K::Undef || (flag(1, "boolean") && !truthy(v));
      if (!use) return v;
      const Value* d = a.get(0, "default_value");
      return d ? *d : make_str("");
    }
    if (n == "upper" || n == "lower") return make_str(icu_case(text(v), n == "upper" ? 0 : 1));
    if (n == "title") return make_str(jinja_title(text(v)));
    if (n == "capitalize") return make_str(py_capitalize(text(v)));
    if (n == "string") return v.k == K::Str ? v : make_str(text(v));
    if (n == "replace")
      return make_str(replace(text(v), text(*req(a, 0, "old", line)), text(*req(a, 1, "new", line)),
                              int_opt(a.get(2, "count"), -1, line, "replace's count"), line));
    if (n == "int" || n == "float") return to_number(v, n == "int", a, line);
    if (n == "abs") {
      if (!v.is_num()) fail(line, std::string("abs of a value of type ") + type_name(v));
      if (v.k == K::Float) return Value::real(std::fabs(v.f));
      if (v.as_int() == INT64_MIN) fail(line, "integer overflow");
      return Value::integer(std::llabs(v.as_int()));
    }
    if (n == "list") return make_list(iterate(v, line));
    if (n == "reverse") {
      if (v.k == K::Str) {
        std::u32string u = decode(*v.s);
        std::reverse(u.begin(), u.end());
        return make_str(encode(u));
      }
      std::vector<Value> items = iterate(v, line);
      std::reverse(items.begin(), items.end());
      return make_list(std::move(items));
    }
    if (n == "tojson") {
      const Value* ind = a.get(0, "indent");
      const int indent = ind && ind->k != K::None ? static_cast<int>(std::clamp<int64_t>(index_arg(*ind, line, "tojson's indent"), 0, 64)) : -1;
      std::string s;
      json(s, v, indent, 0, line);
      return make_str(std::move(s));
    }
    if (n == "items") {
      if (v.k == K::Undef) return make_list({});
      if (v.k != K::Dict && v.k != K::Ns) fail(line, std::string("items of a value of type ") + type_name(v));
      List l;
      for (const auto& [k, x] : v.d->items) l.push_back(make_list({make_str(k), x}, true));
      return make_list(std::move(l));
    }
    if (n == "selectattr" || n == "rejectattr" || n == "select" || n == "reject") {
      const bool by_attr = n == "selectattr" || n == "rejectattr";
      const bool keep_if = n == "selectattr" || n == "select";
      size_t ti = 0;
      std::string attr_path;
      if (by_attr) {
        attr_path = text(*req(a, 0, "attribute", line));
        ti = 1;
      }
      std::string tname;
      std::vector<Value> targs;
      if (a.pos.size() > ti) {
        tname = text(a.pos[ti]);
        if (!known(kTests, tname)) fail(line, "the test '" + tname + "' is not supported");
        targs.assign(a.pos.begin() + static_cast<std::ptrdiff_t>(ti + 1), a.pos.end());
      }
      List out;
      for (const auto& x : iterate(v, line)) {
        step(line);
        const Value subject = by_attr ? lookup_path(x, attr_path, line) : x;
        const bool r = tname.empty() ? truthy(subject) : run_test(tname, subject, targs, line);
        if (r == keep_if) out.push_back(x);
      }
      return make_list(std::move(out));
    }
    if (n == "map") {
      const Value* at = nullptr;
      for (const auto& [k, x] : a.kw)
        if (k == "attribute") at = &x;
      List out;
      if (at) {
        const std::string path = text(*at);
        const Value* dflt = nullptr;
        for (const auto& [k, x] : a.kw)
          if (k == "default") dflt = &x;
        for (const auto& x : iterate(v, line)) {
          step(line);
          Value r = lookup_path(x, path, line);
          if (r.k == K::Undef && dflt) r = *dflt;
          out.push_back(std::move(r));
        }
        return make_list(std::move(out));
      }
      if (a.pos.empty()) fail(line, "map takes a filter name or attribute=");
      const std::string fname = text(a.pos[0]);
      static const char* const simple[] = {"trim", "upper", "lower", "title", "capitalize", "string",
                                           "length", "count", "first", "last", "tojson", "list", "int",
                                           "float", "abs", "reverse", "safe"};
      if (!known(simple, fname)) fail(line, "map('" + fname + "') is not supported");
      for (const auto& x : iterate(v, line)) {
        step(line);
        Expr sub;
        sub.op = Expr::Filter;
        sub.line = line;
        sub.name = fname;
        auto lit = std::make_unique<Expr>();
        lit->op = Expr::Lit;
        lit->lit = x;
        sub.a.push_back(std::move(lit));
        out.push_back(filter(sub));
      }
      return make_list(std::move(out));
    }
    if (n == "unique" || n == "sort" || n == "min" || n == "max") {
      const bool cs = n == "unique" ? flag(0, "case_sensitive") : n == "sort" ? flag(1, "case_sensitive") : flag(0, "case_sensitive");
      const Value* at = n == "unique" ? a.get(1, "attribute") : n == "sort" ? a.get(2, "attribute") : a.get(1, "attribute");
      const std::string path = at && at->k != K::None ? text(*at) : "";
      std::vector<Value> items = iterate(v, line);
      std::vector<Value> keys;
      for (const auto& x : items) keys.push_back(sort_key(path.empty() ? x : lookup_path(x, path, line), cs));
      if (n == "unique") {
        List out;
        std::vector<Value> seen;
        for (size_t i = 0; i < items.size(); ++i) {
          bool dup = false;
          for (const auto& s : seen) {
            step(line);
            if (equal(s, keys[i])) {
              dup = true;
              break;
            }
          }
          if (!dup) {
            seen.push_back(keys[i]);
            out.push_back(items[i]);
          }
        }
        return make_list(std::move(out));
      }
      std::vector<size_t> idx(items.size());
      for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
      if (n == "sort") {
        const bool rev = flag(0, "reverse");
        std::stable_sort(idx.begin(), idx.end(), [&](size_t x, size_t y) {
          step(line);
          return rev ? order(keys[y], keys[x], line) < 0 : order(keys[x], keys[y], line) < 0;
        });
        List out;
        for (size_t i : idx) out.push_back(items[i]);
        return make_list(std::move(out));
      }
      if (items.empty()) return Value::undef(n);
      size_t best = 0;
      for (size_t i = 1; i < items.size(); ++i) {
        const int c = order(keys[i], keys[best], line);
        if (n == "min" ? c < 0 : c > 0) best = i;
      }
      return items[best];
    }
    if (n == "sum") {
      Value acc = a.get(1, "start") ? *a.get(1, "start") : Value::integer(0);
      const Value* at = a.get(0, "attribute");
      for (const auto& x : iterate(v, line)) acc = binop("+", acc, at ? lookup_path(x, text(*at), line) : x, line);
      return acc;
    }
    fail(line, "unknown filter " + n);
  }

  const Value* req(const Args& a, size_t i, const char* name, int line) {
    const Value* v = a.get(i, name);
    if (!v) fail(line, std::string("missing argument '") + name + "'");
    return v;
  }

  Value to_number(const Value& v, bool integer, const Args& a, [[maybe_unused]] int line) {
    const Value* dv = a.get(0, "default");
    const Value dflt = dv ? *dv : integer ? Value::integer(0) : Value::real(0.0);
    if (v.is_num()) {
      if (!integer) return Value::real(v.as_real());
      if (v.k != K::Float) return Value::integer(v.as_int());
      if (!std::isfinite(v.f) || std::fabs(v.f) >= 9.2e18) return dflt;
      return Value::integer(static_cast<int64_t>(v.f));
    }
    if (v.k != K::Str) return dflt;
    std::string s = py_strip(*v.s, nullptr, true, true);
    s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
    if (integer) {
      int64_t x = 0;
      const char* b = s.data() + (!s.empty() && s[0] == '+' ? 1 : 0);
      const auto r = std::from_chars(b, s.data() + s.size(), x);
      if (!s.empty() && r.ec == std::errc() && r.ptr == s.data() + s.size()) return Value::integer(x);
    }
    double d = 0;
    const char* b = s.data() + (!s.empty() && s[0] == '+' ? 1 : 0);
    const auto r = std::from_chars(b, s.data() + s.size(), d);
    if (s.empty() || r.ec != std::errc() || r.ptr != s.data() + s.size()) return dflt;
    if (!integer) return Value::real(d);
    if (!std::isfinite(d) || std::fabs(d) >= 9.2e18) return dflt;
    return Value::integer(static_cast<int64_t>(d));
  }

  const std::string& what_;
  const ChatTemplateLimits& lim_;
  uint64_t steps_ = 0, work_ = 0;
};

}  // namespace

struct ChatTemplate::Impl {
  Body body;
  ChatTemplateLimits limits;
};

ChatTemplate::ChatTemplate(const std::string& source, std::string what, ChatTemplateLimits limits)
    : impl_(std::make_unique<Impl>()), what_(std::move(what)) {
  if (limits.max_depth < 1 || limits.max_steps < 1 || limits.max_work_bytes < 1 || limits.max_output_bytes < 1)
    Fail(what_, ": limits must be positive");
  if (source.empty()) Fail(what_, ": the chat template is empty");
  if (source.size() > limits.max_work_bytes) Fail(what_, ": the chat template is longer than ", limits.max_work_bytes, " bytes");
  if (!valid_utf8(source)) Fail(what_, ": the chat template is not valid UTF-8");
  impl_->limits = limits;
  // Tokens bound the tree: at most one node per token or so.
  const int max_tokens = static_cast<int>(std::min<uint64_t>(limits.max_steps, 1u << 22));
  Lexer lex(source, what_, max_tokens);
  Parser p(lex.run(), what_, limits.max_depth);
  impl_->body = p.parse_template();
}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

std::string ChatTemplate::render(const ChatTemplateInput& in) const {
  if (!in.messages.is_array()) Fail(what_, ": messages must be an array");
  if (!in.extra.is_object()) Fail(what_, ": the extra variables must be an object");
  Renderer r(what_, impl_->limits);
  auto& g = r.frames[0];
  for (auto it = in.extra.begin(); it != in.extra.end(); ++it) g[it.key()] = r.from_json(it.value());
  g["messages"] = r.from_json(in.messages);
  g["add_generation_prompt"] = Value::boolean(in.add_generation_prompt);
  g["bos_token"] = r.make_str(in.bos_token);
  g["eos_token"] = r.make_str(in.eos_token);
  for (const char* f : {"raise_exception", "namespace", "range", "strftime_now"}) g[f] = r.make_func(f);
  r.run(impl_->body);
  return std::move(r.out);
}

// Built-in templates: the text each family's models ship (Hugging Face's
// tokenizer_config.json), for `--chat-template NAME` and GGUFs without one.
namespace {
struct Builtin {
  const char* name;
  const char* source;
};
const Builtin kBuiltins[] = {
    // meta-llama/Meta-Llama-3-8B-Instruct
    {"llama3",
     R"({% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>

'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>

' }}{% endif %})"},
    // ChatML (teknium/OpenHermes-2.5-Mistral-7B; Qwen's turns)
    {"chatml",
     R"({% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %})"},
    // mistralai/Mistral-7B-Instruct-v0.2
    {"mistral",
     R"({{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %})"},
    // google/gemma-7b-it
    {"gemma",
     R"({{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %})"},
    // microsoft/Phi-3-mini-4k-instruct
    {"phi3",
     R"({{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %})"},
    // meta-llama/Llama-2-7b-chat-hf
    {"llama2",
     R"({% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %})"},
};
}  // namespace

const char* ChatTemplate::builtin(const std::string& name) {
  for (const auto& b : kBuiltins)
    if (name == b.name) return b.source;
  return nullptr;
}

std::vector<std::string> ChatTemplate::builtin_names() {
  std::vector<std::string> out;
  for (const auto& b : kBuiltins) out.emplace_back(b.name);
  return out;
}

std::string ChatTemplate::family(const std::string& src) {
  auto has = [&](const char* s) { return src.find(s) != std::string::npos; };
  if (has("<|im_start|>")) return "chatml";
  if (has("<|start_header_id|>") && has("<|end_header_id|>")) return "llama3";
  if (has("<start_of_turn>")) return "gemma";
  if (has("<|assistant|>") && has("<|end|>")) return "phi3";
  if (has("[INST]")) return has("<<SYS>>") ? "llama2" : "mistral";
  return "";
}

std::string ChatTemplate::end_of_turn(const std::string& family) {
  if (family == "llama3") return "<|eot_id|>";
  if (family == "chatml") return "<|im_end|>";
  if (family == "gemma") return "<end_of_turn>";
  if (family == "phi3") return "<|end|>";
  return "";
}

std::string ChatFormat::render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                               const nlohmann::ordered_json& extra) const {
  KVQ_CHECK_ARG(tmpl != nullptr, problem);
  ChatTemplateInput in;
  in.messages = messages;
  in.add_generation_prompt = add_generation_prompt;
  in.bos_token = bos_text;
  in.eos_token = eos_text;
  in.extra = extra;
  return tmpl->render(in);
}

std::vector<int> ChatFormat::prompt_ids(const Tokenizer& tok, const std::string& text) const {
  const bool leading_bos = tok.has_bos() && !bos_text.empty() && text.compare(0, bos_text.size(), bos_text) == 0;
  std::vector<int> ids = tok.encode(leading_bos ? text.substr(bos_text.size()) : text, /*bos=*/true);
  if (leading_bos && (ids.empty() || ids.front() != tok.bos_id())) ids.insert(ids.begin(), tok.bos_id());
  return ids;
}

namespace {
// A special token's text as a template writes it: a byte-level piece is its
// text already (control tokens are ASCII), a sentencepiece one may carry
// llama2.c's newlines ("\n<s>\n").
std::string token_text(const Tokenizer& tok, int id) {
  if (id < 0 || id >= tok.vocab_size()) return "";
  return py_strip(tok.piece(id), nullptr, true, true);
}
}  // namespace

ChatFormat chat_format(const Tokenizer* tok, const std::string& model_template, const std::string& spec,
                       const std::string& option, bool probe) {
  ChatFormat f;
  std::string names;
  for (const auto& n : ChatTemplate::builtin_names()) names += (names.empty() ? "" : ", ") + n;
  const std::string fallback = "start with " + option + " NAME (" + names +
                               ") or FILE, or use /v1/completions with a prompt you format";
  if (spec.empty()) {
    if (model_template.empty()) {
      f.problem = "this model has no chat template (tokenizer.chat_template): " + fallback;
      return f;
    }
    f.origin = "the GGUF's tokenizer.chat_template";
    f.source = model_template;
  } else if (const char* b = ChatTemplate::builtin(spec)) {
    f.origin = "built-in " + spec;
    f.source = b;
  } else {
    const std::vector<uint8_t> bytes = read_file_whole(spec, 16u << 20, option.c_str());
    std::string text(bytes.begin(), bytes.end());
    f.origin = option + " " + spec;
    f.source = text;
    const size_t first = text.find_first_not_of(" \t\r\n");
    if (first != std::string::npos && text[first] == '{' && text.compare(first, 2, "{{") != 0 &&
        text.compare(first, 2, "{%") != 0 && text.compare(first, 2, "{#") != 0) {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(text);
      } catch (const nlohmann::json::exception& e) {
        Fail(option, " '", spec, "': neither a template nor JSON (", e.what(), ")");
      }
      const auto it = j.find("chat_template");
      if (it == j.end()) Fail(option, " '", spec, "': a JSON file without \"chat_template\"");
      if (it->is_string()) {
        f.source = it->get<std::string>();
      } else if (it->is_array()) {
        f.source.clear();
        for (const auto& t : *it)
          if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string())
            f.source = t["template"].get<std::string>();
        if (f.source.empty()) Fail(option, " '", spec, "': \"chat_template\" holds no template named \"default\"");
      } else {
        Fail(option, " '", spec, "': \"chat_template\" must be a string or a list of {name, template}");
      }
      f.origin = option + " " + spec + " (chat_template)";
    }
  }
  f.family = ChatTemplate::family(f.source);
  f.end_of_turn = ChatTemplate::end_of_turn(f.family);
  if (tok != nullptr) {
    if (tok->has_bos()) f.bos_text = token_text(*tok, tok->bos_id());
    f.eos_text = token_text(*tok, tok->eos_id());
    if (!f.end_of_turn.empty()) {
      const std::vector<int> ids = tok->encode(f.end_of_turn, /*bos=*/false);
      if (ids.size() == 1) f.end_of_turn_id = ids[0];
    }
  }
  try {
    auto t = std::make_shared<ChatTemplate>(f.source, f.origin);
    ChatTemplateInput in;
    in.messages = nlohmann::ordered_json::array({{{"role", "user"}, {"content", "Hello"}}});
    in.bos_token = f.bos_text;
    in.eos_token = f.eos_text;
    if (probe) t->render(in);
    f.tmpl = std::move(t);
  } catch (const Error& e) {
    if (!spec.empty()) Fail(e.what(), " (the built-in templates: ", names, ")");
    f.problem = std::string("this model's chat template cannot be rendered by kvq (") + e.what() + "): " + fallback;
  }
  return f;
}

}  // namespace kvq::model
