// llama2.c checkpoints mapped from their files (model/checkpoint.h). Everything here
// reads bytes a user hands us: the fuzz targets build it alone.
#include "model/checkpoint.h"

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
  auto matrix = [](const float* at, uint64_t rows, uint64_t cols) {
    ggml::WeightMatrix m;
    m.type = static_cast<uint32_t>(ggml::WeightType::kF32);
    m.data = reinterpret_cast<const uint8_t*>(at);
    m.rows = static_cast<size_t>(rows), m.cols = static_cast<size_t>(cols), m.row_bytes = static_cast<size_t>(cols) * 4;
    return m;
  };
  auto layers = [&](std::vector<ggml::WeightMatrix>& out, uint64_t rows, uint64_t cols) {
    out.clear();
    for (uint64_t l = 0; l < L; ++l) out.push_back(matrix(p + l * rows * cols, rows, cols));
    p += L * rows * cols;
  };
  Weights& w = weights_;
  if (v1) {
    w.rms_att = p; p += L * dim;
    w.rms_ffn = p; p += L * dim;
    w.rms_final = p; p += dim;
    w.token_embedding = matrix(p, vocab, dim); p += vocab * dim;
    layers(w.wq, dim, dim);
    layers(w.wk, kv, dim);
    layers(w.wv, kv, dim);
    layers(w.wo, dim, dim);
    layers(w.w1, hid, dim);
    layers(w.w2, dim, hid);
    layers(w.w3, hid, dim);
  } else {
    w.token_embedding = matrix(p, vocab, dim); p += vocab * dim;
    w.rms_att = p; p += L * dim;
    layers(w.wq, dim, dim);
    layers(w.wk, kv, dim);
    layers(w.wv, kv, dim);
    layers(w.wo, dim, dim);
    w.rms_ffn = p; p += L * dim;
    layers(w.w1, hid, dim);
    layers(w.w2, dim, hid);
    layers(w.w3, hid, dim);
    w.rms_final = p; p += dim;
    p += rope;
  }
  w.wcls = c.shared_classifier ? w.token_embedding : matrix(p, vocab, dim);
  format_version_ = v1 ? 1 : 0;
}

std::map<uint32_t, int> Weights::matrix_types() const {
  std::map<uint32_t, int> n;
  ++n[token_embedding.type];
  for (const std::vector<ggml::WeightMatrix>* k : {&wq, &wk, &wv, &wo, &w1, &w2, &w3}) {
    for (const ggml::WeightMatrix& m : *k) ++n[m.type];
  }
  if (wcls.data != token_embedding.data) ++n[wcls.type];
  return n;
}

std::string Weights::describe() const {
  std::string out;
  for (const auto& [t, n] : matrix_types()) out += (out.empty() ? "" : ", ") + ggml_type_name(t) + " x " + std::to_string(n);
  char buf[64];
  std::snprintf(buf, sizeof buf, ": %.2f GiB", static_cast<double>(matrix_bytes()) / (1u << 30));
  return out + buf;
}

uint64_t Weights::token_bytes() const {
  uint64_t n = matrix_bytes();
  if (wcls.data != token_embedding.data) n -= (token_embedding.rows - 1) * token_embedding.row_bytes;
  return n;
}

uint64_t Weights::matrix_bytes() const {
  uint64_t n = token_embedding.rows * token_embedding.row_bytes;
  for (const std::vector<ggml::WeightMatrix>* k : {&wq, &wk, &wv, &wo, &w1, &w2, &w3}) {
    for (const ggml::WeightMatrix& m : *k) n += m.rows * m.row_bytes;
  }
  if (wcls.data != token_embedding.data) n += wcls.rows * wcls.row_bytes;
  return n;
}

}  // namespace kvq::model
