// Writes the seed corpora of the fuzz targets into DIR/{kvqp,kvqc,
// checkpoint,tokenizer,chat_template}: valid encodings of every path, small consistent
// checkpoints and tokenizers, and, when SHARED has them, the shipped
// model's header and tokenizer (read at run time, never committed).
//   make_seeds DIR [SHARED]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kvq/affine.h"
#include "kvq/cluster_outliers.h"
#include "kvq/kv_cache.h"
#include "kvq/sorted_profile.h"
#include "model/chat_template.h"
#include "fuzz/fuzz_util.h"
#include "src/io/container.h"

namespace {

namespace fs = std::filesystem;

void Write(const fs::path& p, const std::vector<uint8_t>& b) {
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// Both readings of fuzz_util.h's AsContainer: the whole file (odd first
// byte) and the bare payload (even first byte).
using kvq::fuzz::Values;

void WriteContainer(const fs::path& dir, const std::string& name, const std::vector<uint8_t>& c) {
  std::vector<uint8_t> whole{1};
  whole.insert(whole.end(), c.begin(), c.end());
  Write(dir / (name + ".whole"), whole);
  std::vector<uint8_t> payload{0};
  payload.insert(payload.end(), c.begin() + kvq::detail::kContainerHeaderBytes, c.end());
  Write(dir / (name + ".payload"), payload);
}


std::vector<uint8_t> Checkpoint(int dim, int hidden, int layers, int heads, int kv_heads, int vocab, int seq) {
  const int hs = dim / heads, kv = kv_heads * hs;
  const size_t floats = static_cast<size_t>(vocab) * dim + layers * dim + layers * dim * dim + 2 * layers * kv * dim +
                        layers * dim * dim + layers * dim + 3 * layers * hidden * dim + dim + seq * hs;
  std::vector<uint8_t> b(28 + floats * 4);
  const int32_t h[7] = {dim, hidden, layers, heads, kv_heads, vocab, seq};
  std::memcpy(b.data(), h, 28);
  const std::vector<float> w = Values(static_cast<int>(floats), 7);
  std::memcpy(b.data() + 28, w.data(), floats * 4);
  return b;
}

std::vector<uint8_t> Tokenizer(int vocab) {
  std::vector<std::string> pieces = {"<unk>", "<s>", "</s>"};
  char buf[8];
  for (int i = 0; i < 256; ++i) std::snprintf(buf, sizeof buf, "<0x%02X>", i), pieces.push_back(buf);
  const std::string letters = "abcdefghijklmnopqrstuvwxyz ";
  for (char x : letters)
    for (char y : letters) pieces.push_back(std::string{x, y});
  pieces.resize(static_cast<size_t>(vocab));
  std::vector<uint8_t> b(2);
  b[0] = static_cast<uint8_t>(vocab & 0xFF), b[1] = static_cast<uint8_t>(vocab >> 8);  // fuzz_tokenizer's prefix
  auto put = [&](const void* p, size_t n) { b.insert(b.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n); };
  const int32_t max_len = 6;
  put(&max_len, 4);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const float score = -static_cast<float>(i);
    const int32_t len = static_cast<int32_t>(pieces[i].size());
    put(&score, 4), put(&len, 4), put(pieces[i].data(), pieces[i].size());
  }
  return b;
}

std::vector<uint8_t> Slurp(const fs::path& p, size_t max) {
  std::ifstream f(p, std::ios::binary);
  std::vector<uint8_t> b(max);
  f.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(max));
  b.resize(static_cast<size_t>(f.gcount()));
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: make_seeds DIR [SHARED]\n");
    return 2;
  }
  const fs::path root = argv[1];
  for (const char* d : {"kvqp", "kvqc", "kvqs", "kvqr", "checkpoint", "tokenizer", "chat_template"})
    fs::create_directories(root / d);
  // Chat templates: the built-ins and a few of the subset's corners.
  for (const std::string& name : kvq::model::ChatTemplate::builtin_names()) {
    const std::string t = kvq::model::ChatTemplate::builtin(name);
    Write(root / "chat_template" / name, std::vector<uint8_t>(t.begin(), t.end()));
  }
  int corner = 0;
  for (const std::string t : {
           std::string("{%- set ns = namespace(i=0) -%}\n{% for m in messages[::-1] if m.role != 'tool' %}"
                       "{% set ns.i = loop.index0 %}{{ m.content|trim|tojson(indent=2) }}{% else %}none{% endfor %}"),
           std::string("  {%+ if tools is defined and tools|length > 0 %}{{ tools|map(attribute='function')|list }}"
                       "{% elif not add_generation_prompt %}x{% endif %}\n{# c #}{% raw %}{{ }}{% endraw %}"),
           std::string("{{ (1, 2.5e3, 'a' ~ none)|string }}{{ messages|selectattr('role', 'equalto', 'user')|list"
                       "|length is divisibleby 2 }}{{ '%s'|replace('%', '') * 3 }}{{ range(3)|join(',') }}"),
       }) {
    Write(root / "chat_template" / ("corner" + std::to_string(corner++)), std::vector<uint8_t>(t.begin(), t.end()));
  }

  // KVQP: every tail path, both families, a few widths.
  kvq::SortedProfileOptions o;
  int i = 0;
  for (int bits : {1, 3, 4, 8}) {
    o.bits = bits;
    o.top_k = bits;
    const std::vector<float> g = Values(200 + bits, static_cast<uint32_t>(bits));
    WriteContainer(root / "kvqp", "parametric" + std::to_string(i++), kvq::serialize(kvq::fit_sorted_profile(g, kvq::GaussianEstimator(), o)));
  }
  std::vector<float> u(300);
  for (size_t k = 0; k < u.size(); ++k) u[k] = static_cast<float>(k % 17);
  WriteContainer(root / "kvqp", "dense", kvq::serialize(kvq::fit_sorted_profile(u, kvq::LaplaceEstimator(), o)));
  WriteContainer(root / "kvqp", "constant", kvq::serialize(kvq::fit_sorted_profile(std::vector<float>(40, 2.5f), kvq::GaussianEstimator(), o)));
  WriteContainer(root / "kvqp", "empty", kvq::serialize(kvq::fit_sorted_profile(std::vector<float>{1, 2}, kvq::GaussianEstimator(), o)));

  // KVQC: outliers in int8 and fp8, with tails.
  const int n_head = 2, d_head = 4, T = 40;
  const std::vector<float> k = Values(T * n_head * d_head, 11), v = Values(T * n_head * d_head, 12);
  const kvq::TensorView kv(k.data(), {T, n_head, d_head}, kvq::DType::F32), vv(v.data(), {T, n_head, d_head}, kvq::DType::F32);
  for (kvq::QuantMode mode : {kvq::QuantMode::Int8, kvq::QuantMode::Fp8}) {
    kvq::OutlierTokens out;
    kvq::OutlierTokenSet set{kvq::Tensor({2, n_head, d_head}, kvq::DType::F32), kvq::Tensor({2, n_head, d_head}, kvq::DType::F32), {3, 17}};
    for (int r = 0; r < 2; ++r) {
      std::memcpy(set.k.data_as<float>() + r * 8, k.data() + set.indices[static_cast<size_t>(r)] * 8, 32);
      std::memcpy(set.v.data_as<float>() + r * 8, v.data() + set.indices[static_cast<size_t>(r)] * 8, 32);
    }
    out.emplace(5, std::move(set));
    const auto q = kvq::quantize_cluster_outliers(out, kv, vv, mode);
    WriteContainer(root / "kvqc", std::string("outliers_") + kvq::quant_mode_name(mode), kvq::serialize(q.at(5)));
  }
  kvq::QuantizedClusterOutliers empty;
  empty.n_head = 1, empty.d_head = 1;
  WriteContainer(root / "kvqc", "empty", kvq::serialize(empty));

  // KVQS: saved caches of every family and the store's states (sinks only,
  // an open group, completed groups, fallbacks), with and without the
  // identities.
  {
    const int L = 2, H = 2, hd = 32, E = H * hd;
    std::vector<std::vector<float>> ks(L), vs(L);
    for (int l = 0; l < L; ++l) ks[l] = Values(64 * E, 20 + l), vs[l] = Values(64 * E, 30 + l);
    kvq::StaticRanges ranges = kvq::StaticRanges::from_samples(ks, vs, H, hd);
    for (size_t c = 0; c < ranges.k_lo.size(); ++c) ranges.k_weight.push_back(1.0f + static_cast<float>(c % 5));
    const std::vector<float> k = Values(120 * E, 41), v = Values(120 * E, 42);
    kvq::KvCacheMeta meta;
    meta.model_fingerprint = std::array<uint8_t, 32>{1, 2, 3};
    meta.tokens_digest = std::array<uint8_t, 32>{4, 5, 6};
    int n = 0;
    for (const char* scheme : {"fp16", "int8", "q4_0", "q8_0", "fp8-e4m3", "kvq-6.5", "kvq-4.5", "kvq-3.5", "kvq-2.5",
                               "k3v3g32o8x3r4", "k4v4g16", "k4v3c", "t0+q4_0", "t0+kvq-3.5"}) {
      for (int T : {1, 21, 70, 120}) {
        kvq::KvCache c(scheme, L, 128, H, hd, &ranges, {}, kvq::fuzz::FuzzTokenTable());
        for (int t = 0; t < T; ++t) {
          for (int l = 0; l < L; ++l) {
            c.write(l, t, std::span(k).subspan(static_cast<size_t>(t) * E, E),
                    std::span(v).subspan(static_cast<size_t>(t) * E, E), (5 * t) % kvq::fuzz::kTableVocab);
          }
        }
        WriteContainer(root / "kvqs", std::string(scheme) + "_" + std::to_string(T),
                       c.to_bytes(-1, n++ % 2 ? meta : kvq::KvCacheMeta{}));
      }
    }
  }

  // KVQR: the first and second range of every reference scheme.
  for (const char* scheme : kvq::fuzz::kRangeSchemes) {
    const auto& r = kvq::fuzz::RangeSeeds(scheme);
    WriteContainer(root / "kvqr", std::string(scheme) + "_0", r[0]);
    WriteContainer(root / "kvqr", std::string(scheme) + "_1", r[1]);
  }

  // Oversized declared sizes: a container whose header claims 2^40 payload
  // bytes, and one whose first payload count (the scheme name's length) is
  // past the end; for both KVQS and KVQR.
  for (const char* dir : {"kvqs", "kvqr"}) {
    std::vector<fs::path> some;
    for (const auto& e : fs::directory_iterator(root / dir)) {
      if (e.path().extension() == ".whole") some.push_back(e.path());
    }
    if (some.empty()) continue;
    std::sort(some.begin(), some.end());
    std::ifstream f(some.front(), std::ios::binary);
    std::vector<uint8_t> c((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    c.erase(c.begin());  // the reading byte
    std::vector<uint8_t> huge = c;
    const uint64_t big = uint64_t{1} << 40;
    std::memcpy(huge.data() + 8, &big, 8);
    WriteContainer(root / dir, "huge_payload", huge);
    std::vector<uint8_t> name = c;
    name[kvq::detail::kContainerHeaderBytes] = 0xff, name[kvq::detail::kContainerHeaderBytes + 1] = 0xff;
    WriteContainer(root / dir, "huge_name", name);
  }

  // Checkpoints: small consistent ones (shared and separate classifier).
  Write(root / "checkpoint" / "tiny", Checkpoint(8, 16, 1, 2, 1, 300, 8));
  std::vector<uint8_t> sep = Checkpoint(8, 8, 2, 2, 2, 260, 4);
  int32_t neg_vocab = -260;  // a separate classifier
  std::memcpy(sep.data() + 20, &neg_vocab, 4);
  const std::vector<float> cls = Values(260 * 8, 3);
  sep.insert(sep.end(), reinterpret_cast<const uint8_t*>(cls.data()), reinterpret_cast<const uint8_t*>(cls.data()) + cls.size() * 4);
  Write(root / "checkpoint" / "separate_classifier", sep);
  // Export version 1 ("ak42", 256-byte header, no RoPE tables) of the tiny one.
  const std::vector<uint8_t> tiny = Checkpoint(8, 16, 1, 2, 1, 300, 8);
  std::vector<uint8_t> v1(256, 0);
  const uint32_t magic = 0x616b3432;
  const int32_t version = 1;
  std::memcpy(v1.data(), &magic, 4);
  std::memcpy(v1.data() + 4, &version, 4);
  std::memcpy(v1.data() + 8, tiny.data(), 28);
  v1[36] = 1;
  v1.insert(v1.end(), tiny.begin() + 28, tiny.end() - 8 * 4 * 4);  // minus the seq * head_size RoPE floats
  Write(root / "checkpoint" / "tiny_v1", v1);
  Write(root / "tokenizer" / "synthetic300", Tokenizer(300));
  Write(root / "tokenizer" / "synthetic259", Tokenizer(259));

  if (argc > 2) {  // the shipped model's header (its weights are too large a seed) and tokenizer
    const fs::path shared = argv[2];
    const std::vector<uint8_t> head = Slurp(shared / "models/stories260K/stories260K.bin", 28 + 4096);
    if (!head.empty()) Write(root / "checkpoint" / "stories260K_head", head);
    std::vector<uint8_t> tok = Slurp(shared / "models/stories260K/tok512.bin", 1 << 20);
    if (!tok.empty()) {
      tok.insert(tok.begin(), {0x00, 0x02});  // vocab 512
      Write(root / "tokenizer" / "tok512", tok);
    }
  }
  return 0;
}
