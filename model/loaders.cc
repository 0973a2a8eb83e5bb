// llama2.c file loaders: the mapped checkpoint and the tokenizer (with its
// BPE encoder). Everything here reads bytes a user hands us, so it is kept
// apart from the forward pass: the fuzz targets build it alone.
#include "model/llama2.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>

#include "kvq/error.h"
#include "model/gguf.h"

namespace kvq::model {

// ---- MappedFile -----------------------------------------------------------

MappedFile::MappedFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) Fail("file '", path, "': cannot open (", std::strerror(errno), ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    Fail("file '", path, "': not a regular file");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      Fail("file '", path, "': mmap failed (", std::strerror(errno), ")");
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

// ---- Checkpoint -----------------------------------------------------------

namespace {

constexpr uint32_t kMagicAk42 = 0x616b3432;  // llama2.c export.py, "ak42" read as a little-endian u32
constexpr size_t kLegacyHeader = 7 * sizeof(int32_t), kVersionedHeader = 256;

}  // namespace

bool is_gguf_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char m[4] = {};
  return f.read(m, 4) && GgufFile::has_magic(reinterpret_cast<const uint8_t*>(m), 4);
}

Checkpoint::Checkpoint(const std::string& path) : file_(std::make_unique<MappedFile>(path)) {
  if (GgufFile::has_magic(file_->data(), file_->size())) {
    LoadGguf(path);
    return;
  }
  const MappedFile& file = *file_;
  // Two layouts of llama2.c's export.py: the legacy one (version 0: 7 int32,
  // shared classifier as the sign of vocab_size, RoPE tables after the
  // weights) and version 1 ("ak42", int32 version, 7 int32, a u8
  // shared-classifier flag, zero padding to 256 bytes, fp32 weights with the
  // norms first and no RoPE tables). Version 2 stores Q8_0 weights.
  uint32_t magic = 0;
  if (file.size() >= 8) std::memcpy(&magic, file.data(), 4);
  const bool v1 = magic == kMagicAk42;
  if (v1) {
    int32_t version = 0;
    std::memcpy(&version, file.data() + 4, 4);
    if (version == 2) {
      Fail("model '", path, "': llama2.c export version 2 (int8 Q8_0 weights) is not supported; export with ",
           "--version 1 (fp32) or the legacy format (--version 0)");
    }
    if (version != 1) Fail("model '", path, "': llama2.c export version ", version, " is not supported (1 is)");
    if (file.size() < kVersionedHeader) {
      Fail("model '", path, "': file is ", file.size(), " bytes, shorter than the 256-byte version 1 header");
    }
  } else if (file.size() < kLegacyHeader) {
    Fail("model '", path, "': file is ", file.size(), " bytes, shorter than the 28-byte llama2.c header");
  }
  const size_t header = v1 ? kVersionedHeader : kLegacyHeader;
  int32_t h[7];
  std::memcpy(h, file.data() + (v1 ? 8 : 0), sizeof h);
  Config& c = config_;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  if (v1) {
    c.shared_classifier = file.data()[36] != 0;
    c.vocab_size = h[5];
  } else {
    c.shared_classifier = h[5] > 0;
    c.vocab_size = h[5] == std::numeric_limits<int32_t>::min() ? 0 : std::abs(h[5]);
  }
  c.seq_len = h[6];
  auto in_range = [](int v, int hi) { return v > 0 && v <= hi; };
  if (!in_range(c.dim, 1 << 16) || !in_range(c.hidden_dim, 1 << 18) || !in_range(c.n_layers, 1024) ||
      !in_range(c.n_heads, 1024) || !in_range(c.n_kv_heads, 1024) || !in_range(c.vocab_size, 1 << 20) ||
      !in_range(c.seq_len, 1 << 20)) {
    Fail("model '", path, "': implausible header (dim ", c.dim, ", hidden_dim ", c.hidden_dim, ", n_layers ",
         c.n_layers, ", n_heads ", c.n_heads, ", n_kv_heads ", c.n_kv_heads, ", vocab_size ", h[5], ", seq_len ",
         c.seq_len, "); not a llama2.c checkpoint (legacy or export version 1)?");
  }
  if (c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0 || c.head_size() % 2 != 0) {
    Fail("model '", path, "': inconsistent header: dim ", c.dim, " must be a multiple of n_heads ", c.n_heads,
         ", n_heads a multiple of n_kv_heads ", c.n_kv_heads, ", and the head size even");
  }
  const uint64_t dim = static_cast<uint64_t>(c.dim), hid = static_cast<uint64_t>(c.hidden_dim),
                 L = static_cast<uint64_t>(c.n_layers), vocab = static_cast<uint64_t>(c.vocab_size),
                 kv = static_cast<uint64_t>(c.kv_dim()), hs = static_cast<uint64_t>(c.head_size()),
                 seq = static_cast<uint64_t>(c.seq_len);
  const uint64_t rope = v1 ? 0 : seq * hs;  // legacy files carry two unused RoPE tables
  const uint64_t floats = vocab * dim + L * dim + L * dim * dim + 2 * L * kv * dim + L * dim * dim + L * dim +
                          3 * L * hid * dim + dim + rope + (c.shared_classifier ? 0 : vocab * dim);
  const uint64_t expected = header + floats * sizeof(float);
  if (file.size() != expected) {
    Fail("model '", path, "': file is ", file.size(), " bytes but its ", v1 ? "version 1 " : "", "header (dim ",
         c.dim, ", hidden_dim ", c.hidden_dim, ", n_layers ", c.n_layers, ", n_heads ", c.n_heads, ", n_kv_heads ",
         c.n_kv_heads, ", vocab_size ", h[5], ", seq_len ", c.seq_len, ") implies ", expected,
         " bytes; truncated or inconsistent file");
  }
  // The float data starts at byte 28 or 256: copying is avoided, and float
  // loads from a 4-byte-aligned address are fine on every target we build for.
  const float* p = reinterpret_cast<const float*>(file.data() + header);
  Weights& w = weights_;
  if (v1) {
    w.rms_att = p; p += L * dim;
    w.rms_ffn = p; p += L * dim;
    w.rms_final = p; p += dim;
    w.token_embedding = p; p += vocab * dim;
    w.wq = p; p += L * dim * dim;
    w.wk = p; p += L * kv * dim;
    w.wv = p; p += L * kv * dim;
    w.wo = p; p += L * dim * dim;
    w.w1 = p; p += L * hid * dim;
    w.w2 = p; p += L * dim * hid;
    w.w3 = p; p += L * hid * dim;
  } else {
    w.token_embedding = p; p += vocab * dim;
    w.rms_att = p; p += L * dim;
    w.wq = p; p += L * dim * dim;
    w.wk = p; p += L * kv * dim;
    w.wv = p; p += L * kv * dim;
    w.wo = p; p += L * dim * dim;
    w.rms_ffn = p; p += L * dim;
    w.w1 = p; p += L * hid * dim;
    w.w2 = p; p += L * dim * hid;
    w.w3 = p; p += L * hid * dim;
    w.rms_final = p; p += dim;
    p += rope;
  }
  w.wcls = c.shared_classifier ? w.token_embedding : p;
  format_version_ = v1 ? 1 : 0;
}

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

std::vector<int> Tokenizer::encode(const std::string& text, bool bos) const {
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

std::string Tokenizer::decode(int prev, int token) const {
  KVQ_CHECK_ARG(token >= 0 && token < vocab_size(), "token: expected 0..", vocab_size() - 1, ", got ", token);
  std::string p = pieces_[static_cast<size_t>(token)];
  if (prev == kBos && !p.empty() && p[0] == ' ') p.erase(0, 1);
  unsigned int byte = 0;
  if (p.size() == 6 && std::sscanf(p.c_str(), "<0x%02X>", &byte) == 1) return std::string(1, static_cast<char>(byte));
  return p;
}

}  // namespace kvq::model
