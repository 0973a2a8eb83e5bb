// Static ranges from text the model generates (see calibrate.h).
#include "model/calibrate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "kvq/error.h"
#include "model/sampling.h"
#include "model/transformer.h"

namespace kvq::model {

int default_calibration_length(const Config& cfg, int tokens) { return std::min(cfg.seq_len, std::max(tokens, 512)); }

void check_calibration_options(const Config& cfg, const CalibrationOptions& o) {
  const int len = o.length > 0 ? o.length : cfg.seq_len;
  KVQ_CHECK_ARG(o.sequences >= 1 && o.sequences <= 100000, "calibration sequences: expected 1..100000, got ",
                o.sequences);
  KVQ_CHECK_ARG(len >= 1 && len <= cfg.seq_len, "calibration length: expected 1..", cfg.seq_len, ", got ", o.length);
  KVQ_CHECK_ARG(std::isfinite(o.temperature) && o.temperature > 0.0 && o.temperature <= 100.0,
                "calibration temperature: expected (0, 100], got ", o.temperature);
  KVQ_CHECK_ARG(o.clip >= 0.0 && o.clip < 0.25, "ranges: clip must be in [0, 0.25), got ", o.clip);
}

StaticRanges calibrate_static_ranges(const Checkpoint& ckpt, const CalibrationOptions& o) {
  const Config& cfg = ckpt.config();
  check_calibration_options(cfg, o);
  const int len = o.length > 0 ? o.length : cfg.seq_len;
  const size_t L = static_cast<size_t>(cfg.n_layers), E = static_cast<size_t>(cfg.kv_dim());
  // Samples at (sequence, position): what the observers of the sequences
  // (side by side or one after the other) write.
  const size_t per_layer = static_cast<size_t>(o.sequences) * static_cast<size_t>(len) * E;
  std::vector<std::vector<float>> k(L, std::vector<float>(per_layer)), v(L, std::vector<float>(per_layer));
  // Query energy per KV head channel: E |q_pair|^2 / 2 over the query heads
  // of its GQA group (RoPE keeps a pair's norm, so any rotation serves).
  const int hd = cfg.head_size(), rep = cfg.n_heads / cfg.n_kv_heads;
  const int width = o.batched ? std::min(o.sequences, 16) : 1;
  std::vector<std::vector<double>> qe(static_cast<size_t>(width), std::vector<double>(L * E, 0.0));
  // K as a grouped cache holds it: in the tile frame, R(t0)^T k with t0 the
  // start of its 16-token tile (grouped_kv.h).
  const RopeTable rope(len, hd, cfg.rope);
  std::vector<std::unique_ptr<Transformer>> tfs;
  std::vector<int> seq_of(static_cast<size_t>(width));  // the sequence each Transformer runs now
  for (int b = 0; b < width; ++b) {
    tfs.push_back(std::make_unique<Transformer>(ckpt, KvScheme::Fp32, len));
    tfs.back()->set_kv_observer([&, b](int layer, int pos, std::span<const float> qp, std::span<const float> kp,
                                       std::span<const float> vp) {
      const size_t l = static_cast<size_t>(layer);
      const size_t at = (static_cast<size_t>(seq_of[static_cast<size_t>(b)]) * static_cast<size_t>(len) +
                         static_cast<size_t>(pos)) * E;
      float* kt = k[l].data() + at;
      std::copy(kp.begin(), kp.end(), kt);
      const int t0 = pos - pos % 16;
      rope_rotate(kt, cfg.n_kv_heads, hd, rope.cos(t0), rope.sin(t0), /*transpose=*/true);
      std::copy(vp.begin(), vp.end(), v[l].data() + at);
      double* e = qe[static_cast<size_t>(b)].data() + l * E;
      for (int qh = 0; qh < cfg.n_heads; ++qh) {
        const float* qv = qp.data() + static_cast<size_t>(qh) * static_cast<size_t>(hd);
        for (int i = 0; i < hd; ++i) {
          const int p0 = i - i % 2;
          e[static_cast<size_t>((qh / rep) * hd + i)] += 0.5 * (qv[p0] * qv[p0] + qv[p0 + 1] * qv[p0 + 1]);
        }
      }
    });
  }
  const uint64_t seed = o.seed ? o.seed : 0x9E3779B97F4A7C15ull;
  // The model's BOS (a GGUF's byte-level BPE names its own, e.g. Llama 3's 128000).
  const int bos = ckpt.tokenizer() != nullptr ? ckpt.tokenizer()->bos_id() : Tokenizer::kBos;
  if (!o.batched) {
    uint64_t rng = seed;
    for (int s = 0; s < o.sequences; ++s) {
      seq_of[0] = s;
      int token = bos;
      for (int pos = 0; pos < len; ++pos) token = sample_token(tfs[0]->forward(token, pos), o.temperature, rng);
    }
  } else {
    for (int s0 = 0; s0 < o.sequences; s0 += width) {
      const int n = std::min(width, o.sequences - s0);
      std::vector<Transformer*> seqs;
      std::vector<uint64_t> rngs;
      for (int b = 0; b < n; ++b) {
        seq_of[static_cast<size_t>(b)] = s0 + b;
        seqs.push_back(tfs[static_cast<size_t>(b)].get());
        uint64_t z = seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(s0 + b + 1);  // splitmix64
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        rngs.push_back((z ^ (z >> 31)) | 1);
      }
      std::vector<int> tokens(static_cast<size_t>(n), bos);
      const size_t V = static_cast<size_t>(cfg.vocab_size);
      for (int pos = 0; pos < len; ++pos) {
        const std::span<const float> logits = Transformer::forward_many(seqs, tokens, pos);
        for (size_t b = 0; b < static_cast<size_t>(n); ++b) {
          tokens[b] = sample_token(logits.subspan(b * V, V), o.temperature, rngs[b]);
        }
      }
    }
  }
  for (size_t b = 1; b < qe.size(); ++b) {
    for (size_t i = 0; i < L * E; ++i) qe[0][i] += qe[b][i];
  }
  StaticRanges r = StaticRanges::from_samples(k, v, cfg.n_kv_heads, cfg.head_size(), o.clip);
  // K weights: query energy times the mean squared range of the channel
  // over windows of kWindow consecutive tokens (what a group's step sees).
  constexpr int kWindow = 64;
  const double n_q = static_cast<double>(o.sequences) * len * rep;
  r.k_weight.assign(L * E, 0.0f);
  for (size_t l = 0; l < L; ++l) {
    for (size_t c = 0; c < E; ++c) {
      double sum = 0;
      int64_t windows = 0;
      for (int s = 0; s < o.sequences; ++s) {
        for (int t0 = 0; t0 + std::min(kWindow, len) <= len; t0 += kWindow) {
          float mn = std::numeric_limits<float>::infinity(), mx = -mn;
          for (int t = t0; t < std::min(t0 + kWindow, len); ++t) {
            const float x = k[l][(static_cast<size_t>(s) * static_cast<size_t>(len) + static_cast<size_t>(t)) * E + c];
            mn = std::min(mn, x), mx = std::max(mx, x);
          }
          sum += static_cast<double>(mx - mn) * (mx - mn);
          ++windows;
        }
      }
      r.k_weight[l * E + c] = static_cast<float>(qe[0][l * E + c] / n_q * sum / static_cast<double>(std::max<int64_t>(1, windows)));
    }
  }
  return r;
}

}  // namespace kvq::model
