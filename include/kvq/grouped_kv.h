// Low-bit grouped KV caches (issue 18): keys per channel taken before RoPE
// (RoPE is applied when attention reads them), values per channel, both in
// groups of G consecutive tokens, with an exact recent window and sinks.
//
// A scheme is named k<Bk>v<Bv>g<G>[r<R>][s<S>], e.g. k4v3g64r16:
//   Bk, Bv  bits per key / value code, 2..8 (uniform, asymmetric)
//   G       tokens per group, a multiple of 16 (one K tile) up to 1024
//   R       the last R tokens are always read exact (default 0)
//   S       the first S tokens (sinks) are always read exact (default 0)
// Named presets (grouped_kv_presets()) expand to such names.
//
// What a cache of T tokens holds (per layer, K and V alike): tokens [S,
// coded_end(T)) in complete groups of codes, where coded_end(T) = S + G *
// floor(max(0, T - R - S) / G) (a group is read from its codes once its
// last token is R tokens old), and every other token exact, as fp16 (keys
// after RoPE). Per group, channel c (= head * head_dim + i) stores lo_c and
// step_c as fp16 (lo rounded down and step up, so [lo, lo + step (2^B - 1)]
// covers the group) and the code of token t is
//   q = clamp(rne((x - lo) / step), 0, 2^B - 1),  x^ = lo + step * q.
// A channel whose values are all equal to lo has step 0 and codes 0.
//
// Bits (honest, SPEC-style): every stored bit counts, the fp16 group
// parameters, the codes and the exact fp16 tokens: bits(T) = stored bits /
// (2 T n_kv_heads head_dim), and steady_state_bits(ctx) is its mean over
// T = ctx - 127 .. ctx (grouped schemes are cheaper right after a group
// completes; the mean is what a long decode pays).
//
// Layout of one layer's codes, K and V apart, head-major: head h, group g at
// (h * max_groups + g) * group_bytes: lo[head_dim] | step[head_dim] (fp16)
// then the codes.
//   K (tiles, lanes = tokens): tile j of 16 tokens, channel i: 2 B bytes at
//     4 head_dim + (j head_dim + i) 2 B, token 16 j + l's code at bits
//     [B l, B l + B) (little-endian).
//   V (rows, lanes = channels): token u's head_dim codes in head_dim B / 8
//     bytes at 4 head_dim + u head_dim B / 8, channel i at bits [B i, B i + B).
// The exact tokens live in an fp16 KvCache (kv_scheme.h) of every position
// (so a past step can be replayed, see write()); bytes() counts only what a
// streaming store keeps: the exact tokens S + T - coded_end(T).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvq/attention.h"
#include "kvq/kv_scheme.h"

namespace kvq {

struct GroupedKvScheme {
  int k_bits = 4, v_bits = 4;
  int group = 64;
  int recent = 0;
  int sinks = 0;
  // Canonical name, k<Bk>v<Bv>g<G>[r<R>][s<S>].
  std::string name() const;
  // Tokens read from codes when the cache holds T tokens (see above).
  int64_t coded_end(int64_t T) const;
  // Stored bits for T tokens divided by the 2 T E elements (E = per-token
  // elements of K, n_kv_heads * head_dim; bits do not depend on E).
  double bits(int64_t T) const;
  // Mean of bits(T) over T = max(1, ctx - 127) .. ctx.
  double steady_state_bits(int64_t ctx) const;
  // Throws kvq::Error naming `arg` unless every field is in range.
  void validate(const char* arg = "kv") const;
};

// A name (k4v3g64r16) or a preset name; throws kvq::Error naming `arg`.
GroupedKvScheme parse_grouped_kv_scheme(const std::string& name, const char* arg = "kv");
// Whether `name` is a grouped scheme or preset name (parse would succeed).
bool is_grouped_kv_scheme(const std::string& name);
// Presets, best measured pair per bit budget: (preset name, scheme).
const std::vector<std::pair<std::string, GroupedKvScheme>>& grouped_kv_presets();

// RoPE as llama2.c applies it: pairs (2p, 2p + 1) of each head rotated by
// angle pos * 10000^(-2p / head_dim), the angle computed in float. One
// table, shared by the model's forward pass and the grouped cache.
class RopeTable {
 public:
  // Throws kvq::Error unless max_seq >= 1 and head_dim is even and >= 2.
  RopeTable(int max_seq, int head_dim);
  int max_seq() const { return max_seq_; }
  int head_dim() const { return head_dim_; }
  const float* cos(int pos) const { return cos_.data() + static_cast<size_t>(pos) * (head_dim_ / 2); }
  const float* sin(int pos) const { return sin_.data() + static_cast<size_t>(pos) * (head_dim_ / 2); }
  // Rotates n_heads heads of x (head-major) in place to position pos.
  void apply(float* x, int n_heads, int pos) const;

 private:
  int max_seq_, head_dim_;
  std::vector<float> cos_, sin_;  // (max_seq, head_dim / 2)
};

// Scalar reference of one channel's group code (tests, and the encoder):
// x[0..n) at stride `stride` -> lo, step (fp16 bits) and codes[0..n).
void encode_group_channel_ref(const float* x, int n, size_t stride, int bits, uint16_t* lo, uint16_t* step,
                              uint8_t* codes);

class GroupedKvCache {
 public:
  // Throws kvq::Error on a bad scheme or geometry (head_dim even for RoPE
  // and a multiple of 8, max_seq >= 1, n_layers, n_kv_heads >= 1).
  GroupedKvCache(const GroupedKvScheme& scheme, int n_layers, int max_seq, int n_kv_heads, int head_dim);

  const GroupedKvScheme& scheme() const { return scheme_; }
  int n_layers() const { return n_layers_; }
  int max_seq() const { return max_seq_; }
  int n_kv_heads() const { return n_kv_heads_; }
  int head_dim() const { return head_dim_; }
  const RopeTable& rope() const { return rope_; }

  // Stores token `pos` of `layer`: k before RoPE, v. Positions of a layer
  // are written in order (pos = tokens written so far), or pos = 0, which
  // starts a new sequence. When pos completes a group, the group is encoded
  // (its codes depend only on its own tokens, so a cache read at an earlier
  // length sees exactly what it saw then). Throws kvq::Error on a bad
  // layer, an out-of-order pos, a wrong length, a non-finite value or
  // |value| > 65504 (the fp16 range of the exact tokens and parameters).
  void write(int layer, int pos, std::span<const float> k_pre_rope, std::span<const float> v);
  // Tokens written to `layer` in the current sequence.
  int64_t written(int layer) const;

  // Attention of a query at position T - 1 over tokens [0, T) of `layer`, as
  // the cache holds them at length T: the sinks and the recent tokens
  // through the fp16 kernel (attention.h), the coded groups through the
  // fused grouped kernel (codes read directly, RoPE at read), parts merged
  // by log-sum-exp. q: n_heads * head_dim floats (after RoPE at T - 1).
  // threads: 0 = OpenMP default, 1 = the caller's only. Throws kvq::Error on
  // a bad argument (T outside 1..written(layer), geometry, non-finite q).
  void attend(int layer, int64_t T, std::span<const float> q, int n_heads, std::span<float> out,
              int threads = 1, float scale = 0.0f) const;
  // The coded tokens [S, coded_end(T)) alone (log-mass -inf when none).
  AttentionPart coded_part(int layer, int64_t T, std::span<const float> q, int n_heads, int threads = 1,
                           float scale = 0.0f) const;
  // Reference: every token decoded as held at length T (keys rotated with
  // the RoPE table), scores and softmax in double.
  void attend_ref(int layer, int64_t T, std::span<const float> q, int n_heads, std::span<float> out,
                  float scale = 0.0f) const;

  // Token pos of `layer` as attention reads it at length T: K after RoPE
  // (decoded codes rotated, or the exact fp16 row), V. Throws unless
  // 0 <= pos < T <= written(layer).
  void read(int layer, int64_t pos, int64_t T, std::span<float> k, std::span<float> v) const;

  // Bytes a streaming store holds at length T, all layers (codes, fp16
  // group parameters, exact fp16 tokens).
  uint64_t bytes(int64_t T) const;
  size_t group_bytes_k() const { return group_bytes_k_; }
  size_t group_bytes_v() const { return group_bytes_v_; }
  // Raw stored bytes of one group (tests): K (which = 0) or V (1).
  const uint8_t* group_data(int layer, int which, int head, int64_t group) const;
  const KvCache& exact() const { return exact_; }

 private:
  void EncodeGroup(int layer, int64_t g);
  void Check(int layer, int64_t T, std::span<const float> q, int n_heads) const;
  GroupedKvScheme scheme_;
  int n_layers_, max_seq_, n_kv_heads_, head_dim_;
  int64_t max_groups_;
  size_t group_bytes_k_, group_bytes_v_;
  RopeTable rope_;
  KvCache exact_;                      // fp16, K after RoPE
  std::vector<uint8_t> codes_;         // [layer][K heads x groups | V heads x groups]
  std::vector<float> pending_k_, pending_v_;  // [layer][G][E]: the open group, K before RoPE
  std::vector<int64_t> written_;
};

}  // namespace kvq
