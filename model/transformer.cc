// The llama2.c forward pass in fp32 with the K/V cache behind a KvScheme,
// windowed attention and the E2 bank (checkpoints: checkpoint.cc, gguf_model.cc; the tokenizer: tokenizer.cc).
#include "model/transformer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include <cblas.h>
#include <omp.h>

#include "kvq/error.h"

namespace kvq::model {

// ---- Transformer ----------------------------------------------------------

namespace {

void RmsNorm(float* o, const float* x, const float* weight, int n, float eps) {
  float ss = 0.0f;
  for (int j = 0; j < n; ++j) ss += x[j] * x[j];
  ss /= static_cast<float>(n);
  ss += eps;
  ss = 1.0f / std::sqrt(ss);
  for (int j = 0; j < n; ++j) o[j] = weight[j] * (ss * x[j]);
}

// out[i] = sum_j w[i, j] * x[j]: for F32 / F16 / BF16 matrices summed in
// order j = 0..n-1 (the llama2.c order), so that the batched version below
// gives identical bits; for the quantized block types through the fused
// dequantise-and-dot (kvq/ggml_weights.h: 16 partial sums), which MatMul
// calls too.
void MatVec(float* out, const float* x, const ggml::WeightMatrix& w) {
  if (ggml::fused_type(w.type)) {
    // A quantized matrix: the fused kernel, its rows shared by the threads
    // unless the caller already runs on a parallel region.
    const int64_t rows = static_cast<int64_t>(w.rows), per = 64;
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && w.rows * w.cols >= (size_t{1} << 20))
    for (int64_t a = 0; a < rows; a += per) {
      const size_t b = static_cast<size_t>(std::min(rows, a + per));
      ggml::matvec_fused(w, x, static_cast<size_t>(a), b, out + a);
    }
    return;
  }
  // Rows a block of kRows at a time, each still summed in order j: kRows
  // independent chains where one row's chain waits on every add (4 cycles
  // each), the same bits as dot_row's. Blocks shared by the threads as above.
  constexpr size_t kRows = 8;
  const size_t n = w.cols, blocks = w.rows / kRows;
  const float* f32 = w.f32();
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && w.rows * w.cols >= (size_t{1} << 20))
  for (int64_t blk = 0; blk < static_cast<int64_t>(blocks); ++blk) {
    const size_t i = static_cast<size_t>(blk) * kRows;
    thread_local std::vector<float> buf;  // an F16 / BF16 block as float32
    const float* rows = f32 != nullptr ? f32 + i * n : nullptr;
    if (rows == nullptr) {
      if (buf.size() < kRows * n) buf.resize(kRows * n);
      ggml::dequantize_rows(w, i, i + kRows, buf.data());
      rows = buf.data();
    }
    float acc[kRows] = {};
    for (size_t j = 0; j < n; ++j) {
      const float xj = x[j];
      for (size_t r = 0; r < kRows; ++r) acc[r] += rows[r * n + j] * xj;
    }
    for (size_t r = 0; r < kRows; ++r) out[i + r] = acc[r];
  }
  for (size_t i = blocks * kRows; i < w.rows; ++i) out[i] = ggml::dot_row(w, i, x);
}

// out[t] = w x[t] for T rows through the integer path (kvq/ggml_weights.h:
// matmul_int): each row rounded once to the matrix's 8-bit block format in
// xq, the weight rows shared by the threads as MatVec shares them; each
// row's numbers are the same whatever T.
void MatMulInt8(float* out, const float* x, const ggml::WeightMatrix& w, int T, std::vector<uint8_t>& xq) {
  const size_t bytes = ggml::activation_bytes(w.type, w.cols), uT = static_cast<size_t>(T);
  if (xq.size() < uT * bytes) xq.resize(uT * bytes);
  for (size_t t = 0; t < uT; ++t) ggml::quantize_activation(w.type, x + t * w.cols, w.cols, xq.data() + t * bytes);
  // One call a thread (a call converts the activation rows' block scales
  // once for all its weight rows), each a contiguous range of whole 64-row
  // blocks.
  const bool par = !omp_in_parallel() && uT * w.rows * w.cols >= (size_t{1} << 20);
  const int parts = par ? omp_get_max_threads() : 1;
  const size_t per = (w.rows + 64 * static_cast<size_t>(parts) - 1) / (64 * static_cast<size_t>(parts)) * 64;
  const uint8_t* q = xq.data();
#pragma omp parallel for schedule(static) num_threads(parts) if (par)
  for (int p = 0; p < parts; ++p) {
    const size_t a = std::min(w.rows, static_cast<size_t>(p) * per), b = std::min(w.rows, a + per);
    if (a < b) ggml::matmul_int(w, q, uT, a, b, out + a, w.rows);
  }
}

// Calls fn(r0, r1, rows) for blocks of w's rows as float32: an F32 matrix
// in one block from where it lies; any other type dequantised into buf, at
// most kBlockFloats values a block (threads share the work unless the
// caller already runs on a parallel region), so a quantized model never
// holds a whole matrix in float32.
constexpr size_t kBlockFloats = size_t{1} << 24;  // 64 MiB
template <class F>
void ForRowBlocks(const ggml::WeightMatrix& w, std::vector<float>& buf, F&& fn) {
  if (const float* f = w.f32()) return fn(size_t{0}, w.rows, f);
  const size_t step = std::max<size_t>(1, std::min(w.rows, kBlockFloats / w.cols));
  if (buf.size() < step * w.cols) buf.resize(step * w.cols);
  for (size_t r0 = 0; r0 < w.rows; r0 += step) {
    const size_t r1 = std::min(w.rows, r0 + step);
    const int64_t rows = static_cast<int64_t>(r1 - r0);
    const int64_t per = std::max<int64_t>(1, (int64_t{1} << 14) / static_cast<int64_t>(w.cols));  // ~64 KiB a task
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && rows * static_cast<int64_t>(w.cols) >= (int64_t{1} << 18))
    for (int64_t a = 0; a < rows; a += per) {
      const size_t b = static_cast<size_t>(std::min(rows, a + per));
      ggml::dequantize_rows(w, r0 + static_cast<size_t>(a), r0 + b, buf.data() + static_cast<size_t>(a) * w.cols);
    }
    fn(r0, r1, buf.data());
  }
}

// out[t, i] = sum_j w[i, j] * x[t, j] for T tokens, each sum in the same
// order as MatVec. Tokens are processed in blocks of kTB with x transposed so
// the innermost loop runs across tokens (independent sums, vectorisable).
void MatMul(float* out, const float* x, const ggml::WeightMatrix& w, int T, std::vector<float>& buf) {
  if (ggml::fused_type(w.type)) {  // each token as MatVec reads it
    for (int t = 0; t < T; ++t) MatVec(out + static_cast<size_t>(t) * w.rows, x + static_cast<size_t>(t) * w.cols, w);
    return;
  }
  constexpr int kTB = 16;
  const int n = static_cast<int>(w.cols), d = static_cast<int>(w.rows);
  std::vector<float> xt(static_cast<size_t>(n) * kTB);
  ForRowBlocks(w, buf, [&](size_t r0, size_t r1, const float* rows) {
    for (int t0 = 0; t0 < T; t0 += kTB) {
      const int tb = std::min(kTB, T - t0);
      for (int j = 0; j < n; ++j) {
        for (int t = 0; t < kTB; ++t) {
          xt[static_cast<size_t>(j) * kTB + static_cast<size_t>(t)] =
              t < tb ? x[static_cast<size_t>(t0 + t) * static_cast<size_t>(n) + static_cast<size_t>(j)] : 0.0f;
        }
      }
      for (size_t i = r0; i < r1; ++i) {
        const float* row = rows + (i - r0) * static_cast<size_t>(n);
        float acc[kTB] = {};
        for (int j = 0; j < n; ++j) {
          const float wj = row[j];
          const float* xj = xt.data() + static_cast<size_t>(j) * kTB;
          for (int t = 0; t < kTB; ++t) acc[t] += wj * xj[t];
        }
        for (int t = 0; t < tb; ++t) out[static_cast<size_t>(t0 + t) * static_cast<size_t>(d) + i] = acc[t];
      }
    }
  });
}

// out[t, i] = sum_j w[i, j] * x[t, j] by the BLAS (sgemm; its own
// summation order); out has ldo floats per token.
void Gemm(float* out, const float* x, const float* w, int T, int n, int d, int ldo) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, d, n, 1.0f, x, n, w, n, 0.0f, out, ldo);
}
void Gemm(float* out, const float* x, const float* w, int T, int n, int d) { Gemm(out, x, w, T, n, d, d); }

// Gemm over a matrix of any type, a block of rows at a time into its
// columns of out.
void Gemm(float* out, const float* x, const ggml::WeightMatrix& w, int T, std::vector<float>& buf) {
  const int n = static_cast<int>(w.cols), d = static_cast<int>(w.rows);
  ForRowBlocks(w, buf, [&](size_t r0, size_t r1, const float* rows) {
    Gemm(out + r0, x, rows, T, n, static_cast<int>(r1 - r0), d);
  });
}

void AddBias(float* x, const float* b, int T, int width) {
  if (b == nullptr) return;
  for (int t = 0; t < T; ++t) {
    float* r = x + static_cast<size_t>(t) * static_cast<size_t>(width);
    for (int i = 0; i < width; ++i) r[i] += b[i];
  }
}

}  // namespace

std::shared_ptr<const TokenTable> layer0_token_table(const Checkpoint& ckpt) {
  Checkpoint::TokenTableSlot& slot = ckpt.token_table_slot();
  std::lock_guard<std::mutex> lock(slot.mu);
  if (slot.table) return slot.table;
  const Config& cfg = ckpt.config();
  const Weights& w = ckpt.weights();
  const int dim = cfg.dim, kv = cfg.kv_dim(), V = cfg.vocab_size;
  constexpr int kChunk = 256;  // ids a pass (each id's numbers do not depend on its chunk's others)
  std::vector<float> k(static_cast<size_t>(V) * kv), v(k.size()), x(static_cast<size_t>(kChunk) * dim),
      xb(x.size()), buf;
  for (int a = 0; a < V; a += kChunk) {
    const int n = std::min(kChunk, V - a);
    ggml::dequantize_rows(w.token_embedding, static_cast<size_t>(a), static_cast<size_t>(a + n), x.data());
    for (int t = 0; t < n; ++t) {
      const size_t o = static_cast<size_t>(t) * static_cast<size_t>(dim);
      RmsNorm(xb.data() + o, x.data() + o, w.rms_att, dim, cfg.norm_eps);
    }
    float* ko = k.data() + static_cast<size_t>(a) * kv;
    float* vo = v.data() + static_cast<size_t>(a) * kv;
    Gemm(ko, xb.data(), w.wk[0], n, buf);
    Gemm(vo, xb.data(), w.wv[0], n, buf);
    if (w.bk != nullptr) AddBias(ko, w.bk, n, kv), AddBias(vo, w.bv, n, kv);
  }
  slot.table = std::make_shared<const TokenTable>(V, cfg.n_kv_heads, cfg.head_size(), k, v);
  return slot.table;
}

std::shared_ptr<const TokenTable> cache_token_table(const Checkpoint& ckpt, const std::string& scheme) {
  const Config& cfg = ckpt.config();
  if (describe_kv_scheme(scheme, "kv", cfg.head_size()).token_layer) return layer0_token_table(ckpt);
  if (grouped_kv_preset(scheme, cfg.head_size()) && presets_take_token_table(cfg)) return layer0_token_table(ckpt);
  return nullptr;
}

std::string resolved_cache_scheme(const Checkpoint& ckpt, const CacheScheme& scheme, int max_seq) {
  const Config& cfg = ckpt.config();
  if (grouped_kv_preset(scheme.name, cfg.head_size())) {
    return *resolve_kv_preset(scheme.name, cfg.n_layers, max_seq, cfg.n_kv_heads, cfg.head_size(),
                              cache_token_table(ckpt, scheme.name).get());
  }
  return scheme.info(cfg.head_size()).name;
}

bool presets_take_token_table(const Config& cfg) {
  return cfg.n_layers >= 2 && 4.0 * cfg.vocab_size * static_cast<double>(cfg.kv_dim()) <= kPresetTokenTableBytes;
}

namespace {
int CheckedMaxSeq(int max_seq, const Config& cfg) {
  KVQ_CHECK_ARG(max_seq > 0 && max_seq <= cfg.seq_len, "max_seq: expected 1..", cfg.seq_len,
                " (the model's seq_len), got ", max_seq);
  return max_seq;
}
}  // namespace

Transformer::Transformer(const Checkpoint& ckpt, const CacheScheme& scheme, int max_seq, const WindowPolicy& policy)
    : Transformer(ckpt,
                  KvCache(scheme.name, ckpt.config().n_layers, CheckedMaxSeq(max_seq, ckpt.config()),
                          ckpt.config().n_kv_heads, ckpt.config().head_size(), scheme.ranges.get(),
                          ckpt.config().rope, cache_token_table(ckpt, scheme.name)),
                  policy) {}

Transformer::Transformer(const Checkpoint& ckpt, KvCache cache, const WindowPolicy& policy)
    : cfg_(ckpt.config()),
      w_(ckpt.weights()),
      cache_(std::move(cache)),
      rope_(CheckedMaxSeq(cache_.max_seq(), ckpt.config()), ckpt.config().head_size(), ckpt.config().rope),
      max_seq_(cache_.max_seq()),
      policy_(policy) {
  KVQ_CHECK_ARG(cache_.n_layers() == cfg_.n_layers && cache_.n_kv_heads() == cfg_.n_kv_heads &&
                    cache_.head_dim() == cfg_.head_size(),
                "cache: ", cache_.n_layers(), " layers x ", cache_.n_kv_heads(), " heads x ", cache_.head_dim(),
                ", the model has ", cfg_.n_layers, " x ", cfg_.n_kv_heads, " x ", cfg_.head_size());
  KVQ_CHECK_ARG(cache_.rope().canonical() == cfg_.rope.canonical(), "cache: RoPE ", cache_.rope().describe(),
                ", the model's is ", cfg_.rope.describe());
  KVQ_CHECK_ARG(policy.window >= 0, "window: expected >= 0, got ", policy.window);
  KVQ_CHECK_ARG(policy.sinks >= 0, "sinks: expected >= 0, got ", policy.sinks);
  KVQ_CHECK_ARG(policy.chunk >= 1, "window chunk: expected >= 1, got ", policy.chunk);
  KVQ_CHECK_ARG(policy.window == 0 || cache_.any_length(), "window: windowed attention reads token ranges apart, ",
                "which the scheme ", cache_.info().label, " does not keep (a streaming grouped cache attends its ",
                "whole length; its own sinks and recent window are in the scheme name)");
  if (policy.bank) {
    KVQ_CHECK_ARG(policy.window > 0, "bank: expected a window > 0");
    ClusterBank check(cfg_.n_kv_heads, cfg_.head_size(), policy.bank_options);  // validates the options
  }
  banks_.resize(static_cast<size_t>(cfg_.n_layers));
  bytes_at_.assign(static_cast<size_t>(max_seq_), 0);
  logits_.resize(static_cast<size_t>(cfg_.vocab_size));
  const int64_t T = cache_.tokens();
  if (T > 0) {  // a restored sequence
    KVQ_CHECK_ARG(policy.window == 0, "cache: a restored cache runs without a window (window 0)");
    for (int l = 0; l < cfg_.n_layers; ++l) {
      KVQ_CHECK_ARG(cache_.written(l) == T, "cache: layer ", l, " holds ", cache_.written(l), " tokens, not ", T);
    }
    tokens_ = static_cast<int>(T);
    bytes_at_[static_cast<size_t>(T) - 1] = cache_.bytes();
  }
}

void Transformer::BankChunk(int layer, int t0, int t1) {
  LayerBank& lb = banks_[static_cast<size_t>(layer)];
  const int H = cfg_.n_kv_heads, D = cfg_.head_size(), W = cfg_.kv_dim();
  Tensor k({t1 - t0, H, D}, DType::F32), v({t1 - t0, H, D}, DType::F32);
  for (int t = t0; t < t1; ++t) {
    cache_.read(layer, t, {k.data_as<float>() + static_cast<size_t>(t - t0) * W, static_cast<size_t>(W)},
                {v.data_as<float>() + static_cast<size_t>(t - t0) * W, static_cast<size_t>(W)});
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
  if (policy_.window == 0 || T <= policy_.sinks + policy_.window) {
    DecodeAttentionOptions o;
    o.threads = attention_threads_;
    cache_.attend(layer, {q, n}, cfg_.n_heads, {out, n}, o);
    return;
  }
  std::vector<AttentionPart> parts;
  const std::span<const float> qs(q, n);
  if (policy_.sinks > 0) parts.push_back(cache_.attend_part(layer, qs, cfg_.n_heads, 0, policy_.sinks));
  if (!policy_.bank) {
    parts.push_back(cache_.attend_part(layer, qs, cfg_.n_heads, T - policy_.window, T));
  } else {
    LayerBank& lb = banks_[static_cast<size_t>(layer)];
    while (T - policy_.window - lb.banked_end >= policy_.chunk) BankChunk(layer, lb.banked_end, lb.banked_end + policy_.chunk);
    parts.push_back(cache_.attend_part(layer, qs, cfg_.n_heads, lb.banked_end, T));
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
  if (policy_.window == 0) return cache_.bytes();
  const int T = tokens_;
  const uint64_t row = T > 0 ? cache_.bytes() / static_cast<uint64_t>(T) / static_cast<uint64_t>(cfg_.n_layers) : 0;  // K and V of one token, one layer
  uint64_t total = 0;
  for (int l = 0; l < cfg_.n_layers; ++l) {
    if (T <= policy_.sinks + policy_.window) {
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
  return run({&token, 1}, pos, Pass::kToken);
}

std::span<const float> Transformer::forward_window(std::span<const int> tokens) {
  return run(tokens, 0, Pass::kWindow);
}

std::span<const float> Transformer::forward_batched(std::span<const int> tokens) {
  return run(tokens, 0, Pass::kBlas);
}

std::span<const float> Transformer::forward_window_into(Transformer& seq, std::span<const int> tokens) {
  KVQ_CHECK_ARG(&seq.w_ == &w_, "seq: expected a sequence of this checkpoint");
  return run(tokens, 0, Pass::kWindow, Logits::kAll, &seq);
}

std::span<const float> Transformer::forward_batched_into(Transformer& seq, std::span<const int> tokens) {
  KVQ_CHECK_ARG(&seq.w_ == &w_, "seq: expected a sequence of this checkpoint");
  return run(tokens, 0, Pass::kBlas, Logits::kAll, &seq);
}

std::span<const float> Transformer::prefill(std::span<const int> tokens, int pos0) {
  return prefill_into(*this, tokens, pos0);
}

std::span<const float> Transformer::prefill_into(Transformer& seq, std::span<const int> tokens, int pos0,
                                                 bool logits) {
  KVQ_CHECK_ARG(&seq.w_ == &w_, "seq: expected a sequence of this checkpoint");
  KVQ_CHECK_ARG(pos0 == 0 || pos0 == seq.tokens_, "pos0: expected 0 (a new sequence) or the sequence's length ",
                seq.tokens_, ", got ", pos0);
  return run(tokens, pos0, Pass::kBlas, logits ? Logits::kLast : Logits::kNone, &seq);
}

void Transformer::CheckRows(std::span<const Row> rows, bool at_length) const {
  KVQ_CHECK_ARG(!rows.empty(), "rows: expected at least one sequence");
  for (size_t b = 0; b < rows.size(); ++b) {
    const Transformer* s = rows[b].seq;
    KVQ_CHECK_ARG(s != nullptr && &s->w_ == &w_, "rows: expected sequences of this checkpoint");
    KVQ_CHECK_ARG(s->policy_.window == 0, "rows: several sequences run without a window");
    const int pos = rows[b].pos;
    KVQ_CHECK_ARG(pos >= 0 && pos < s->max_seq_ && (!at_length || pos == s->tokens_), "rows: sequence ", b,
                  " is at length ", s->tokens_, " of at most ", s->max_seq_, ", got position ", pos);
    for (size_t c = 0; c < b; ++c) KVQ_CHECK_ARG(rows[c].seq != s, "rows: sequence ", b, " appears twice");
  }
}

std::span<const float> Transformer::forward_rows(std::span<const SeqToken> rows) {
  CheckRows(rows, /*at_length=*/true);
  return Run(rows, rows.size() == 1 ? Pass::kToken : Pass::kBlas);
}

void Transformer::set_attention_threads(int n) {
  KVQ_CHECK_ARG(n >= 1 && n <= 1024, "threads: expected 1..1024, got ", n);
  attention_threads_ = n;
}

std::span<const float> Transformer::run(std::span<const int> tokens, int pos0, Pass pass, Logits logits,
                                        Transformer* seq) {
  if (seq == nullptr) seq = this;
  const int T = static_cast<int>(tokens.size());
  KVQ_CHECK_ARG(T > 0, "tokens: expected at least one token");
  KVQ_CHECK_ARG(pos0 >= 0 && pos0 + T <= seq->max_seq_, "pos: positions ", pos0, "..", pos0 + T - 1,
                " exceed the cache size ", seq->max_seq_);
  std::vector<Row> rows(static_cast<size_t>(T));
  for (int t = 0; t < T; ++t) rows[static_cast<size_t>(t)] = {seq, tokens[static_cast<size_t>(t)], pos0 + t};
  return Run(rows, pass, logits);
}

std::span<const float> Transformer::forward_many(std::span<Transformer* const> seqs, std::span<const int> tokens,
                                                 int pos) {
  KVQ_CHECK_ARG(!seqs.empty() && seqs.size() == tokens.size(), "tokens: expected one per sequence (", seqs.size(),
                "), got ", tokens.size());
  KVQ_CHECK_ARG(seqs[0] != nullptr, "seqs: expected sequences, got a null one");
  std::vector<Row> rows(seqs.size());
  for (size_t b = 0; b < seqs.size(); ++b) rows[b] = {seqs[b], tokens[b], pos};
  seqs[0]->CheckRows(rows, /*at_length=*/false);
  return seqs[0]->Run(rows, Pass::kBlas);
}

// Rows of one pass: each a token at a position of a sequence (one sequence's
// run of positions, or with forward_many and forward_rows several, one row
// each). This object's buffers hold the activations; each row's K/V go to
// its own sequence's cache.
std::span<const float> Transformer::Run(std::span<const Row> rows, Pass pass, Logits logits) {
  const int T = static_cast<int>(rows.size());
  for (const Row& r : rows) {
    KVQ_CHECK_ARG(r.token >= 0 && r.token < cfg_.vocab_size, "token: expected 0..", cfg_.vocab_size - 1, ", got ",
                  r.token);
  }
  Transformer& one = *rows.front().seq;  // with `single`, the sequence every row is of
  const bool single = std::all_of(rows.begin(), rows.end(), [&one](const Row& r) { return r.seq == &one; });
  const int pos0 = rows.front().pos;
  for (const Row& r : rows) {
    if (single && &r != &rows.front()) break;  // once per sequence: the length it reaches, a new sequence's banks
    Transformer& s = *r.seq;
    s.tokens_ = single ? pos0 + T : r.pos + 1;
    std::fill(s.bytes_at_.begin() + r.pos, s.bytes_at_.begin() + s.tokens_, 0);
    if (s.policy_.bank && r.pos == 0) {  // a new sequence: empty banks
      for (LayerBank& lb : s.banks_) {
        lb.bank = std::make_unique<ClusterBank>(cfg_.n_kv_heads, cfg_.head_size(), s.policy_.bank_options);
        lb.banked_end = std::min(s.policy_.sinks, s.max_seq_);
        lb.out_k.clear();
        lb.out_v.clear();
      }
    }
  }
  const int dim = cfg_.dim, hid = cfg_.hidden_dim, kv_dim = cfg_.kv_dim();
  const int vocab = cfg_.vocab_size;
  const size_t uT = static_cast<size_t>(T);
  auto ensure = [&](std::vector<float>& v, int width) {
    if (v.size() < uT * static_cast<size_t>(width)) v.resize(uT * static_cast<size_t>(width));
  };
  ensure(x_, dim), ensure(xb_, dim), ensure(xb2_, dim), ensure(q_, dim), ensure(k_, kv_dim), ensure(v_, kv_dim);
  ensure(hb_, hid), ensure(hb2_, hid);
  // A prompt's prefill computes its last token's logits only: one row (a
  // 512-token prefill of a 128K vocabulary would otherwise zero 256 MiB).
  const size_t logit_rows = logits == Logits::kAll ? uT : 1;
  if (logits_.size() < logit_rows * static_cast<size_t>(vocab)) {
    logits_.resize(logit_rows * static_cast<size_t>(vocab));
  }
  const float eps = cfg_.norm_eps;
  // The batched pass hands a layer's block to KvCache::prefill (caches read
  // at any length: rows; no window); a streaming (grouped) cache, whose bytes
  // are counted at each length as it grows, and windows keep the per-token
  // loop below.
  const bool prefill = single && pass == Pass::kBlas && one.policy_.window == 0 && one.cache_.any_length();
  std::vector<int> ids;  // the prefill's token ids (a t0+ cache's layer 0)
  if (prefill) {
    for (const Row& r : rows) ids.push_back(r.token);
  }
  auto mm = [&](float* out, const float* in, const ggml::WeightMatrix& w) {
    if (dot_ == WeightDot::kInt8 && ggml::fused_type(w.type)) {
      MatMulInt8(out, in, w, T, xq_);
    } else if (pass == Pass::kBlas) {
      Gemm(out, in, w, T, wbuf_);
    } else if (pass == Pass::kWindow) {
      MatMul(out, in, w, T, wbuf_);
    } else {
      for (int t = 0; t < T; ++t) MatVec(out + static_cast<size_t>(t) * w.rows, in + static_cast<size_t>(t) * w.cols, w);
    }
  };
  auto row = [](std::vector<float>& v, int t, int width) { return v.data() + static_cast<size_t>(t) * static_cast<size_t>(width); };

  for (int t = 0; t < T; ++t) {
    const size_t tok = static_cast<size_t>(rows[static_cast<size_t>(t)].token);
    ggml::dequantize_rows(w_.token_embedding, tok, tok + 1, row(x_, t, dim));
  }
  const size_t udim = static_cast<size_t>(dim), ukv = static_cast<size_t>(kv_dim), uhid = static_cast<size_t>(hid);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const size_t ul = static_cast<size_t>(l);
    for (int t = 0; t < T; ++t) RmsNorm(row(xb_, t, dim), row(x_, t, dim), w_.rms_att + ul * udim, dim, eps);
    mm(q_.data(), xb_.data(), w_.wq[ul]);
    mm(k_.data(), xb_.data(), w_.wk[ul]);
    mm(v_.data(), xb_.data(), w_.wv[ul]);
    if (w_.bq != nullptr) {
      AddBias(q_.data(), w_.bq + ul * udim, T, dim);
      AddBias(k_.data(), w_.bk + ul * ukv, T, kv_dim);
      AddBias(v_.data(), w_.bv + ul * ukv, T, kv_dim);
    }
    for (int t = 0; t < T; ++t) {
      const Row& r = rows[static_cast<size_t>(t)];
      r.seq->rope_.apply(row(q_, t, dim), cfg_.n_heads, r.pos);
      r.seq->rope_.apply(row(k_, t, kv_dim), cfg_.n_kv_heads, r.pos);
      if (r.seq->observer_) {
        r.seq->observer_(l, r.pos, {row(q_, t, dim), udim}, {row(k_, t, kv_dim), ukv}, {row(v_, t, kv_dim), ukv});
      }
    }
    if (prefill) {
      DecodeAttentionOptions o;
      o.threads = one.attention_threads_;
      one.cache_.prefill(l, pos0, {k_.data(), uT * ukv}, {v_.data(), uT * ukv}, {q_.data(), uT * udim}, cfg_.n_heads,
                         {xb_.data(), uT * udim}, o, ids);
    }
    // Each token's K and V go into the cache right before its query
    // attends, so a window sees the cache exactly as token-by-token
    // decoding does (a streaming cache has no other past).
    for (int t = 0; t < T && !prefill; ++t) {
      Transformer& sq = *rows[static_cast<size_t>(t)].seq;
      const int pos = rows[static_cast<size_t>(t)].pos;
      sq.cache_.write(l, pos, {row(k_, t, kv_dim), ukv}, {row(v_, t, kv_dim), ukv}, rows[static_cast<size_t>(t)].token);
      sq.bytes_at_[static_cast<size_t>(pos)] += sq.cache_.layer_bytes(l);
      sq.attention(l, pos, row(q_, t, dim), row(xb_, t, dim));
    }
    mm(xb2_.data(), xb_.data(), w_.wo[ul]);
    for (size_t i = 0; i < uT * udim; ++i) x_[i] += xb2_[i];
    for (int t = 0; t < T; ++t) RmsNorm(row(xb_, t, dim), row(x_, t, dim), w_.rms_ffn + ul * udim, dim, eps);
    mm(hb_.data(), xb_.data(), w_.w1[ul]);
    mm(hb2_.data(), xb_.data(), w_.w3[ul]);
    for (size_t i = 0; i < uT * uhid; ++i) {
      float val = hb_[i];
      val *= (1.0f / (1.0f + std::exp(-val)));
      hb_[i] = val * hb2_[i];
    }
    mm(xb_.data(), hb_.data(), w_.w2[ul]);
    for (size_t i = 0; i < uT * udim; ++i) x_[i] += xb_[i];
  }
  if (prefill) {
    for (int t = 0; t < T; ++t) one.bytes_at_[static_cast<size_t>(pos0 + t)] = one.cache_.bytes(pos0 + t + 1);
  }
  if (logits == Logits::kNone) return {};
  if (logits == Logits::kLast) {  // a prompt's prefill: only its last token's logits
    RmsNorm(xb_.data(), row(x_, T - 1, dim), w_.rms_final, dim, eps);
    if (dot_ == WeightDot::kInt8 && ggml::fused_type(w_.wcls.type)) {
      MatMulInt8(logits_.data(), xb_.data(), w_.wcls, 1, xq_);
    } else {
      MatVec(logits_.data(), xb_.data(), w_.wcls);
    }
    return {logits_.data(), static_cast<size_t>(vocab)};
  }
  for (int t = 0; t < T; ++t) RmsNorm(row(xb_, t, dim), row(x_, t, dim), w_.rms_final, dim, eps);
  mm(logits_.data(), xb_.data(), w_.wcls);
  return {logits_.data(), uT * static_cast<size_t>(vocab)};
}

const char* weight_dot_name(WeightDot d) { return d == WeightDot::kInt8 ? "int8" : "exact"; }

WeightDot parse_weight_dot(const std::string& name, const char* what) {
  if (name == "int8") return WeightDot::kInt8;
  KVQ_CHECK_ARG(name == "exact", what, ": expected exact or int8, got '", name, "'");
  return WeightDot::kExact;
}

void set_blas_threads(int n) { openblas_set_num_threads(n); }
int blas_threads() { return openblas_get_num_threads(); }

double measure_gemm_gflops(int T, int n, int d, int threads, double seconds) {
  KVQ_CHECK_ARG(T >= 1 && n >= 1 && d >= 1 && threads >= 1, "gemm: bad shape");
  set_blas_threads(1);
  std::vector<double> flops(static_cast<size_t>(threads), 0.0);
#pragma omp parallel num_threads(threads)
  {
    const int id = omp_get_thread_num();
    std::vector<float> x(static_cast<size_t>(T) * n, 0.5f), w(static_cast<size_t>(d) * n, 0.25f),
        out(static_cast<size_t>(T) * d);
    Gemm(out.data(), x.data(), w.data(), T, n, d);  // warm-up
    const auto s = std::chrono::steady_clock::now();
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count() < seconds) {
      Gemm(out.data(), x.data(), w.data(), T, n, d);
      flops[static_cast<size_t>(id)] += 2.0 * T * n * d;
    }
    // Each thread's rate after its warm-up; the threads ran side by side.
    flops[static_cast<size_t>(id)] /= std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count();
  }
  double total = 0;
  for (double f : flops) total += f;
  return total / 1e9;
}

}  // namespace kvq::model
