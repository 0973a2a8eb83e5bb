// The receipt-correlation report (issue 5, SPEC §5): the model's real K/V,
// layer by layer, fed through E2's ClusterBank in chunks, compared with
// where plain int8/fp8 quantization error is largest, and stored with
// quantize_cluster_outliers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/cluster_bank.h"
#include "model/eval.h"
#include "model/transformer.h"

namespace kvq::model {

struct ReceiptOptions {
  std::string model_path, tokenizer_path, text_path;
  std::string story_sep = kDefaultStorySep;  // empty: the whole text is one story
  int ctx = 0;          // 0: the model's seq_len
  int max_windows = 0;  // 0: all full windows
  int chunk = 128;      // tokens per birth_and_merge chunk
  int threads = 0;      // 0: OpenMP default
  ClusterBankOptions bank;
  bool progress = false;
};

// Per layer, pooled over every window (one fresh bank per window, i.e. per
// sequence; windows are independent sequences).
struct LayerReceipt {
  int layer = 0;
  double clusters_mean = 0;  // live clusters at the end of a window, mean
  int clusters_max = 0;
  int64_t births = 0, merges = 0;
  int64_t tokens = 0, outliers = 0;
  // Spearman rho between E2's per-token residual and
  // quantization_error_per_token of the chunk's K (and V), int8 and fp8.
  double rho_int8_k = 0, rho_int8_v = 0, rho_fp8_k = 0, rho_fp8_v = 0;
  double mean_residual = 0;
  // quantize_cluster_outliers storage, bytes per token (K and V together):
  // with membership (tails partition the chunk; plus 1 byte per token for
  // the assignment) and under the seed rule (every cluster's tail is the
  // whole chunk minus its outliers).
  double bytes_per_token_membership = 0, bytes_per_token_seed = 0;
  double fp32_bytes_per_token = 0;
  double tails_parametric_pct = 0;  // tail encodings (membership) that passed the KS gate
};

struct ReceiptReport {
  std::string model_path, text_path;
  Config config;
  int ctx = 0, windows = 0, chunk = 0, threads = 1;
  ClusterBankOptions bank;
  std::vector<LayerReceipt> layers;
};

ReceiptReport run_receipts(const ReceiptOptions& opts);
std::string format_receipts(const ReceiptReport& r);

}  // namespace kvq::model
