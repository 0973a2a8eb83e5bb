// Token-id files (tokens.h): bytes a user hands us, every count checked.
#include "model/tokens.h"

#include <cstring>
#include <limits>

#include "kvq/error.h"
#include "kvq/file.h"

namespace kvq::model {

namespace {

// The value of 'key' in a .npy header dict (the text after "'key':", trimmed).
std::string DictValue(const std::string& h, const std::string& key, const std::string& what) {
  const size_t k = h.find("'" + key + "'");
  if (k == std::string::npos) Fail("tokens '", what, "': .npy header has no '", key, "'");
  size_t p = h.find(':', k);
  if (p == std::string::npos) Fail("tokens '", what, "': .npy header is malformed near '", key, "'");
  ++p;
  while (p < h.size() && h[p] == ' ') ++p;
  size_t e = p;
  if (p < h.size() && (h[p] == '\'' || h[p] == '"')) {
    e = h.find(h[p], p + 1);
    if (e == std::string::npos) Fail("tokens '", what, "': .npy header is malformed near '", key, "'");
    return h.substr(p + 1, e - p - 1);
  }
  if (p < h.size() && h[p] == '(') {
    e = h.find(')', p);
    if (e == std::string::npos) Fail("tokens '", what, "': .npy header is malformed near '", key, "'");
    return h.substr(p, e - p + 1);
  }
  while (e < h.size() && h[e] != ',' && h[e] != '}') ++e;
  while (e > p && h[e - 1] == ' ') --e;
  return h.substr(p, e - p);
}

}  // namespace

std::vector<int> parse_token_ids(std::span<const uint8_t> bytes, bool npy, int vocab_size, const std::string& what) {
  KVQ_CHECK_ARG(vocab_size >= 1, "tokens '", what, "': vocab_size must be >= 1");
  size_t off = 0, item = 4;
  bool is_signed = false;
  if (npy) {
    static const uint8_t kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
    if (bytes.size() < 10 || std::memcmp(bytes.data(), kMagic, 6) != 0) {
      Fail("tokens '", what, "': not a .npy file (no \\x93NUMPY magic)");
    }
    const int major = bytes[6];
    size_t hlen = 0;
    if (major == 1) {
      hlen = static_cast<size_t>(bytes[8]) | static_cast<size_t>(bytes[9]) << 8;
      off = 10;
    } else if (major == 2 || major == 3) {
      if (bytes.size() < 12) Fail("tokens '", what, "': truncated .npy header");
      uint32_t h32;
      std::memcpy(&h32, bytes.data() + 8, 4);
      hlen = h32;
      off = 12;
    } else {
      Fail("tokens '", what, "': .npy format version ", major, " is not supported (1..3)");
    }
    if (hlen > bytes.size() - off || hlen > (1u << 16)) {
      Fail("tokens '", what, "': .npy header of ", hlen, " bytes runs past the end of the file");
    }
    const std::string h(reinterpret_cast<const char*>(bytes.data() + off), hlen);
    off += hlen;
    const std::string descr = DictValue(h, "descr", what);
    const std::string fortran = DictValue(h, "fortran_order", what);
    const std::string shape = DictValue(h, "shape", what);
    static const struct {
      const char* d;
      size_t n;
      bool s;
    } kTypes[] = {{"<i2", 2, true}, {"<u2", 2, false}, {"<i4", 4, true}, {"<u4", 4, false},
                  {"<i8", 8, true}, {"<u8", 8, false}, {"|u1", 1, false}, {"|i1", 1, true}};
    bool found = false;
    for (const auto& t : kTypes) {
      if (descr == t.d) item = t.n, is_signed = t.s, found = true;
    }
    if (!found) {
      Fail("tokens '", what, "': .npy dtype '", descr, "' is not a little-endian integer type (int16..uint64)");
    }
    if (fortran != "False") Fail("tokens '", what, "': .npy array is not in C order");
    // shape: "(N,)" or "(1, N)": one row of ids.
    uint64_t n = 1;
    int big = 0;
    for (size_t p = 1; p < shape.size();) {
      while (p < shape.size() && (shape[p] == ' ' || shape[p] == ',' || shape[p] == ')')) ++p;
      if (p >= shape.size()) break;
      uint64_t d = 0;
      size_t q = p;
      while (q < shape.size() && shape[q] >= '0' && shape[q] <= '9' && q - p < 15) d = d * 10 + (shape[q++] - '0');
      if (q == p) Fail("tokens '", what, "': .npy shape '", shape, "' is malformed");
      if (d != 1) ++big;
      n *= d;
      if (n > (uint64_t{1} << 40)) Fail("tokens '", what, "': .npy shape '", shape, "' is too large");
      p = q;
    }
    if (big > 1) Fail("tokens '", what, "': .npy shape ", shape, " is not one row of token ids");
    if (n * item != bytes.size() - off) {
      Fail("tokens '", what, "': .npy shape ", shape, " of ", descr, " needs ", n * item, " bytes of data, the file has ",
           bytes.size() - off);
    }
  } else if (bytes.size() % 4 != 0) {
    Fail("tokens '", what, "': ", bytes.size(), " bytes is not a whole number of little-endian uint32 ids",
         " (a .npy file must be named *.npy)");
  }
  const size_t n = (bytes.size() - off) / item;
  if (n == 0) Fail("tokens '", what, "': no token ids");
  std::vector<int> out(n);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* p = bytes.data() + off + i * item;
    int64_t v = 0;
    uint64_t u = 0;
    std::memcpy(&u, p, item);  // little-endian host
    if (is_signed && item < 8 && (u >> (8 * item - 1)) & 1) u |= ~uint64_t{0} << (8 * item);
    v = static_cast<int64_t>(u);
    if ((!is_signed && u >= static_cast<uint64_t>(vocab_size)) || (is_signed && (v < 0 || v >= vocab_size))) {
      Fail("tokens '", what, "': id ", is_signed ? std::to_string(v) : std::to_string(u), " at position ", i,
           " is outside the model's vocabulary 0..", vocab_size - 1);
    }
    out[i] = static_cast<int>(v);
  }
  return out;
}

std::vector<int> read_token_file(const std::string& path, int vocab_size) {
  const std::vector<uint8_t> b = read_file_whole(path, uint64_t{1} << 30, "tokens");
  const bool npy = path.size() >= 4 && path.compare(path.size() - 4, 4, ".npy") == 0;
  return parse_token_ids(b, npy, vocab_size, path);
}

}  // namespace kvq::model
