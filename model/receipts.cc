// kvq receipts: E2's per-token residual on the model's real K/V against
// plain int8/fp8 quantization error, and quantize_cluster_outliers storage.
#include "model/receipts.h"

#include <omp.h>

#include <algorithm>
#include <optional>
#include <cmath>
#include <cstdio>
#include <unistd.h>

#include "kvq/affine.h"
#include "kvq/cluster_outliers.h"
#include "kvq/stats.h"
#include "model/eval.h"
#include "model/parallel.h"

namespace kvq::model {
namespace {

// One layer of one window.
struct WindowLayer {
  std::vector<float> residual, err_int8_k, err_int8_v, err_fp8_k, err_fp8_v;
  int clusters = 0;
  int64_t births = 0, merges = 0, outliers = 0;
  size_t bytes_membership = 0, bytes_seed = 0;
  int64_t tails = 0, tails_parametric = 0;
};

void Append(std::vector<float>& to, const Tensor& t) {
  to.insert(to.end(), t.data_as<float>(), t.data_as<float>() + t.numel());
}

WindowLayer RunLayer(const KvCache& cache, int layer, int ctx, const ReceiptOptions& o) {
  const int H = cache.n_kv_heads(), D = cache.head_dim();
  const size_t row = static_cast<size_t>(H) * static_cast<size_t>(D);
  ClusterBank bank(H, D, o.bank);
  WindowLayer w;
  for (int c0 = 0; c0 < ctx; c0 += o.chunk) {
    const int T = std::min(o.chunk, ctx - c0);
    Tensor k({T, H, D}, DType::F32), v({T, H, D}, DType::F32);
    for (int t = 0; t < T; ++t) {
      cache.read(layer, c0 + t, {k.data_as<float>() + static_cast<size_t>(t) * row, row},
                 {v.data_as<float>() + static_cast<size_t>(t) * row, row});
    }
    const BirthMergeReceipt r = bank.birth_and_merge(k, v);
    w.residual.insert(w.residual.end(), r.per_token_residual.begin(), r.per_token_residual.end());
    Append(w.err_int8_k, quantization_error_per_token(k, QuantMode::Int8));
    Append(w.err_int8_v, quantization_error_per_token(v, QuantMode::Int8));
    Append(w.err_fp8_k, quantization_error_per_token(k, QuantMode::Fp8));
    Append(w.err_fp8_v, quantization_error_per_token(v, QuantMode::Fp8));
    w.births += r.births;
    w.merges += r.merges;
    // Seed rule: the receipt's clusters as they are.
    w.bytes_seed += total_size_bytes(quantize_cluster_outliers(r.per_cluster_outlier_tokens, k, v));
    // Membership: every cluster with tokens in this chunk gets an entry (an
    // empty outlier set where it flagged none), so the tails cover the chunk.
    OutlierTokens all;
    for (int id : r.assignments) {
      if (all.count(id)) continue;
      auto it = r.per_cluster_outlier_tokens.find(id);
      if (it != r.per_cluster_outlier_tokens.end()) {
        all.emplace(id, OutlierTokenSet{it->second.k.Copy(), it->second.v.Copy(), it->second.indices});
        w.outliers += static_cast<int64_t>(it->second.indices.size());
      } else {
        all.emplace(id, OutlierTokenSet{Tensor({0, H, D}, DType::F32), Tensor({0, H, D}, DType::F32), {}});
      }
    }
    const auto qm = quantize_cluster_outliers(all, k, v, QuantMode::Int8, GaussianEstimator(), 0,
                                              std::span<const int>(r.assignments));
    w.bytes_membership += total_size_bytes(qm) + static_cast<size_t>(T);  // + 1 byte/token of assignment
    for (const auto& [id, q] : qm) {
      for (const auto* tail : {&q.tail_k, &q.tail_v}) {
        if (!*tail) continue;
        ++w.tails;
        w.tails_parametric += (*tail)->path == TailPath::Parametric;
      }
    }
  }
  w.clusters = bank.num_clusters();
  return w;
}

}  // namespace

ReceiptReport run_receipts(const ReceiptOptions& o) {
  KVQ_CHECK_ARG(o.chunk >= 1, "chunk: expected >= 1, got ", o.chunk);
  KVQ_CHECK_ARG(o.threads >= 0 && o.threads <= kMaxThreads, "threads: expected 0..", kMaxThreads, " (0: default), got ",
                o.threads);
  KVQ_CHECK_ARG(o.bank.max_clusters <= 256, "max_clusters: expected <= 256 (assignments are stored as one byte), got ",
                o.bank.max_clusters);
  Checkpoint ckpt(o.model_path);
  const Config& cfg = ckpt.config();
  { ClusterBank check(cfg.n_kv_heads, cfg.head_size(), o.bank); }  // validates the bank options up front
  const EvalText text = load_eval_text(ckpt, o.tokenizer_path, o.text_path, "", o.ctx, o.max_windows, o.story_sep);
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  const int L = cfg.n_layers;
  std::vector<WindowLayer> per(static_cast<size_t>(text.windows) * static_cast<size_t>(L));
  const bool tty = o.progress && isatty(fileno(stderr));
  int done = 0;
  { Transformer check(ckpt, KvScheme::Fp32, text.ctx); }  // geometry, before any thread starts
  ParallelErrors errors;
#pragma omp parallel num_threads(threads)
  {
    std::optional<Transformer> tf;  // every thread reaches the loop, failed or not
    errors.run([&] { tf.emplace(ckpt, KvScheme::Fp32, text.ctx); });
#pragma omp for schedule(dynamic, 1)
    for (int w = 0; w < text.windows; ++w) errors.run([&] {
      if (!tf) return;
      tf->forward_window({text.window(w), static_cast<size_t>(text.ctx)});
      for (int l = 0; l < L; ++l)
        per[static_cast<size_t>(w) * static_cast<size_t>(L) + static_cast<size_t>(l)] =
            RunLayer(tf->cache(), l, text.ctx, o);
      if (tty) {
#pragma omp critical(kvq_progress)
        std::fprintf(stderr, "\r[kvq receipts] window %d/%d", ++done, text.windows);
      }
    });
  }
  if (tty) std::fprintf(stderr, "\n");
  errors.rethrow();

  ReceiptReport rep;
  rep.model_path = o.model_path;
  rep.text_path = o.text_path;
  rep.config = cfg;
  rep.ctx = text.ctx;
  rep.windows = text.windows;
  rep.chunk = o.chunk;
  rep.threads = threads;
  rep.bank = o.bank;
  const double fp32_bpt = 2.0 * cfg.kv_dim() * sizeof(float);
  for (int l = 0; l < L; ++l) {
    LayerReceipt lr;
    lr.layer = l;
    WindowLayer pooled;
    int64_t tails = 0, parametric = 0;
    for (int w = 0; w < text.windows; ++w) {  // window order: thread count never changes the result
      const WindowLayer& x = per[static_cast<size_t>(w) * static_cast<size_t>(L) + static_cast<size_t>(l)];
      for (auto [to, from] : {std::pair{&pooled.residual, &x.residual}, std::pair{&pooled.err_int8_k, &x.err_int8_k},
                              std::pair{&pooled.err_int8_v, &x.err_int8_v}, std::pair{&pooled.err_fp8_k, &x.err_fp8_k},
                              std::pair{&pooled.err_fp8_v, &x.err_fp8_v}})
        to->insert(to->end(), from->begin(), from->end());
      lr.clusters_mean += x.clusters;
      lr.clusters_max = std::max(lr.clusters_max, x.clusters);
      lr.births += x.births;
      lr.merges += x.merges;
      lr.outliers += x.outliers;
      lr.bytes_per_token_membership += static_cast<double>(x.bytes_membership);
      lr.bytes_per_token_seed += static_cast<double>(x.bytes_seed);
      tails += x.tails;
      parametric += x.tails_parametric;
    }
    lr.tokens = static_cast<int64_t>(pooled.residual.size());
    lr.clusters_mean /= text.windows;
    lr.bytes_per_token_membership /= static_cast<double>(lr.tokens);
    lr.bytes_per_token_seed /= static_cast<double>(lr.tokens);
    lr.fp32_bytes_per_token = fp32_bpt;
    lr.tails_parametric_pct = tails ? 100.0 * static_cast<double>(parametric) / static_cast<double>(tails) : 0.0;
    double s = 0;
    for (float r : pooled.residual) s += r;
    lr.mean_residual = s / static_cast<double>(lr.tokens);
    lr.rho_int8_k = spearman(pooled.residual, pooled.err_int8_k);
    lr.rho_int8_v = spearman(pooled.residual, pooled.err_int8_v);
    lr.rho_fp8_k = spearman(pooled.residual, pooled.err_fp8_k);
    lr.rho_fp8_v = spearman(pooled.residual, pooled.err_fp8_v);
    rep.layers.push_back(lr);
  }
  return rep;
}

std::string format_receipts(const ReceiptReport& r) {
  std::string out;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "model: %s (dim %d, %d layers, %d kv heads x %d)\n"
                "text: %s: %d windows of ctx %d, chunks of %d tokens, one bank per layer and window, %d threads\n"
                "bank: max_clusters %d, birth_distance %g, merge_distance %g, outlier_top_k %d, ridge %g, closure %s\n\n",
                r.model_path.c_str(), r.config.dim, r.config.n_layers, r.config.n_kv_heads, r.config.head_size(),
                r.text_path.c_str(), r.windows, r.ctx, r.chunk, r.threads, r.bank.max_clusters, r.bank.birth_distance,
                r.bank.merge_distance, r.bank.outlier_top_k, r.bank.ridge, far_field_closure_name(r.bank.closure));
  out += buf;
  out +=
      "| layer | clusters (mean/max) | births | merges | outliers % | mean residual | rho int8 K | rho int8 V | "
      "rho fp8 K | rho fp8 V | B/token (membership) | B/token (seed rule) | fp32 B/token | tails parametric % |\n"
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const LayerReceipt& l : r.layers) {
    std::snprintf(buf, sizeof buf,
                  "| %d | %.2f / %d | %lld | %lld | %.2f | %.4g | %+.3f | %+.3f | %+.3f | %+.3f | %.1f | %.1f | %.0f | "
                  "%.1f |\n",
                  l.layer, l.clusters_mean, l.clusters_max, static_cast<long long>(l.births),
                  static_cast<long long>(l.merges), 100.0 * static_cast<double>(l.outliers) / static_cast<double>(l.tokens),
                  l.mean_residual, l.rho_int8_k, l.rho_int8_v, l.rho_fp8_k, l.rho_fp8_v, l.bytes_per_token_membership,
                  l.bytes_per_token_seed, l.fp32_bytes_per_token, l.tails_parametric_pct);
    out += buf;
  }
  return out;
}

}  // namespace kvq::model
