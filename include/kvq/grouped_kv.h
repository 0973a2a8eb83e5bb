// Low-bit grouped KV caches (issue 18): keys per channel taken before RoPE
// (RoPE is applied when attention reads them), values per channel, both in
// groups of G consecutive tokens, with an exact recent window and sinks.
//
// A scheme is named k<Bk>[a]v<Bv>g<G>[p8][m][o<N>[x<X>][w<W>]][r<R>][s<S>] (pieces
// below), e.g. k4v3g64r16:
//   Bk, Bv  bits per key / value code, 2..8 (uniform, asymmetric)
//   G       tokens per group, a multiple of 16 (one K tile) up to 1024
//   R       the last R tokens are always read exact (default 0)
//   S       the first S tokens (sinks) are always read exact (default 0)
// Named presets (grouped_kv_presets()) expand to such names.
//
// ...g<G>o<N>... (N = 3..8; o8 the usual) holds the open tokens (those not
// yet read from group codes: the open group and the recent window) in N-bit
// codes instead of fp16: per channel, on the previous group's range widened
// to twice its width around it (lo' = lo - w / 2, step' = 2 w / (2^N - 1),
// w = step (2^B - 1)); a unit (a token's K or V of one KV head) with any
// value outside that grid, and every token of the first group, is held in
// fp16 instead. The group is encoded
// from these held values (what a streaming store has). Bits then depend on
// the data: bytes(T) counts them. (The library keeps each code in a byte;
// bits count N.)
// ...o<N>x<X>... keeps the last X of the open tokens in fp16, and
// ...o<N>[x<X>]w<W>... (N < 8) the W before those in 8-bit codes on the same
// grid (2 w / 255 steps); a token's N-bit code is made from what the store
// holds when it leaves them (its fp16 value, or its 8-bit code's value).
// The fallback test is on the 8-bit grid when there is a w tier.
//
// ...g<G>p8... stores each group's parameters in 8 bits instead of fp16:
// per group and channel the codes a (lo, rounded down) and b (hi, rounded
// up) on a grid fixed per layer and channel from calibrated ranges
// (StaticRanges [L, H], w = H - L): base + unit * (0..255) spanning
// [L - w, H + w], base and unit fp16 values; lo = base + unit a and step =
// (unit / (2^B - 1)) (b - a) (grouped::DecodeGroupParams, shared by the
// kernel, the reader and the encoder). A group beyond the grid is clamped
// to it. Bits: 16 per group and channel for K and V each, instead of 32,
// plus the grid table (fp16 base and unit of K and V: 64 bits per channel).
//
// ...g<G>[p8]m... chooses each group channel's range as the one of least
// squared error among [mn + a w / 16, mx - b w / 16], a, b = 0..4 (w = mx -
// mn; ties: the wider), values beyond it clamped by the codes; the encoder
// alone differs (the kernel reads lo and step as always).
//
// k<Bk>a... ("allocated") spends Bk bits per key on average but not evenly:
// each head's Bk * head_dim bits go to its channels by reverse water-filling
// on calibrated weights (StaticRanges::k_weight: the channel's share of the
// score error, E|q_pair|^2 / 2 times its mean squared group range), 1..8
// bits each (allocate_channel_bits).
//
// k<Bk>v<Bv>c[r<R>][s<S>] is the calibrated (static) form: one range per
// layer and channel, fixed before the sequence (StaticRanges, e.g. measured
// on text the model generated), so every token is coded when it is written
// (no open group, no per-group parameters); the table costs 64 bits per
// channel (K and V lo and step, fp16), amortised over the tokens. Values
// outside a channel's range are clamped to it.
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
// then the codes (calibrated: groups of 16 tokens, codes only).
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
#include <tuple>
#include <utility>
#include <vector>

#include "kvq/attention.h"
#include "kvq/kv_scheme.h"

namespace kvq {

struct GroupedKvScheme {
  int k_bits = 4, v_bits = 4;
  int group = 64;           // calibrated: 16 (one K tile)
  int recent = 0;
  int sinks = 0;
  bool calibrated = false;  // static per-channel ranges (StaticRanges)
  bool k_allocated = false; // per-channel K bits from StaticRanges::k_weight
  bool params8 = false;     // p8: 8-bit group parameters on a calibrated grid
  bool mse_ranges = false;  // m: each group channel's range of least squared error (clipped ends)
  int open_bits = 16;       // dynamic: open tokens in fp16 (16) or N-bit codes (o<N>, 3..8)
  int exact_recent = 0;     // o<N>: the last X open tokens held in fp16 (x<X>)
  int wide_recent = 0;      // o<N>, N < 8: the W open tokens before those held in 8 bits (w<W>)
  bool open_coded() const { return open_bits < 16; }
  // Calibrated, allocated and p8 schemes are built from StaticRanges.
  bool needs_ranges() const { return calibrated || k_allocated || params8; }
  // Canonical name, k<Bk>[a]v<Bv>g<G>[p8][m][o<N>[x<X>][w<W>]][r<R>][s<S>] or k<Bk>[a]v<Bv>c[r<R>][s<S>].
  std::string name() const;
  // Tokens [S, coded_end(T)) are read from codes when the cache holds T
  // tokens (see above; calibrated: max(S, T - R)).
  int64_t coded_end(int64_t T) const;
  // Stored bits for T tokens divided by the 2 T E elements (E = per-token
  // elements of K, n_kv_heads * head_dim; bits do not depend on E). With
  // o<N>: as if no token fell back to fp16 (GroupedKvCache::bytes
  // counts the ones that did).
  double bits(int64_t T) const;
  // The stored bits behind bits(T): per channel, K and V together (so the
  // bytes of T tokens are stored_bits(T) * E / 8 per layer).
  int64_t stored_bits(int64_t T) const;
  // o<N>, at length T: the open tokens [o0, T), of which [o0, f1)
  // (the first group, while nothing is coded) and [x0, T) (the last x) are
  // fp16 whatever their values.
  std::tuple<int64_t, int64_t, int64_t> OpenFp16(int64_t T) const;
  // o<N>w<W>, at length T: the open tokens [wide_start(T), x0) are held in
  // 8 bits (those of the first group stay fp16).
  int64_t wide_start(int64_t T) const;
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

// Calibrated ranges of K (before RoPE) and V: for layer l and channel c =
// head * head_dim + i, [lo, hi] at index l * n_kv_heads * head_dim + c.
struct StaticRanges {
  int n_layers = 0, n_kv_heads = 0, head_dim = 0;
  std::vector<float> k_lo, k_hi, v_lo, v_hi;
  int64_t samples = 0;  // tokens the ranges were measured on
  // Per channel (same indexing), the weight of its quantization error in
  // the scores (K) for bit allocation; empty: none measured.
  std::vector<float> k_weight;

  // From samples: per layer, rows of n_kv_heads * head_dim values (K before
  // RoPE and V, equal row counts). clip: the share of each channel's
  // samples left outside its range at each end (0: min and max). Throws
  // kvq::Error on no samples, ragged input, non-finite values or clip
  // outside [0, 0.25).
  static StaticRanges from_samples(const std::vector<std::vector<float>>& k, const std::vector<std::vector<float>>& v,
                                   int n_kv_heads, int head_dim, double clip = 0.0);
  // Throws kvq::Error naming `arg` unless the geometry matches and every
  // range is finite with lo <= hi.
  void validate(int n_layers, int n_kv_heads, int head_dim, const char* arg = "ranges") const;
};

// Bits per channel minimising sum_i w_i 4^-b_i (the quantization error of
// channel i at b_i bits, uniform levels) with sum_i b_i = avg_bits * n and
// min_bits <= b_i <= max_bits: greedy, one bit at a time to the channel
// whose error drops most (ties: the fewest bits, then the lowest index). Throws kvq::Error on
// non-finite or negative weights or an infeasible budget.
std::vector<int> allocate_channel_bits(std::span<const float> weights, int avg_bits, int min_bits = 1,
                                       int max_bits = 8);

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
  // and a multiple of 8, max_seq >= 1, n_layers, n_kv_heads >= 1), or when a
  // calibrated scheme comes without ranges of this geometry (ranges are
  // copied; a dynamic scheme ignores them).
  GroupedKvCache(const GroupedKvScheme& scheme, int n_layers, int max_seq, int n_kv_heads, int head_dim,
                 const StaticRanges* ranges = nullptr);

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
  // 8 bytes(T) / (2 T E n_layers), and its mean over T = ctx - 127 .. ctx
  // (T <= written by every layer).
  double bits(int64_t T) const;
  double steady_state_bits(int64_t ctx) const;
  size_t group_bytes_k() const { return group_bytes_k_; }
  size_t group_bytes_v() const { return group_bytes_v_; }
  // Raw stored bytes of one group (tests): K (which = 0) or V (1).
  const uint8_t* group_data(int layer, int which, int head, int64_t group) const;
  const KvCache& exact() const { return exact_; }
  // K bits of channel c = head * head_dim + i of `layer` (allocated or the
  // scheme's k_bits).
  int k_channel_bits(int layer, int c) const { return kbits_[static_cast<size_t>(layer) * E() + static_cast<size_t>(c)]; }

 private:
  void EncodeGroup(int layer, int64_t g);
  void EncodeToken(int layer, int pos, std::span<const float> k, std::span<const float> v);
  void Check(int layer, int64_t T, std::span<const float> q, int n_heads) const;
  // Tokens [t0, t1) as read at length T, decoded to fp32 rows and attended.
  AttentionPart DecodedPart(int layer, int64_t t0, int64_t t1, int64_t T, std::span<const float> q, int n_heads,
                            const DecodeAttentionOptions& o) const;
  size_t E() const { return static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(head_dim_); }
  // Byte offset of channel c's two 8-code blocks in a K tile.
  size_t KOff(int layer, int c) const { return koff_[static_cast<size_t>(layer) * E() + static_cast<size_t>(c)]; }
  // End of the tokens the fused kernel reads (whole groups / tiles).
  int64_t TileEnd(int64_t T) const;
  // Static parameters of (layer, K or V, head): lo[hd] then step[hd].
  const float* StaticParams(int layer, int which, int head) const;
  // p8 grid of (layer, K or V, head): base[hd] | unit[hd] | ustep[hd].
  const float* Grid(int layer, int which, int head) const;
  GroupedKvScheme scheme_;
  int n_layers_, max_seq_, n_kv_heads_, head_dim_;
  int64_t max_groups_;
  int G_;                    // tokens per stored group (calibrated: 16)
  size_t header_bytes_;      // per-group parameters in front of the codes (calibrated: 0)
  size_t group_bytes_k_, group_bytes_v_;
  std::vector<float> static_params_;  // calibrated: [layer][K|V][head][lo | step]
  std::vector<float> grid_;           // p8: [layer][K|V][head][base | unit | ustep]
  std::vector<uint8_t> kbits_;        // [layer][channel] K code bits
  std::vector<uint32_t> koff_;        // [layer][channel] byte offset in a K tile (within the head's tile)
  size_t ktile_bytes_ = 0;            // one head's K tile: 2 sum_i bits_i
  RopeTable rope_;
  KvCache exact_;                      // fp16, K after RoPE
  std::vector<uint8_t> codes_;         // [layer][K heads x groups | V heads x groups]
  std::vector<float> pending_k_, pending_v_;  // [layer][G][E]: the open group, K before RoPE
  std::vector<int64_t> written_;
  // o<N>: [layer][pos][K (before RoPE) | V] N-bit codes (a byte each) on the
  // previous group's widened range, and [layer][pos][K heads | V heads] 1 =
  // that unit held in fp16.
  std::vector<uint8_t> open8_, open_exact_;
  std::vector<uint8_t> openw_;     // w<W>: the same tokens' 8-bit codes on the same grids
  std::vector<float> open_grid_;  // [layer][lo: K | V][step: K | V][8-bit step: K | V] of the group being written
  // The N-bit grids of every channel of `layer` (K then V: 2 E each) for the
  // tokens of group g >= 1, from group g - 1's parameters.
  void OpenGrids(int layer, int64_t g, float* lo, float* step, float* step8) const;
  // Token pos's N-bit codes on those grids (K rotated to pos).
  void DecodeOpen8(int layer, int64_t pos, int64_t T, const float* lo, const float* step, const float* step8, float* k,
                   float* v) const;
  // Whether attention at length T reads token pos from its open codes (o<N>;
  // its units that fell back from the fp16 rows).
  bool IsOpen(int64_t pos, int64_t T) const;
};

}  // namespace kvq
