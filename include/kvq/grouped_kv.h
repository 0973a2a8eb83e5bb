// Low-bit grouped KV caches: keys per channel in the tile frame (below),
// values per channel, both in groups of G consecutive tokens, with an exact
// recent window and sinks; a streaming store that holds what it counts.
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
// fp16 instead (one flag bit per unit says which). The group is encoded
// from these held values (what a streaming store has). Bits then depend on
// the data: bytes() counts them.
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
// squared error among [mn + a w / 16, mx - b w / 16] (w = mx - mn), tried
// with b = 0 and a = 0..4, then with the best a and b = 1..4 (ties: the
// wider; grouped_encode.h), values beyond it clamped by the codes; the
// encoder alone differs (the kernel reads lo and step as always).
//
// k<Bk>a... ("allocated") spends Bk bits per key on average but not evenly:
// each head's Bk * head_dim bits go to its quads of channels (4i..4i+3, one
// width each: a kernel operand) by reverse water-filling on calibrated
// weights (StaticRanges::k_weight: the channel's share of the score error,
// E|q_pair|^2 / 2 times its mean squared group range, summed over the
// quad), 2..8 bits each (allocate_channel_bits); the table of widths (a
// byte per quad) is stored and counted.
//
// k<Bk>v<Bv>c[r<R>][s<S>] is the calibrated (static) form: one range per
// layer and channel, fixed before the sequence (StaticRanges, e.g. measured
// on text the model generated), so every token is coded when it is written
// (no open group, no per-group parameters); the table costs 64 bits per
// channel (K and V lo and step, fp16), amortised over the tokens. Values
// outside a channel's range are clamped to it.
//
// Keys are kept in the *tile frame*: token t of the 16-token tile starting
// at position t0 (tiles start at S, S + 16, ...) is held as
// k~_t = R(t0)^T k_t, with k_t the key after RoPE at t and R the model's
// rotation (kvq/rope.h): the key before RoPE turned by its offset t - t0 in
// the tile. Attention reads it as R(t0) k~^_t, so per tile the query turns
// once and meets the codes in integer dot products (grouped_attention.h).
// Channel ranges of keys within a 16-token tile barely move under the small
// turns (measured: ~0.1 point of PPL at 2 bits against keys before RoPE,
// nothing at 3-4 bits).
//
// What a cache of T tokens holds (per layer, K and V alike), and nothing
// else (a streaming store; attention is always at the current length):
//   - the sinks [0, S): fp16 rows (K after RoPE);
//   - complete groups: their parameters from the moment the group is
//     complete (the next group's open tokens are coded on its range), their
//     codes from the hand-over, once the group's last token is R tokens old:
//     tokens [S, coded_end(T)), coded_end(T) = S + G floor(max(0, T - R -
//     S) / G), are read from codes. Per group, channel c (= head * head_dim
//     + i) stores lo_c and step_c as fp16 (lo rounded down and step up, so
//     [lo, lo + step (2^B - 1)] covers the group) and the code of token t is
//       q = clamp(rne((x - lo) / step), 0, 2^B - 1),  x^ = lo + step * q;
//     a channel whose values are all equal to lo has step 0 and codes 0;
//   - the open tokens [coded_end(T), T): fp16 (K in the tile frame), or with
//     o<N> at their stored width as above (N-bit or 8-bit codes, fp16 for
//     the last x, the first group and fallback units), with one bit per unit
//     saying which units fell back;
//   - the calibrated tables (p8's grid, static ranges, the allocated K bits
//     per channel quad).
// Stored in groups, a group's operands as grouped_attention.h lays them
// out. bytes() counts exactly those bytes; the object's allocations hold
// them plus a bounded constant (the open rings at full capacity, the float
// expansions of the tables, the tile rotation table: allocated_bytes()).
//
// Bits: bits(T) = stored bytes * 8 / (2 T E) per layer; the steady state is
// the mean over T = ctx - 127 .. ctx (a grouped cache right after a
// hand-over is up to ~0.8 bits cheaper), measured by whoever fills the
// cache (the evaluator records bytes() at every length).
//
// Attention merges three parts by log-sum-exp: the sinks (fp16 row kernel),
// the coded groups (the fused kernel: scores and V sums as integer dot
// products of the codes against fixed-point digits of the folded query and
// of the softmax weights; grouped_attention.h), the open tokens (decoded
// and attended in fp32). The fused kernel's only approximation is the
// fixed point: a score moves by at most sigma / 2 * sum_i q_ti with sigma =
// max_i step_i |q_pair(i)| / kMaxW (kMaxW = 127 with one digit, for K codes
// of at most 2 bits, else 16383), a softmax weight by at most max_t p_t /
// (2 kMaxP) (kMaxP = 127 for V codes of at most 3 bits, else 16383).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kvq/attention.h"
#include "kvq/rope.h"
#include "kvq/static_ranges.h"

namespace kvq {

struct GroupedKvScheme {
  int k_bits = 4, v_bits = 4;
  int group = 64;           // calibrated: 16 (one K tile)
  int recent = 0;
  int sinks = 0;
  bool calibrated = false;  // static per-channel ranges (StaticRanges)
  bool k_allocated = false; // per-quad K bits from StaticRanges::k_weight
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
  // End of the complete groups at length T (their parameters are held).
  int64_t complete_end(int64_t T) const;
  // Bytes one layer of n_kv_heads heads of head_dim holds at length T when
  // no open unit falls back to fp16 (the cache's bytes() counts the ones
  // that do).
  uint64_t layer_bytes(int64_t T, int n_kv_heads, int head_dim) const;
  // 8 layer_bytes(T) / (2 T E), E = n_kv_heads * head_dim, and its mean over
  // T = max(1, ctx - 127) .. ctx.
  double bits(int64_t T, int n_kv_heads, int head_dim) const;
  double steady_state_bits(int64_t ctx, int n_kv_heads, int head_dim) const;
  // o<N>, at length T: the open tokens [o0, T), of which [o0, f1)
  // (the first group, while nothing is coded) and [x0, T) (the last x) are
  // fp16 whatever their values.
  std::tuple<int64_t, int64_t, int64_t> OpenFp16(int64_t T) const;
  // o<N>w<W>, at length T: the open tokens [wide_start(T), x0) are held in
  // 8 bits (those of the first group stay fp16).
  int64_t wide_start(int64_t T) const;
  // Fixed-point digits of the fused kernel (see above): K from the largest
  // K code width, V from v_bits.
  int k_digits(int max_k_bits) const;
  int v_digits() const;
  // Throws kvq::Error naming `arg` unless every field is in range.
  void validate(const char* arg = "kv") const;
};

// A name (k4v3g64r16) or a preset name; throws kvq::Error naming `arg`.
GroupedKvScheme parse_grouped_kv_scheme(const std::string& name, const char* arg = "kv");
// Whether `name` is a grouped scheme or preset name (parse would succeed).
bool is_grouped_kv_scheme(const std::string& name);
// One parse for both questions: nullopt when `name` is neither a preset nor
// in the grammar; the scheme when it is; kvq::Error naming `arg` when it is
// in the grammar but out of range (k9v3g64).
std::optional<GroupedKvScheme> find_grouped_kv_scheme(const std::string& name, const char* arg = "kv");
// Presets, best measured pair per bit budget: (preset name, scheme), each
// as it resolves at the smallest head sizes.
const std::vector<std::pair<std::string, GroupedKvScheme>>& grouped_kv_presets();
// A preset as it resolves for heads of `head_dim` channels (a preset may
// resolve to other parameters per head size; 0: the smallest heads');
// nullopt when `name` is no preset.
std::optional<GroupedKvScheme> grouped_kv_preset(const std::string& name, int head_dim);
// What a preset may hold when layer 0 is held as token ids (t0+; the choice
// is resolve_kv_preset's, kvq/kv_cache.h): the bits its name promises and
// the inner schemes for heads of `head_dim` channels in order of preference
// (the first whose bits fit is taken). nullopt when `name` is no preset.
struct GroupedKvPresetLadder {
  double bits = 0;
  std::vector<GroupedKvScheme> inner;
};
std::optional<GroupedKvPresetLadder> grouped_kv_preset_token_ladder(const std::string& name, int head_dim);
// The grammar, for error messages.
const char* grouped_kv_grammar();

// Scalar reference of one channel's group code (tests, and the encoder):
// x[0..n) at stride `stride` -> lo, step (fp16 bits) and codes[0..n).
void encode_group_channel_ref(const float* x, int n, size_t stride, int bits, uint16_t* lo, uint16_t* step,
                              uint8_t* codes);
// The same with the scheme's options: p8's grid (base, unit, ustep of the
// channel; null: fp16 parameters) and m (ranges of least squared error).
// Returns the decoded lo and step; codes[0..n).
std::pair<float, float> encode_group_channel_ref(const float* x, int n, size_t stride, int bits, const float* grid,
                                                 bool mse, uint8_t* codes);

}  // namespace kvq
