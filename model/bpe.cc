// Byte-level BPE (model/bpe.h): PCRE2 for the pre-tokenizers' expressions,
// ICU for qwen2's NFC.
#include "model/bpe.h"

#include <algorithm>
#include <queue>
#include <utility>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/utf8.h>

#include "kvq/error.h"

namespace kvq::model {

namespace {

// Hugging Face's (tokenizer.json) expressions; PCRE2 with UTF and UCP.
constexpr const char* kLlama3 =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kQwen2 =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kGpt2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
constexpr const char* kDigit = "\\p{N}";

// GPT-2's bytes_to_unicode: printable Latin-1 bytes keep their code point,
// the other 68 take 256, 257, ... in byte order.
int ByteChar(int b) {
  auto kept = [](int x) { return (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255); };
  if (kept(b)) return b;
  int n = 0;
  for (int x = 0; x < b; ++x) n += kept(x) ? 0 : 1;
  return 256 + n;
}

std::string Utf8(int cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

struct Code {
  pcre2_code* re = nullptr;
  explicit Code(const char* pattern) {
    int err = 0;
    PCRE2_SIZE off = 0;
    re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED,
                       PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off, nullptr);
    KVQ_ASSERT(re != nullptr);
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  // the interpreter when JIT is unavailable
  }
  ~Code() { pcre2_code_free(re); }
  Code(const Code&) = delete;
  Code& operator=(const Code&) = delete;
};

// Calls word(begin, end, matched) for each match of `re` in s and for each
// run of bytes between matches (matched = false).
template <class F>
void Split(const Code& re, std::string_view s, F&& word) {
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(re.re, nullptr);
  const auto* subj = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t at = 0;
  while (at < s.size()) {
    int rc = pcre2_match(re.re, subj, s.size(), at, 0, md, nullptr);
    // JIT's stack exhausted (a huge run): the interpreter; if that too gives up, the rest is one word.
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) rc = pcre2_match(re.re, subj, s.size(), at, PCRE2_NO_JIT, md, nullptr);
    if (rc < 0) {
      word(at, s.size(), false);
      break;
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    if (ov[0] > at) word(at, ov[0], false);
    if (ov[1] <= ov[0]) {  // never: no alternative matches empty; guard against a loop
      word(ov[0], s.size(), false);
      break;
    }
    word(ov[0], ov[1], true);
    at = ov[1];
  }
  pcre2_match_data_free(md);
}

}  // namespace

struct ByteLevelBpe::Regexes {
  Code main, digit;
  explicit Regexes(Pre p)
      : main(p == Pre::kLlama3 ? kLlama3 : p == Pre::kQwen2 ? kQwen2 : kGpt2), digit(kDigit) {}
};

namespace {
// tokenizer.ggml.pre's names, in the order of ByteLevelBpe::Pre.
constexpr const char* kPreNames[] = {"llama-bpe", "qwen2", "smollm", "gpt-2"};
}  // namespace

std::optional<ByteLevelBpe::Pre> ByteLevelBpe::parse_pre(const std::string& name) {
  for (int i = 0; i < 4; ++i) {
    if (name == kPreNames[i]) return static_cast<Pre>(i);
  }
  return std::nullopt;
}

const char* ByteLevelBpe::pre_name(Pre p) { return kPreNames[static_cast<int>(p)]; }

ByteLevelBpe::ByteLevelBpe(std::vector<std::string> tokens, const std::vector<int64_t>& types,
                           const std::vector<std::string>& merges, Pre pre, const std::string& what)
    : tokens_(std::move(tokens)), pre_(pre) {
  if (tokens_.empty() || tokens_.size() > (1u << 24)) Fail(what, ": ", tokens_.size(), " tokens, expected 1..2^24");
  if (!types.empty() && types.size() != tokens_.size()) {
    Fail(what, ": ", types.size(), " token types for ", tokens_.size(), " tokens");
  }
  control_.assign(tokens_.size(), false);
  std::fill(std::begin(char_byte_), std::end(char_byte_), int16_t{-1});
  ids_.reserve(tokens_.size());
  for (size_t i = 0; i < tokens_.size(); ++i) {
    ids_.emplace(tokens_[i], static_cast<int>(i));  // the first id of a duplicate wins, as in llama.cpp
    const int64_t t = types.empty() ? 1 : types[i];
    if ((t == 3 || t == 4) && !tokens_[i].empty()) {
      int node = 0;
      for (const char ch : tokens_[i]) {
        const auto c = static_cast<unsigned char>(ch);
        auto& next = added_[static_cast<size_t>(node)].next;
        auto it = std::lower_bound(next.begin(), next.end(), c, [](const auto& e, unsigned char v) { return e.first < v; });
        if (it == next.end() || it->first != c) {
          it = next.insert(it, {c, static_cast<int>(added_.size())});
          const int child = it->second;
          added_.emplace_back();  // invalidates `next`, not `child`
          node = child;
        } else {
          node = it->second;
        }
      }
      if (added_[static_cast<size_t>(node)].id < 0) added_[static_cast<size_t>(node)].id = static_cast<int>(i);
      control_[i] = t == 3;
    }
  }
  for (int b = 0; b < 256; ++b) {
    const int cp = ByteChar(b);
    char_byte_[cp] = static_cast<int16_t>(b);
    byte_chars_[b] = Utf8(cp);
    const auto it = ids_.find(byte_chars_[b]);
    if (it == ids_.end()) Fail(what, ": byte ", b, "'s character U+", cp, " is not a token (not a byte-level vocabulary)");
    byte_id_[b] = it->second;
  }
  merges_.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const std::string& m = merges[r];
    const size_t sp = m.find(' ', 1);
    if (sp == std::string::npos || sp + 1 >= m.size()) Fail(what, ": merge ", r, " is not \"left right\"");
    const std::string l = m.substr(0, sp), rt = m.substr(sp + 1);
    const auto a = ids_.find(l), b = ids_.find(rt), c = ids_.find(l + rt);
    if (a == ids_.end() || b == ids_.end() || c == ids_.end()) {
      Fail(what, ": merge ", r, " joins pieces that are not tokens (or makes one that is not)");
    }
    const uint64_t key = (static_cast<uint64_t>(a->second) << 32) | static_cast<uint32_t>(b->second);
    merges_.emplace(key, std::make_pair(static_cast<int>(r), c->second));  // the first rank wins
  }
  re_ = std::make_unique<Regexes>(pre);
}

ByteLevelBpe::~ByteLevelBpe() = default;

void ByteLevelBpe::Word(std::string_view word, std::vector<int>& out) const {
  // Llama 3 (ignore_merges): a word that is a whole token is that token.
  if (pre_ == Pre::kLlama3) {
    std::string chars;
    for (unsigned char b : word) chars += byte_chars_[b];
    if (const auto it = ids_.find(chars); it != ids_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const size_t n = word.size();
  std::vector<int> id(n), prev(n), next(n);
  for (size_t i = 0; i < n; ++i) {
    id[i] = byte_id_[static_cast<unsigned char>(word[i])];
    prev[i] = static_cast<int>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int>(i + 1) : -1;
  }
  struct Pair {
    int rank, left, lid, rid;
    bool operator>(const Pair& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Pair, std::vector<Pair>, std::greater<Pair>> heap;
  auto push = [&](int l) {
    if (l < 0 || next[static_cast<size_t>(l)] < 0) return;
    const int r = next[static_cast<size_t>(l)];
    const uint64_t key = (static_cast<uint64_t>(id[static_cast<size_t>(l)]) << 32) |
                         static_cast<uint32_t>(id[static_cast<size_t>(r)]);
    const auto it = merges_.find(key);
    if (it != merges_.end()) heap.push({it->second.first, l, id[static_cast<size_t>(l)], id[static_cast<size_t>(r)]});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int>(i));
  while (!heap.empty()) {
    const Pair p = heap.top();
    heap.pop();
    const size_t l = static_cast<size_t>(p.left);
    if (id[l] != p.lid || next[l] < 0) continue;  // stale: the left symbol changed or was merged away
    const size_t r = static_cast<size_t>(next[l]);
    if (id[r] != p.rid) continue;
    const uint64_t key = (static_cast<uint64_t>(id[l]) << 32) | static_cast<uint32_t>(id[r]);
    id[l] = merges_.find(key)->second.second;
    id[r] = -1;
    next[l] = next[r];
    if (next[r] >= 0) prev[static_cast<size_t>(next[r])] = static_cast<int>(l);
    push(prev[l]);
    push(static_cast<int>(l));
  }
  for (int i = 0; i >= 0; i = next[static_cast<size_t>(i)]) out.push_back(id[static_cast<size_t>(i)]);
}

void ByteLevelBpe::Words(std::string_view text, std::vector<int>& out,
                         std::unordered_map<std::string, std::vector<int>>& cache) const {
  auto word = [&](std::string_view s, size_t b, size_t e) {
    const std::string_view w = s.substr(b, e - b);
    if (w.size() > 64) return Word(w, out);
    std::string key(w);
    auto it = cache.find(key);
    if (it == cache.end()) {
      std::vector<int> ids;
      Word(w, ids);
      if (cache.size() > (1u << 16)) cache.clear();
      it = cache.emplace(std::move(key), std::move(ids)).first;
    }
    out.insert(out.end(), it->second.begin(), it->second.end());
  };
  if (pre_ != Pre::kSmolLM) {
    Split(re_->main, text, [&](size_t b, size_t e, bool) { word(text, b, e); });
    return;
  }
  // SmolLM: every digit a word; gpt-2's expression between them.
  Split(re_->digit, text, [&](size_t b, size_t e, bool digit) {
    if (digit) return word(text, b, e);
    const std::string_view piece = text.substr(b, e - b);
    Split(re_->main, piece, [&](size_t pb, size_t pe, bool) { word(piece, pb, pe); });
  });
}

std::vector<int> ByteLevelBpe::encode(std::string_view text) const {
  std::vector<int> out;
  std::unordered_map<std::string, std::vector<int>> cache;
  auto plain = [&](std::string_view s) {
    if (s.empty()) return;
    if (pre_ != Pre::kQwen2) return Words(s, out, cache);
    // NFC (Qwen's normalizer) when the text is valid UTF-8; invalid bytes
    // are left as they are (Hugging Face's tokenizers take only valid text).
    bool valid = true;
    for (int32_t i = 0, n = static_cast<int32_t>(s.size()); i < n && valid;) {
      UChar32 c;
      U8_NEXT(s.data(), i, n, c);
      valid = c >= 0;
    }
    if (!valid || s.size() > (1u << 30)) return Words(s, out, cache);
    UErrorCode err = U_ZERO_ERROR;
    const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(err);
    std::string norm;
    icu::StringByteSink<std::string> sink(&norm);
    if (U_SUCCESS(err)) nfc->normalizeUTF8(0, icu::StringPiece(s.data(), static_cast<int32_t>(s.size())), sink, nullptr, err);
    Words(U_SUCCESS(err) ? std::string_view(norm) : s, out, cache);
  };
  size_t start = 0;
  for (size_t p = 0; p < text.size();) {
    const auto [hit, len] = MatchAdded(text, p);
    if (hit < 0) {
      ++p;
      continue;
    }
    plain(text.substr(start, p - start));
    out.push_back(hit);
    p += len;
    start = p;
  }
  plain(text.substr(start));
  return out;
}

std::pair<int, size_t> ByteLevelBpe::MatchAdded(std::string_view text, size_t p) const {
  std::pair<int, size_t> best{-1, 0};
  int node = 0;
  for (size_t q = p; q < text.size(); ++q) {
    const auto c = static_cast<unsigned char>(text[q]);
    const auto& next = added_[static_cast<size_t>(node)].next;
    const auto it =
        std::lower_bound(next.begin(), next.end(), c, [](const auto& e, unsigned char v) { return e.first < v; });
    if (it == next.end() || it->first != c) break;
    node = it->second;
    if (added_[static_cast<size_t>(node)].id >= 0) best = {added_[static_cast<size_t>(node)].id, q + 1 - p};
  }
  return best;
}

std::string ByteLevelBpe::decode(int id) const {
  if (id < 0 || id >= vocab_size() || control_[static_cast<size_t>(id)]) return "";
  const std::string& t = tokens_[static_cast<size_t>(id)];
  std::string out;
  for (int32_t i = 0, n = static_cast<int32_t>(t.size()); i < n;) {
    const int32_t at = i;
    UChar32 c;
    U8_NEXT(t.data(), i, n, c);
    if (c >= 0 && c < 324 && char_byte_[c] >= 0) {
      out += static_cast<char>(char_byte_[c]);
    } else {
      out.append(t, static_cast<size_t>(at), static_cast<size_t>(i - at));  // not a byte character: as written
    }
  }
  return out;
}

}  // namespace kvq::model
