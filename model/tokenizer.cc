// llama2.c's tokenizer and its BPE encoder (model/tokenizer.h).
#include "model/tokenizer.h"
#include "model/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>

#include "kvq/error.h"
#include "model/bpe.h"
#include "model/gguf.h"

namespace kvq::model {

// ---- Tokenizer ------------------------------------------------------------

Tokenizer::Tokenizer(const std::string& path, int vocab_size) {
  KVQ_CHECK_ARG(vocab_size >= kMinVocab, "tokenizer '", path, "': the model's vocab_size ", vocab_size,
                " is below ", kMinVocab, ", the ids BOS (1), EOS (2) and the byte fallback <0x00>..<0xFF> (3..258) "
                "need; not a llama2.c sentencepiece vocabulary");
  MappedFile f(path);
  size_t off = 0;
  auto read = [&](void* dst, size_t n, const char* what) {
    if (off + n > f.size()) {
      Fail("tokenizer '", path, "': truncated while reading ", what, " at byte ", off, " (file is ", f.size(),
           " bytes, expected ", vocab_size, " entries)");
    }
    std::memcpy(dst, f.data() + off, n);
    off += n;
  };
  int32_t max_len = 0;
  read(&max_len, 4, "max_token_length");
  KVQ_CHECK_ARG(max_len > 0 && max_len < (1 << 16), "tokenizer '", path, "': implausible max_token_length ", max_len);
  pieces_.resize(static_cast<size_t>(vocab_size));
  scores_.resize(static_cast<size_t>(vocab_size));
  for (int i = 0; i < vocab_size; ++i) {
    int32_t len = 0;
    read(&scores_[static_cast<size_t>(i)], 4, "a score");
    read(&len, 4, "a piece length");
    if (len < 0 || len > max_len) {
      Fail("tokenizer '", path, "': piece ", i, " has length ", len, ", expected 0..", max_len);
    }
    pieces_[static_cast<size_t>(i)].resize(static_cast<size_t>(len));
    read(pieces_[static_cast<size_t>(i)].data(), static_cast<size_t>(len), "piece bytes");
  }
  if (off != f.size()) {
    Fail("tokenizer '", path, "': ", f.size() - off, " trailing bytes after ", vocab_size,
         " entries; vocab size mismatch with the model?");
  }
  Index(std::vector<bool>(static_cast<size_t>(vocab_size), true));
}

Tokenizer::Tokenizer(std::vector<std::string> pieces, std::vector<float> scores, const std::vector<bool>& matchable,
                     const std::string& what)
    : pieces_(std::move(pieces)), scores_(std::move(scores)) {
  const size_t n = pieces_.size();
  KVQ_CHECK_ARG(n >= static_cast<size_t>(kMinVocab), "tokenizer of '", what, "': ", n, " pieces, fewer than the ",
                kMinVocab, " that BOS (1), EOS (2) and the byte pieces <0x00>..<0xFF> (3..258) need");
  KVQ_CHECK_ARG(scores_.size() == n && matchable.size() == n, "tokenizer of '", what, "': ", n, " pieces but ",
                scores_.size(), " scores and ", matchable.size(), " token types");
  for (int b = 0; b < 256; ++b) {
    char want[8];
    std::snprintf(want, sizeof want, "<0x%02X>", b);
    KVQ_CHECK_ARG(pieces_[static_cast<size_t>(b) + 3] == want, "tokenizer of '", what, "': piece ", b + 3, " is '",
                  pieces_[static_cast<size_t>(b) + 3], "', expected the byte piece ", want,
                  " (kvq's sentencepiece encoder needs byte fallback at ids 3..258)");
  }
  for (float sc : scores_) KVQ_CHECK_ARG(!std::isnan(sc), "tokenizer of '", what, "': a score is NaN");
  Index(matchable);
}

void Tokenizer::Index(const std::vector<bool>& matchable) {
  sorted_.clear();
  for (size_t i = 0; i < pieces_.size(); ++i) {
    if (matchable[i]) sorted_.emplace_back(pieces_[i], static_cast<int>(i));
  }
  std::sort(sorted_.begin(), sorted_.end());
}

int Tokenizer::lookup(const std::string& s) const {
  auto it = std::lower_bound(sorted_.begin(), sorted_.end(), std::make_pair(s, -1));
  return (it != sorted_.end() && it->first == s) ? it->second : -1;
}

std::vector<int> Tokenizer::Symbols(const std::string& text, bool bos) const {
  std::vector<int> ids;
  if (bos) ids.push_back(kBos);
  if (!text.empty()) {
    const int sp = lookup(" ");
    if (sp >= 0) ids.push_back(sp);
  }
  // Code points (a lead byte plus up to 3 continuation bytes) to pieces.
  for (size_t i = 0; i < text.size();) {
    size_t j = i + 1;
    while (j < text.size() && j - i < 4 && (static_cast<unsigned char>(text[j]) & 0xC0) == 0x80) ++j;
    const std::string cp = text.substr(i, j - i);
    const int id = lookup(cp);
    if (id >= 0) {
      ids.push_back(id);
    } else {
      for (unsigned char b : cp) ids.push_back(static_cast<int>(b) + 3);  // <0xNN> byte fallback
    }
    i = j;
  }
  return ids;
}

namespace {

// Pairs scoring at or below this never merge (llama2.c's sentinel).
constexpr float kNoMerge = -1e10f;

}  // namespace

Tokenizer::Tokenizer(std::shared_ptr<const ByteLevelBpe> bpe, int bos, bool add_bos, std::vector<int> ends)
    : bpe_(std::move(bpe)), bpe_bos_(bos), bpe_add_bos_(add_bos && bos >= 0), bpe_ends_(std::move(ends)) {
  KVQ_ASSERT(bpe_ != nullptr && bos < bpe_->vocab_size());
}

Tokenizer::~Tokenizer() = default;

int Tokenizer::vocab_size() const { return bpe_ ? bpe_->vocab_size() : static_cast<int>(pieces_.size()); }

const std::string& Tokenizer::piece(int id) const {
  return bpe_ ? bpe_->token(id) : pieces_[static_cast<size_t>(id)];
}

bool Tokenizer::ends_text(int id) const {
  if (!bpe_) return id == kBos;
  return std::find(bpe_ends_.begin(), bpe_ends_.end(), id) != bpe_ends_.end();
}

std::string Tokenizer::kind() const {
  if (!bpe_) return "sentencepiece";
  return std::string("byte-level BPE (") + ByteLevelBpe::pre_name(bpe_->pre()) + ")";
}

std::vector<int> Tokenizer::encode(const std::string& text, bool bos) const {
  if (bpe_) {
    std::vector<int> ids;
    if (bos && bpe_add_bos_) ids.push_back(bpe_bos_);
    const std::vector<int> t = bpe_->encode(text);
    ids.insert(ids.end(), t.begin(), t.end());
    return ids;
  }
  std::vector<int> ids = Symbols(text, bos);
  const size_t first = bos ? 1 : 0;
  const size_t n = ids.size();
  if (n < first + 2) return ids;
  // Symbols [first, n) as a doubly linked list; a heap of candidate merges
  // ordered by score (higher first), then by the left symbol's index (which
  // keeps the order of the text: lower first). An entry is stale once
  // either symbol has changed since it was pushed (stamps).
  std::vector<size_t> prev(n), next(n);
  std::vector<uint32_t> stamp(n, 0);
  for (size_t i = first; i < n; ++i) prev[i] = i - 1, next[i] = i + 1;
  struct Cand {
    float score;
    size_t left, right;
    uint32_t left_stamp, right_stamp;
    int id;
  };
  auto worse = [](const Cand& a, const Cand& b) { return a.score != b.score ? a.score < b.score : a.left > b.left; };
  std::vector<Cand> heap;
  heap.reserve(n);
  auto push = [&](size_t l, size_t r) {
    const int id = lookup(pieces_[static_cast<size_t>(ids[l])] + pieces_[static_cast<size_t>(ids[r])]);
    if (id < 0) return;
    const float sc = scores_[static_cast<size_t>(id)];
    if (!(sc > kNoMerge)) return;
    heap.push_back({sc, l, r, stamp[l], stamp[r], id});
    std::push_heap(heap.begin(), heap.end(), worse);
  };
  for (size_t i = first; i + 1 < n; ++i) push(i, i + 1);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    const Cand c = heap.back();
    heap.pop_back();
    if (stamp[c.left] != c.left_stamp || stamp[c.right] != c.right_stamp || next[c.left] != c.right) continue;
    ids[c.left] = c.id;  // the left symbol absorbs the right one
    ++stamp[c.left];
    ++stamp[c.right];
    ids[c.right] = -1;
    next[c.left] = next[c.right];
    if (next[c.left] < n) prev[next[c.left]] = c.left;
    if (c.left > first) push(prev[c.left], c.left);
    if (next[c.left] < n) push(c.left, next[c.left]);
  }
  std::vector<int> out(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(first));
  for (size_t i = first; i < n; i = next[i]) out.push_back(ids[i]);
  return out;
}

std::vector<int> Tokenizer::encode_reference(const std::string& text, bool bos) const {
  if (bpe_) return encode(text, bos);
  std::vector<int> ids = Symbols(text, bos);
  // Merge the leftmost best-scoring adjacent pair until none merges.
  const size_t first = bos ? 1 : 0;
  auto pair_id = [&](size_t a) { return lookup(pieces_[static_cast<size_t>(ids[a])] + pieces_[static_cast<size_t>(ids[a + 1])]); };
  std::vector<int> merged(ids.size(), -1);
  for (size_t a = first; a + 1 < ids.size(); ++a) merged[a] = pair_id(a);
  while (true) {
    float best = kNoMerge;
    int best_id = -1;
    size_t best_at = 0;
    for (size_t a = first; a + 1 < ids.size(); ++a) {
      if (merged[a] >= 0 && scores_[static_cast<size_t>(merged[a])] > best) {
        best = scores_[static_cast<size_t>(merged[a])];
        best_id = merged[a];
        best_at = a;
      }
    }
    if (best_id < 0) break;
    ids[best_at] = best_id;
    ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
    merged.erase(merged.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
    if (best_at + 1 < ids.size()) merged[best_at] = pair_id(best_at);
    else merged[best_at] = -1;
    if (best_at > first) merged[best_at - 1] = pair_id(best_at - 1);
  }
  return ids;
}

bool Tokenizer::shows_piece(const std::string& piece) {
  if (piece.size() != 1) return true;
  const unsigned char c = static_cast<unsigned char>(piece[0]);
  return c >= 0x80 || std::isprint(c) || std::isspace(c);
}

size_t Tokenizer::incomplete_utf8_tail(const std::string& text) {
  // The last lead byte within 3 bytes of the end, and the length it announces.
  const size_t n = text.size();
  for (size_t k = 1; k <= std::min<size_t>(3, n); ++k) {
    const unsigned char c = static_cast<unsigned char>(text[n - k]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t need = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    return need > k ? k : 0;  // an ASCII byte or an invalid lead byte (need 1) never waits
  }
  return 0;
}

std::string Tokenizer::decode(int prev, int token) const {
  KVQ_CHECK_ARG(token >= 0 && token < vocab_size(), "token: expected 0..", vocab_size() - 1, ", got ", token);
  if (bpe_) return bpe_->decode(token);
  std::string p = pieces_[static_cast<size_t>(token)];
  if (prev == kBos && !p.empty() && p[0] == ' ') p.erase(0, 1);
  unsigned int byte = 0;
  if (p.size() == 6 && std::sscanf(p.c_str(), "<0x%02X>", &byte) == 1) return std::string(1, static_cast<char>(byte));
  return p;
}

}  // namespace kvq::model
