#include "model/llama2.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

#include "kvq/error.h"

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

Checkpoint::Checkpoint(const std::string& path) : file_(path) {
  constexpr size_t kHeader = 7 * sizeof(int32_t);
  if (file_.size() < kHeader) {
    Fail("model '", path, "': file is ", file_.size(), " bytes, shorter than the 28-byte llama2.c header");
  }
  int32_t h[7];
  std::memcpy(h, file_.data(), kHeader);
  Config& c = config_;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.shared_classifier = h[5] > 0;
  c.vocab_size = h[5] == std::numeric_limits<int32_t>::min() ? 0 : std::abs(h[5]);
  c.seq_len = h[6];
  auto in_range = [](int v, int hi) { return v > 0 && v <= hi; };
  if (!in_range(c.dim, 1 << 16) || !in_range(c.hidden_dim, 1 << 18) || !in_range(c.n_layers, 1024) ||
      !in_range(c.n_heads, 1024) || !in_range(c.n_kv_heads, 1024) || !in_range(c.vocab_size, 1 << 20) ||
      !in_range(c.seq_len, 1 << 20)) {
    Fail("model '", path, "': implausible header (dim ", c.dim, ", hidden_dim ", c.hidden_dim, ", n_layers ",
         c.n_layers, ", n_heads ", c.n_heads, ", n_kv_heads ", c.n_kv_heads, ", vocab_size ", h[5], ", seq_len ",
         c.seq_len, "); not a llama2.c checkpoint?");
  }
  if (c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0 || c.head_size() % 2 != 0) {
    Fail("model '", path, "': inconsistent header: dim ", c.dim, " must be a multiple of n_heads ", c.n_heads,
         ", n_heads a multiple of n_kv_heads ", c.n_kv_heads, ", and the head size even");
  }
  const uint64_t dim = static_cast<uint64_t>(c.dim), hid = static_cast<uint64_t>(c.hidden_dim),
                 L = static_cast<uint64_t>(c.n_layers), vocab = static_cast<uint64_t>(c.vocab_size),
                 kv = static_cast<uint64_t>(c.kv_dim()), hs = static_cast<uint64_t>(c.head_size()),
                 seq = static_cast<uint64_t>(c.seq_len);
  const uint64_t floats = vocab * dim + L * dim + L * dim * dim + 2 * L * kv * dim + L * dim * dim + L * dim +
                          3 * L * hid * dim + dim + seq * hs + (c.shared_classifier ? 0 : vocab * dim);
  const uint64_t expected = kHeader + floats * sizeof(float);
  if (file_.size() != expected) {
    Fail("model '", path, "': file is ", file_.size(), " bytes but its header (dim ", c.dim, ", hidden_dim ",
         c.hidden_dim, ", n_layers ", c.n_layers, ", n_heads ", c.n_heads, ", n_kv_heads ", c.n_kv_heads,
         ", vocab_size ", h[5], ", seq_len ", c.seq_len, ") implies ", expected,
         " bytes; truncated or inconsistent file");
  }
  // The float data starts at byte 28: copying is avoided, and float loads
  // from a 4-byte-aligned address are fine on every target we build for.
  const float* p = reinterpret_cast<const float*>(file_.data() + kHeader);
  Weights& w = weights_;
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
  p += seq * hs;  // two unused RoPE tables of seq_len * hs / 2 floats
  w.wcls = c.shared_classifier ? w.token_embedding : p;
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
  for (int i = 0; i < vocab_size; ++i) sorted_.emplace_back(pieces_[static_cast<size_t>(i)], i);
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

// ---- Transformer ----------------------------------------------------------

namespace {

void RmsNorm(float* o, const float* x, const float* weight, int n) {
  float ss = 0.0f;
  for (int j = 0; j < n; ++j) ss += x[j] * x[j];
  ss /= static_cast<float>(n);
  ss += 1e-5f;
  ss = 1.0f / std::sqrt(ss);
  for (int j = 0; j < n; ++j) o[j] = weight[j] * (ss * x[j]);
}

// out[i] = sum_j w[i, j] * x[j], summed in order j = 0..n-1 (the llama2.c
// order), so that the batched version below gives identical bits.
void MatVec(float* out, const float* x, const float* w, int n, int d) {
  for (int i = 0; i < d; ++i) {
    const float* row = w + static_cast<size_t>(i) * static_cast<size_t>(n);
    float v = 0.0f;
    for (int j = 0; j < n; ++j) v += row[j] * x[j];
    out[i] = v;
  }
}

// out[t, i] = sum_j w[i, j] * x[t, j] for T tokens, each sum in the same
// order as MatVec. Tokens are processed in blocks of kTB with x transposed so
// the innermost loop runs across tokens (independent sums, vectorisable).
void MatMul(float* out, const float* x, const float* w, int T, int n, int d) {
  constexpr int kTB = 16;
  std::vector<float> xt(static_cast<size_t>(n) * kTB);
  for (int t0 = 0; t0 < T; t0 += kTB) {
    const int tb = std::min(kTB, T - t0);
    for (int j = 0; j < n; ++j) {
      for (int t = 0; t < kTB; ++t) {
        xt[static_cast<size_t>(j) * kTB + static_cast<size_t>(t)] =
            t < tb ? x[static_cast<size_t>(t0 + t) * static_cast<size_t>(n) + static_cast<size_t>(j)] : 0.0f;
      }
    }
    for (int i = 0; i < d; ++i) {
      const float* row = w + static_cast<size_t>(i) * static_cast<size_t>(n);
      float acc[kTB] = {};
      for (int j = 0; j < n; ++j) {
        const float wj = row[j];
        const float* xj = xt.data() + static_cast<size_t>(j) * kTB;
        for (int t = 0; t < kTB; ++t) acc[t] += wj * xj[t];
      }
      for (int t = 0; t < tb; ++t) out[static_cast<size_t>(t0 + t) * static_cast<size_t>(d) + static_cast<size_t>(i)] = acc[t];
    }
  }
}

}  // namespace

Transformer::Transformer(const Checkpoint& ckpt, KvScheme scheme, int max_seq, const WindowPolicy& policy)
    : cfg_(ckpt.config()),
      w_(ckpt.weights()),
      cache_(scheme, ckpt.config().n_layers, max_seq, ckpt.config().n_kv_heads, ckpt.config().head_size()),
      max_seq_(max_seq),
      policy_(policy) {
  KVQ_CHECK_ARG(max_seq > 0 && max_seq <= cfg_.seq_len, "max_seq: expected 1..", cfg_.seq_len,
                " (the model's seq_len), got ", max_seq);
  KVQ_CHECK_ARG(policy.window >= 0, "window: expected >= 0, got ", policy.window);
  KVQ_CHECK_ARG(policy.sinks >= 0, "sinks: expected >= 0, got ", policy.sinks);
  KVQ_CHECK_ARG(policy.chunk >= 1, "window chunk: expected >= 1, got ", policy.chunk);
  if (policy.bank) {
    KVQ_CHECK_ARG(policy.window > 0, "bank: expected a window > 0");
    ClusterBank check(cfg_.n_kv_heads, cfg_.head_size(), policy.bank_options);  // validates the options
  }
  banks_.resize(static_cast<size_t>(cfg_.n_layers));
  const int hs = cfg_.head_size();
  rope_cos_.resize(static_cast<size_t>(max_seq) * static_cast<size_t>(hs / 2));
  rope_sin_.resize(rope_cos_.size());
  for (int pos = 0; pos < max_seq; ++pos) {
    for (int i = 0; i < hs; i += 2) {
      const float freq = 1.0f / std::pow(10000.0f, static_cast<float>(i) / static_cast<float>(hs));
      const float val = static_cast<float>(pos) * freq;
      rope_cos_[static_cast<size_t>(pos * (hs / 2) + i / 2)] = std::cos(val);
      rope_sin_[static_cast<size_t>(pos * (hs / 2) + i / 2)] = std::sin(val);
    }
  }
  logits_.resize(static_cast<size_t>(cfg_.vocab_size));
}

void Transformer::BankChunk(int layer, int t0, int t1) {
  LayerBank& lb = banks_[static_cast<size_t>(layer)];
  const int H = cfg_.n_kv_heads, D = cfg_.head_size(), W = cfg_.kv_dim();
  Tensor k({t1 - t0, H, D}, DType::F32), v({t1 - t0, H, D}, DType::F32);
  for (int t = t0; t < t1; ++t) {
    cache_.read_k(layer, t, {k.data_as<float>() + static_cast<size_t>(t - t0) * W, static_cast<size_t>(W)});
    cache_.read_v(layer, t, {v.data_as<float>() + static_cast<size_t>(t - t0) * W, static_cast<size_t>(W)});
  }
  const BirthMergeReceipt r = lb.bank->birth_and_merge(k, v);
  for (const auto& [id, set] : r.per_cluster_outlier_tokens) {
    lb.out_k.insert(lb.out_k.end(), set.k.data_as<float>(), set.k.data_as<float>() + set.k.numel());
    lb.out_v.insert(lb.out_v.end(), set.v.data_as<float>(), set.v.data_as<float>() + set.v.numel());
  }
  lb.banked_end = t1;
}

void Transformer::attention(int layer, int pos, const float* q, float* out) {
  // Fused decode attention over the stored codes (kvq/attention.h).
  const size_t n = static_cast<size_t>(cfg_.dim);
  const int T = pos + 1;
  const KvRowsView all = cache_.view(layer, T);
  if (policy_.window == 0 || T <= policy_.sinks + policy_.window) {
    decode_attention({q, n}, cfg_.n_heads, all, {out, n});
    return;
  }
  std::vector<AttentionPart> parts;
  const std::span<const float> qs(q, n);
  if (policy_.sinks > 0) parts.push_back(decode_attention_part(qs, cfg_.n_heads, all.subview(0, policy_.sinks)));
  if (!policy_.bank) {
    parts.push_back(decode_attention_part(qs, cfg_.n_heads, all.subview(T - policy_.window, T)));
  } else {
    LayerBank& lb = banks_[static_cast<size_t>(layer)];
    while (T - policy_.window - lb.banked_end >= policy_.chunk) BankChunk(layer, lb.banked_end, lb.banked_end + policy_.chunk);
    parts.push_back(decode_attention_part(qs, cfg_.n_heads, all.subview(lb.banked_end, T)));
    if (lb.bank->num_clusters() > 0) parts.push_back(lb.bank->far_field(qs, cfg_.n_heads));
    const int64_t n_out = static_cast<int64_t>(lb.out_k.size()) / cfg_.kv_dim();
    if (n_out > 0) {
      KvRowsView ov;  // outlier tokens as whole float32 rows
      ov.scheme = KvScheme::Fp32;
      ov.n_kv_heads = cfg_.n_kv_heads;
      ov.head_dim = cfg_.head_size();
      ov.k = reinterpret_cast<const uint8_t*>(lb.out_k.data());
      ov.v = reinterpret_cast<const uint8_t*>(lb.out_v.data());
      ov.slice_bytes = static_cast<size_t>(cfg_.kv_dim()) * sizeof(float);
      ov.tokens = n_out;
      parts.push_back(decode_attention_part(qs, cfg_.n_heads, ov));
    }
  }
  const AttentionPart merged = merge_attention_parts(parts);
  std::copy(merged.value.begin(), merged.value.end(), out);
}

uint64_t Transformer::attention_state_bytes() const {
  const uint64_t row = 2 * cache_.codec().row_bytes();  // K and V of one token, one layer
  const int T = tokens_;
  uint64_t total = 0;
  for (int l = 0; l < cfg_.n_layers; ++l) {
    if (policy_.window == 0 || T <= policy_.sinks + policy_.window) {
      total += row * static_cast<uint64_t>(T);
    } else if (!policy_.bank) {
      total += row * static_cast<uint64_t>(policy_.sinks + policy_.window);
    } else {
      const LayerBank& lb = banks_[static_cast<size_t>(l)];
      const uint64_t d = static_cast<uint64_t>(cfg_.head_size());
      total += row * static_cast<uint64_t>(policy_.sinks + (T - lb.banked_end));
      total += static_cast<uint64_t>(lb.bank->num_clusters()) * static_cast<uint64_t>(cfg_.n_kv_heads) *
               (6 * d + 2 * d * d + 1) * sizeof(float);  // mu_k, mu_v, ranges, Sigma, A, n
      total += (lb.out_k.size() + lb.out_v.size()) * sizeof(float);
    }
  }
  return total;
}

std::span<const float> Transformer::forward(int token, int pos) {
  return run({&token, 1}, pos, /*batched=*/false);
}

std::span<const float> Transformer::forward_window(std::span<const int> tokens) {
  return run(tokens, 0, /*batched=*/true);
}

std::span<const float> Transformer::run(std::span<const int> tokens, int pos0, bool batched) {
  const int T = static_cast<int>(tokens.size());
  KVQ_CHECK_ARG(T > 0, "tokens: expected at least one token");
  KVQ_CHECK_ARG(pos0 >= 0 && pos0 + T <= max_seq_, "pos: positions ", pos0, "..", pos0 + T - 1,
                " exceed the cache size ", max_seq_);
  for (int t : tokens) {
    KVQ_CHECK_ARG(t >= 0 && t < cfg_.vocab_size, "token: expected 0..", cfg_.vocab_size - 1, ", got ", t);
  }
  tokens_ = pos0 + T;
  if (policy_.bank && pos0 == 0) {  // a new sequence: empty banks
    for (LayerBank& lb : banks_) {
      lb.bank = std::make_unique<ClusterBank>(cfg_.n_kv_heads, cfg_.head_size(), policy_.bank_options);
      lb.banked_end = std::min(policy_.sinks, max_seq_);
      lb.out_k.clear();
      lb.out_v.clear();
    }
  }
  const int dim = cfg_.dim, hid = cfg_.hidden_dim, kv_dim = cfg_.kv_dim(), hs = cfg_.head_size();
  const int vocab = cfg_.vocab_size;
  const size_t uT = static_cast<size_t>(T);
  auto ensure = [&](std::vector<float>& v, int width) {
    if (v.size() < uT * static_cast<size_t>(width)) v.resize(uT * static_cast<size_t>(width));
  };
  ensure(x_, dim), ensure(xb_, dim), ensure(xb2_, dim), ensure(q_, dim), ensure(k_, kv_dim), ensure(v_, kv_dim);
  ensure(hb_, hid), ensure(hb2_, hid), ensure(logits_, vocab);
  auto mm = [&](float* out, const float* in, const float* w, int n, int d) {
    if (batched) {
      MatMul(out, in, w, T, n, d);
    } else {
      for (int t = 0; t < T; ++t) MatVec(out + static_cast<size_t>(t) * d, in + static_cast<size_t>(t) * n, w, n, d);
    }
  };
  auto row = [](std::vector<float>& v, int t, int width) { return v.data() + static_cast<size_t>(t) * static_cast<size_t>(width); };

  for (int t = 0; t < T; ++t) {
    std::memcpy(row(x_, t, dim), w_.token_embedding + static_cast<size_t>(tokens[static_cast<size_t>(t)]) * dim,
                static_cast<size_t>(dim) * sizeof(float));
  }
  const size_t udim = static_cast<size_t>(dim), ukv = static_cast<size_t>(kv_dim), uhid = static_cast<size_t>(hid);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const size_t ul = static_cast<size_t>(l);
    for (int t = 0; t < T; ++t) RmsNorm(row(xb_, t, dim), row(x_, t, dim), w_.rms_att + ul * udim, dim);
    mm(q_.data(), xb_.data(), w_.wq + ul * udim * udim, dim, dim);
    mm(k_.data(), xb_.data(), w_.wk + ul * ukv * udim, dim, kv_dim);
    mm(v_.data(), xb_.data(), w_.wv + ul * ukv * udim, dim, kv_dim);
    for (int t = 0; t < T; ++t) {
      const int pos = pos0 + t;
      float* q = row(q_, t, dim);
      float* k = row(k_, t, kv_dim);
      for (int i = 0; i < dim; i += 2) {
        const size_t r = static_cast<size_t>(pos * (hs / 2) + (i % hs) / 2);
        const float fcr = rope_cos_[r], fci = rope_sin_[r];
        const float q0 = q[i], q1 = q[i + 1];
        q[i] = q0 * fcr - q1 * fci;
        q[i + 1] = q0 * fci + q1 * fcr;
        if (i < kv_dim) {
          const float k0 = k[i], k1 = k[i + 1];
          k[i] = k0 * fcr - k1 * fci;
          k[i + 1] = k0 * fci + k1 * fcr;
        }
      }
      cache_.write(l, pos, {k, ukv}, {row(v_, t, kv_dim), ukv});
    }
    for (int t = 0; t < T; ++t) attention(l, pos0 + t, row(q_, t, dim), row(xb_, t, dim));
    mm(xb2_.data(), xb_.data(), w_.wo + ul * udim * udim, dim, dim);
    for (size_t i = 0; i < uT * udim; ++i) x_[i] += xb2_[i];
    for (int t = 0; t < T; ++t) RmsNorm(row(xb_, t, dim), row(x_, t, dim), w_.rms_ffn + ul * udim, dim);
    mm(hb_.data(), xb_.data(), w_.w1 + ul * uhid * udim, dim, hid);
    mm(hb2_.data(), xb_.data(), w_.w3 + ul * uhid * udim, dim, hid);
    for (size_t i = 0; i < uT * uhid; ++i) {
      float val = hb_[i];
      val *= (1.0f / (1.0f + std::exp(-val)));
      hb_[i] = val * hb2_[i];
    }
    mm(xb_.data(), hb_.data(), w_.w2 + ul * udim * uhid, hid, dim);
    for (size_t i = 0; i < uT * udim; ++i) x_[i] += xb_[i];
  }
  for (int t = 0; t < T; ++t) RmsNorm(row(xb_, t, dim), row(x_, t, dim), w_.rms_final, dim);
  mm(logits_.data(), xb_.data(), w_.wcls, dim, vocab);
  return {logits_.data(), uT * static_cast<size_t>(vocab)};
}

}  // namespace kvq::model
