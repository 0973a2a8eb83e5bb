// A GGUF model as a Checkpoint: llama.cpp's tensor names and metadata for
// the architectures llama (Llama 2/3, Mistral, TinyLlama, SmolLM) and qwen2
// (Q/K/V biases, NEOX RoPE), weights dequantised to fp32 in llama2.c's
// layout, and the sentencepiece tokenizer when the file has one.
//
// RoPE: llama.cpp stores llama's Q/K rows permuted for adjacent-pair
// rotation (the rotation our forward pass and caches apply). qwen2 rotates
// the two halves of a head (NEOX); its Q/K rows (and biases) are permuted at
// load, row p -> 2p and p + hd/2 -> 2p + 1, which leaves every score q . k
// unchanged. The cache therefore holds K channels in that interleaved order.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "kvq/affine.h"
#include "kvq/error.h"
#include "kvq/ggml_weights.h"
#include "model/gguf.h"
#include "model/bpe.h"
#include "model/checkpoint.h"
#include "model/tokenizer.h"

namespace kvq::model {

namespace {

// The per-frequency divisors llama.cpp stores as rope_freqs.weight for
// Llama 3's scaling, from our RoPE rule: f_unscaled / f_scaled.
std::vector<float> Llama3Factors(int head_dim, const RopeConfig& r) {
  RopeConfig none = r;
  none.scaling = RopeConfig::Scaling::kNone;
  const std::vector<float> f0 = rope_frequencies(head_dim, none), f1 = rope_frequencies(head_dim, r);
  std::vector<float> out(f0.size());
  for (size_t i = 0; i < f0.size(); ++i) out[i] = f0[i] / f1[i];
  return out;
}

// Rows [h hd, (h + 1) hd) of each head: NEOX order (p, p + hd/2) to adjacent
// pairs (2p, 2p + 1), rows of row_bytes copied from in to out.
void NeoxToInterleaved(const uint8_t* in, uint8_t* out, int n_heads, int hd, size_t row_bytes) {
  for (int h = 0; h < n_heads; ++h) {
    const size_t base = static_cast<size_t>(h) * static_cast<size_t>(hd);
    for (int p = 0; p < hd / 2; ++p) {
      std::memcpy(out + (base + 2 * static_cast<size_t>(p)) * row_bytes, in + (base + static_cast<size_t>(p)) * row_bytes,
                  row_bytes);
      std::memcpy(out + (base + 2 * static_cast<size_t>(p) + 1) * row_bytes,
                  in + (base + static_cast<size_t>(p + hd / 2)) * row_bytes, row_bytes);
    }
  }
}

// The same for a bias vector, in place.
void NeoxToInterleavedInPlace(float* b, int n_heads, int hd) {
  std::vector<float> tmp(b, b + static_cast<size_t>(n_heads) * static_cast<size_t>(hd));
  NeoxToInterleaved(reinterpret_cast<const uint8_t*>(tmp.data()), reinterpret_cast<uint8_t*>(b), n_heads, hd,
                    sizeof(float));
}

}  // namespace

void Checkpoint::LoadGguf(const std::string& path) {
  const GgufFile g(file_->data(), file_->size(), path);
  gguf_ = true;
  format_version_ = static_cast<int>(g.version());
  Config& c = config_;
  const std::optional<std::string> arch_opt = g.get_string("general.architecture");
  if (!arch_opt) Fail("model '", path, "': GGUF without general.architecture");
  const std::string arch = *arch_opt;
  if (arch != "llama" && arch != "qwen2") {
    Fail("model '", path, "': architecture '", arch,
         "' is not supported; kvq runs llama (Llama 2/3, Mistral, TinyLlama, SmolLM) and qwen2");
  }
  c.arch = arch;
  const std::string a = arch + ".";
  if (const auto e = g.get_uint(a + "expert_count"); e && *e > 0) {
    Fail("model '", path, "': a mixture of experts (", a, "expert_count = ", *e, ") is not supported");
  }
  auto need = [&](const std::string& key, uint64_t hi) -> int {
    const std::optional<uint64_t> v = g.get_uint(a + key);
    if (!v) Fail("model '", path, "': metadata '", a, key, "' is missing");
    if (*v < 1 || *v > hi) Fail("model '", path, "': metadata '", a, key, "' = ", *v, ", expected 1..", hi);
    return static_cast<int>(*v);
  };
  c.dim = need("embedding_length", 1 << 16);
  c.hidden_dim = need("feed_forward_length", 1 << 18);
  c.n_layers = need("block_count", 1024);
  c.n_heads = need("attention.head_count", 1024);
  c.n_kv_heads = g.find(a + "attention.head_count_kv") ? need("attention.head_count_kv", 1024) : c.n_heads;
  c.seq_len = need("context_length", 1 << 24);
  if (c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0 || c.head_size() % 2 != 0) {
    Fail("model '", path, "': embedding_length ", c.dim, " must be a multiple of head_count ", c.n_heads,
         ", head_count a multiple of head_count_kv ", c.n_kv_heads, ", and the head size even");
  }
  for (const char* k : {"attention.key_length", "attention.value_length", "rope.dimension_count"}) {
    if (const auto v = g.get_uint(a + k); v && *v != static_cast<uint64_t>(c.head_size())) {
      Fail("model '", path, "': ", a, k, " = ", *v, " differs from embedding_length / head_count = ", c.head_size(),
           " (not supported: kvq rotates and caches whole heads of dim / heads)");
    }
  }
  c.norm_eps = static_cast<float>(g.get_float(a + "attention.layer_norm_rms_epsilon").value_or(1e-5));
  if (!(c.norm_eps > 0.0f && c.norm_eps < 1.0f)) {
    Fail("model '", path, "': ", a, "attention.layer_norm_rms_epsilon = ", c.norm_eps, ", expected (0, 1)");
  }
  RopeConfig& rope = c.rope;
  rope.theta = static_cast<float>(g.get_float(a + "rope.freq_base").value_or(10000.0));
  if (!(std::isfinite(rope.theta) && rope.theta > 1.0f)) {
    Fail("model '", path, "': ", a, "rope.freq_base = ", rope.theta, ", expected a finite value > 1");
  }
  const std::string scaling = g.get_string(a + "rope.scaling.type").value_or("none");
  if (scaling == "linear") {
    rope.scaling = RopeConfig::Scaling::kLinear;
    rope.factor = static_cast<float>(g.get_float(a + "rope.scaling.factor").value_or(1.0));
  } else if (scaling != "none") {
    Fail("model '", path, "': RoPE scaling '", scaling, "' is not supported (none, linear, and Llama 3's rope_freqs are)");
  }
  if (const GgufTensor* rf = g.tensor("rope_freqs.weight")) {
    // Llama 3: per-frequency divisors; kvq holds them as Llama 3's rule, so
    // they must be that rule for some factor (the largest divisor).
    if (rf->ne.size() != 1 || rf->ne[0] != static_cast<uint64_t>(c.head_size() / 2) ||
        rf->type != static_cast<uint32_t>(ggml::WeightType::kF32)) {
      Fail("model '", path, "': rope_freqs.weight must be ", c.head_size() / 2, " F32 values");
    }
    std::vector<float> ff(static_cast<size_t>(c.head_size() / 2));
    std::memcpy(ff.data(), g.tensor_data(*rf), ff.size() * sizeof(float));
    float mx = 1.0f;
    for (float x : ff) {
      if (!(std::isfinite(x) && x >= 1.0f && x <= 1024.0f)) {
        Fail("model '", path, "': rope_freqs.weight holds ", x, ", expected factors in [1, 1024]");
      }
      mx = std::max(mx, x);
    }
    if (mx > 1.0f) {
      if (rope.scaling != RopeConfig::Scaling::kNone) Fail("model '", path, "': both rope_freqs and ", scaling, " scaling");
      rope.scaling = RopeConfig::Scaling::kLlama3;
      rope.factor = mx;
      rope.original_context = static_cast<int>(
          std::min<uint64_t>(g.get_uint(a + "rope.scaling.original_context_length").value_or(8192), 1 << 24));
      const std::vector<float> want = Llama3Factors(c.head_size(), rope);
      for (size_t i = 0; i < ff.size(); ++i) {
        if (std::fabs(ff[i] - want[i]) > 1e-4f * want[i]) {
          Fail("model '", path, "': rope_freqs.weight[", i, "] = ", ff[i], " is not Llama 3's rule (factor ", mx,
               ", low_freq_factor 1, high_freq_factor 4, original context ", rope.original_context, ": ", want[i],
               "); kvq cannot express these frequencies");
        }
      }
    }
  }
  rope.validate("model rope");

  // Tensors: every one present with its shape and a type kvq reads, before
  // anything is allocated.
  const GgufTensor* emb = g.tensor("token_embd.weight");
  if (emb == nullptr) Fail("model '", path, "': tensor 'token_embd.weight' is missing");
  if (emb->ne.size() != 2 || emb->ne[0] != static_cast<uint64_t>(c.dim) || emb->ne[1] < 1 || emb->ne[1] > (1u << 20)) {
    Fail("model '", path, "': token_embd.weight must be (", c.dim, ", vocab <= 2^20)");
  }
  c.vocab_size = static_cast<int>(emb->ne[1]);
  const GgufTensor* out_w = g.tensor("output.weight");
  c.shared_classifier = out_w == nullptr;
  c.qkv_bias = g.tensor("blk.0.attn_q.bias") != nullptr;
  if (arch == "qwen2" && !c.qkv_bias) Fail("model '", path, "': qwen2 without blk.0.attn_q.bias");
  const uint64_t dim = static_cast<uint64_t>(c.dim), hid = static_cast<uint64_t>(c.hidden_dim),
                 kv = static_cast<uint64_t>(c.kv_dim()), vocab = static_cast<uint64_t>(c.vocab_size),
                 L = static_cast<uint64_t>(c.n_layers);
  auto check = [&](const GgufTensor* t, const std::string& name, uint64_t ne0, uint64_t ne1) {
    if (t == nullptr) Fail("model '", path, "': tensor '", name, "' is missing");
    const bool ok = ne1 == 0 ? t->ne.size() == 1 && t->ne[0] == ne0
                             : t->ne.size() == 2 && t->ne[0] == ne0 && t->ne[1] == ne1;
    if (!ok) {
      std::string got;
      for (uint64_t d : t->ne) got += (got.empty() ? "" : ", ") + std::to_string(d);
      Fail("model '", path, "': tensor '", name, "' has shape (", got, "), expected (", ne0,
           ne1 ? ", " + std::to_string(ne1) : std::string(), ")");
    }
    if (!ggml::weight_type_read(t->type)) {
      Fail("model '", path, "': tensor '", name, "' is ", ggml_type_name(t->type),
           "; kvq reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and "
           "IQ4_XS weights (requantize to one of them, e.g. llama-quantize --allow-requantize in.gguf out.gguf "
           "Q4_K_M)");
    }
    return t;
  };
  // Vectors (norms, biases) are dequantised into float32; matrices stay
  // in the mapped file in their type.
  std::vector<std::pair<const GgufTensor*, uint64_t>> vecs;  // tensor, floats
  auto vec = [&](const std::string& name, uint64_t n) { vecs.emplace_back(check(g.tensor(name), name, n, 0), n); };
  for (uint64_t l = 0; l < L; ++l) vec("blk." + std::to_string(l) + ".attn_norm.weight", dim);
  for (uint64_t l = 0; l < L; ++l) vec("blk." + std::to_string(l) + ".ffn_norm.weight", dim);
  vec("output_norm.weight", dim);
  if (c.qkv_bias) {
    for (const char* b : {"attn_q", "attn_k", "attn_v"}) {
      for (uint64_t l = 0; l < L; ++l) vec("blk." + std::to_string(l) + "." + b + ".bias", b[5] == 'q' ? dim : kv);
    }
  }
  std::vector<const GgufTensor*> mats;
  std::vector<ggml::WeightMatrix> wm;
  auto mat = [&](const std::string& name, uint64_t ne0, uint64_t ne1) {
    const GgufTensor* t = check(g.tensor(name), name, ne0, ne1);
    ggml::WeightMatrix m;
    m.type = t->type;
    m.data = g.tensor_data(*t);
    m.rows = static_cast<size_t>(ne1), m.cols = static_cast<size_t>(ne0);
    m.row_bytes = static_cast<size_t>(t->bytes / ne1);  // the parser sized the tensor: whole blocks per row
    mats.push_back(t);
    wm.push_back(m);
  };
  mat("token_embd.weight", dim, vocab);
  const char* names[] = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_down", "ffn_up"};
  const uint64_t shapes[][2] = {{dim, dim}, {dim, kv}, {dim, kv}, {dim, dim}, {dim, hid}, {hid, dim}, {dim, hid}};
  for (int m = 0; m < 7; ++m) {
    for (uint64_t l = 0; l < L; ++l) mat("blk." + std::to_string(l) + "." + names[m] + ".weight", shapes[m][0], shapes[m][1]);
  }
  if (!c.shared_classifier) mat("output.weight", dim, vocab);

  uint64_t total = 0;
  for (const auto& [t, n] : vecs) total += n;  // each <= its bytes in the file (checked by the parser)
  owned_.reset(new float[static_cast<size_t>(total)]);
  float* p = owned_.get();
  std::vector<float*> at;
  for (const auto& [t, n] : vecs) {
    at.push_back(p);
    ggml::dequantize(t->type, g.tensor_data(*t), static_cast<size_t>(n), p);
    const int64_t bad = first_non_finite({p, static_cast<size_t>(n)});
    if (bad >= 0) {
      Fail("model '", path, "': tensor '", t->name, "' holds a non-finite value (", p[bad], ") at element ", bad,
           "; kvq needs finite weights");
    }
    p += n;
  }
  // A non-finite weight (in a block type: a non-finite fp16 scale) would
  // surface as a query's non-finite value deep in the forward pass; the
  // matrices' scale fields (every value of F32 / F16 / BF16) are read here.
  std::vector<int64_t> bad(wm.size(), -1);
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t k = 0; k < wm.size(); ++k) {
    const ggml::WeightMatrix& m = wm[k];
    const size_t bytes = static_cast<size_t>(ggml::weight_block_bytes(m.type));
    const int64_t b = ggml::first_non_finite_block(m.type, m.data, m.rows * m.row_bytes / bytes);
    if (b >= 0) bad[k] = b * ggml::weight_block(m.type);
  }
  for (size_t k = 0; k < wm.size(); ++k) {
    if (bad[k] >= 0) {
      Fail("model '", path, "': tensor '", mats[k]->name, "' holds a non-finite value at element ", bad[k], " (",
           ggml_type_name(mats[k]->type), ": a non-finite scale or value); kvq needs finite weights");
    }
  }
  Weights& w = weights_;
  size_t i = 0;
  w.rms_att = at[i]; i += L;
  w.rms_ffn = at[i]; i += L;
  w.rms_final = at[i++];
  float *bq = nullptr, *bk = nullptr;
  if (c.qkv_bias) {
    w.bq = bq = at[i]; i += L;
    w.bk = bk = at[i]; i += L;
    w.bv = at[i]; i += L;
  }
  size_t k = 0;
  w.token_embedding = wm[k++];
  for (std::vector<ggml::WeightMatrix>* kind : {&w.wq, &w.wk, &w.wv, &w.wo, &w.w1, &w.w2, &w.w3}) {
    kind->assign(wm.begin() + static_cast<std::ptrdiff_t>(k), wm.begin() + static_cast<std::ptrdiff_t>(k + L));
    k += L;
  }
  w.wcls = c.shared_classifier ? w.token_embedding : wm[k++];
  if (arch == "qwen2") {
    // Q and K rows (whole blocks each) copied out in kvq's RoPE order.
    size_t bytes = 0;
    for (uint64_t l = 0; l < L; ++l) bytes += w.wq[l].rows * w.wq[l].row_bytes + w.wk[l].rows * w.wk[l].row_bytes;
    permuted_.resize(bytes);
    uint8_t* out = permuted_.data();
    auto permute = [&](ggml::WeightMatrix& m, int heads) {
      NeoxToInterleaved(m.data, out, heads, c.head_size(), m.row_bytes);
      m.data = out;
      out += m.rows * m.row_bytes;
    };
    for (uint64_t l = 0; l < L; ++l) permute(w.wq[l], c.n_heads), permute(w.wk[l], c.n_kv_heads);
    for (uint64_t l = 0; l < L; ++l) {
      NeoxToInterleavedInPlace(bq + l * dim, c.n_heads, c.head_size());
      NeoxToInterleavedInPlace(bk + l * kv, c.n_kv_heads, c.head_size());
    }
  }

  // Tokenizer.
  add_bos_ = g.get_bool("tokenizer.ggml.add_bos_token").value_or(true);
  const std::string tm = g.get_string("tokenizer.ggml.model").value_or("");
  if (tm == "llama") {
    std::vector<std::string> pieces = g.string_array("tokenizer.ggml.tokens");
    if (pieces.size() != static_cast<size_t>(c.vocab_size)) {
      Fail("model '", path, "': tokenizer.ggml.tokens holds ", pieces.size(), " pieces, the model's vocabulary is ",
           c.vocab_size);
    }
    std::vector<float> scores = g.find("tokenizer.ggml.scores") ? g.float_array("tokenizer.ggml.scores")
                                                                  : std::vector<float>(pieces.size(), 0.0f);
    std::vector<int64_t> types = g.find("tokenizer.ggml.token_type") ? g.int_array("tokenizer.ggml.token_type")
                                                                       : std::vector<int64_t>(pieces.size(), 1);
    std::vector<bool> matchable(types.size());
    for (size_t k = 0; k < types.size(); ++k) matchable[k] = types[k] != 2 && types[k] != 3 && types[k] != 5;
    for (std::string& s : pieces) {  // sentencepiece's U+2581 is a space
      std::string o;
      for (size_t k = 0; k < s.size(); ++k) {
        if (s.compare(k, 3, "\xE2\x96\x81") == 0) o += ' ', k += 2;
        else o += s[k];
      }
      s = std::move(o);
    }
    const uint64_t bos = g.get_uint("tokenizer.ggml.bos_token_id").value_or(1);
    const uint64_t eos = g.get_uint("tokenizer.ggml.eos_token_id").value_or(2);
    if (bos != static_cast<uint64_t>(Tokenizer::kBos) || eos != static_cast<uint64_t>(Tokenizer::kEos)) {
      tokenizer_problem_ = "the model's sentencepiece tokenizer has BOS " + std::to_string(bos) + " and EOS " +
                           std::to_string(eos) + " (kvq's encoder needs 1 and 2): pass --tokens FILE";
    } else {
      try {
        tokenizer_ = std::make_shared<const Tokenizer>(std::move(pieces), std::move(scores), matchable, path);
      } catch (const Error& e) {
        tokenizer_problem_ = std::string(e.what()) + ": pass --tokens FILE";
      }
    }
  } else if (tm == "gpt2") {
    add_bos_ = g.get_bool("tokenizer.ggml.add_bos_token").value_or(false);
    const std::string pre = g.get_string("tokenizer.ggml.pre").value_or("default");
    const std::optional<ByteLevelBpe::Pre> p = ByteLevelBpe::parse_pre(pre);
    if (!p) {
      tokenizer_problem_ = "the model's byte-level BPE pre-tokenizer '" + pre +
                           "' (tokenizer.ggml.pre) is not one kvq implements (llama-bpe, qwen2, smollm, gpt-2): pass "
                           "pre-tokenized text with --tokens FILE (docs/eval.md: Evaluate your own model)";
    } else {
      std::vector<std::string> tokens = g.string_array("tokenizer.ggml.tokens");
      const std::vector<int64_t> types =
          g.find("tokenizer.ggml.token_type") ? g.int_array("tokenizer.ggml.token_type") : std::vector<int64_t>{};
      const std::vector<std::string> merges =
          g.find("tokenizer.ggml.merges") ? g.string_array("tokenizer.ggml.merges") : std::vector<std::string>{};
      const int V = c.vocab_size;
      auto id = [&](const char* key) -> int {
        const std::optional<uint64_t> v = g.get_uint(key);
        return v && *v < static_cast<uint64_t>(V) ? static_cast<int>(*v) : -1;
      };
      // A special id outside the vocabulary is a broken file, not "none".
      std::string bad_id;
      for (const char* k : {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"}) {
        const std::optional<uint64_t> v = g.get_uint(k);
        if (v && *v >= static_cast<uint64_t>(V) && bad_id.empty()) {
          bad_id = std::string(k) + " " + std::to_string(*v) + " is outside the vocabulary 0.." + std::to_string(V - 1);
        }
      }
      if (tokens.size() != static_cast<size_t>(V)) {
        tokenizer_problem_ = "tokenizer.ggml.tokens holds " + std::to_string(tokens.size()) +
                             " tokens, the model's vocabulary is " + std::to_string(V) + ": pass --tokens FILE";
      } else if (!bad_id.empty()) {
        tokenizer_problem_ = bad_id + ": pass --tokens FILE";
      } else {
        try {
          auto bpe = std::make_shared<const ByteLevelBpe>(std::move(tokens), types, merges, *p, "model '" + path + "'");
          std::vector<int> ends;
          for (const char* k : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"}) {
            if (id(k) >= 0) ends.push_back(id(k));
          }
          tokenizer_ = std::make_shared<const Tokenizer>(std::move(bpe), id("tokenizer.ggml.bos_token_id"), add_bos_,
                                                         std::move(ends));
        } catch (const Error& e) {
          tokenizer_problem_ = std::string(e.what()) + ": pass --tokens FILE";
        }
      }
    }
  } else {
    tokenizer_problem_ = (tm.empty() ? std::string("the model has no tokenizer")
                                     : "the model's tokenizer '" + tm + "' is not supported") +
                         ": pass --tokens FILE";
  }
  // A chat template of another type than a string is no template.
  if (const GgufValue* t = g.find("tokenizer.chat_template"); t != nullptr && t->type == GgufValueType::kString) {
    chat_template_ = t->s;
  }
  // The mapping stays: the matrices are read from it.
}

}  // namespace kvq::model
