// Internal: the stored form of a grouped cache's coded groups and the fused
// attention kernel over them (grouped_kv.h), compiled for every Highway
// target in grouped_attention.cc.
//
// Keys are stored in the *tile frame*: token t of a 16-token tile starting
// at position t0 holds k~_t = R(t0)^T k_t (k_t after RoPE), i.e. the key
// before RoPE rotated by its offset t - t0 inside the tile. A tile's scores
// are then q' . k~_t with one rotated query q' = R(t0)^T q per tile and
// query head, so the codes meet the query in an integer dot product.
//
// Operands. Codes are stored in operands of 64 (or 32) codes of B bits
// (2..8): code i at bits [i B, i B + B) of a little-endian bit stream of
// 8 B (4 B) bytes. An operand is what one vpdpbusd reads:
//   K: 16 tokens x 4 channels of one tile: code index i = 4 lane + j (lane =
//      token in the tile, j = channel in the quad 4k..4k+3); quad k has its
//      own width B_k (per-channel K bits are allocated per quad).
//   V: vw channels x 4 tokens (vw = 16 when head_dim % 16 == 0, else 8):
//      code index i = 4 n + j (n = channel in the block, j = token in the
//      quad 4r..4r+3).
//
// Group record (one layer, one group of G tokens, every KV head), in the
// order the kernel reads it (RecordLayout):
//   K params   per head h: fp16 lo[hd] | fp16 step[hd] (4 hd bytes), or with
//              p8 the 8-bit codes a[hd] | b[hd] (2 hd bytes), or none
//              (calibrated)
//   V params   as K, per head
//   K tiles    tile j (tokens 16 j .. 16 j + 15), head h: quads k = 0 ..
//              hd/4 - 1, operand k at k_off[k] (sum of 8 B_k' for k' < k)
//   V codes    head h, channel block x (vw channels), token quad r: one
//              operand of 4 vw codes
// Values are x^ = lo + step q per channel (decoded by DecodeGroupParams).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvq/half.h"

namespace kvq::grouped {

// ---- operands -------------------------------------------------------------------

inline constexpr int kTile = 16;  // tokens per K tile

inline size_t OperandBytes(int codes, int bits) { return static_cast<size_t>(codes) * static_cast<size_t>(bits) / 8; }

// Packs n codes (n a multiple of 8) of `bits` bits into out[0, n bits / 8).
inline void PackOperand(const uint8_t* codes, int n, int bits, uint8_t* out) {
  uint64_t acc = 0;
  int have = 0;
  size_t o = 0;
  for (int i = 0; i < n; ++i) {
    acc |= static_cast<uint64_t>(codes[i] & ((1u << bits) - 1)) << have;
    have += bits;
    while (have >= 8) {
      out[o++] = static_cast<uint8_t>(acc);
      acc >>= 8;
      have -= 8;
    }
  }
}

// Code i of the operand at p (scalar reference).
inline uint32_t OperandCode(const uint8_t* p, int i, int bits) {
  const int bit = i * bits;
  uint32_t w = p[bit / 8];
  if (bit % 8 + bits > 8) w |= static_cast<uint32_t>(p[bit / 8 + 1]) << 8;
  return (w >> (bit % 8)) & ((1u << bits) - 1);
}

// Sets code i of the operand at p, leaving the others as they are.
inline void SetOperandCode(uint8_t* p, int i, int bits, uint32_t code) {
  for (int k = 0; k < bits; ++k) {
    const int bit = i * bits + k;
    const uint8_t m = static_cast<uint8_t>(1u << (bit % 8));
    p[bit / 8] = ((code >> k) & 1) ? static_cast<uint8_t>(p[bit / 8] | m) : static_cast<uint8_t>(p[bit / 8] & ~m);
  }
}

// ---- group parameters -------------------------------------------------------------

enum class Params : uint8_t { kFp16 = 0, kP8 = 1, kStatic = 2 };

// Bytes of a head's K (or V) parameters in a group record.
inline size_t GroupHeaderBytes(size_t hd, Params p) {
  return p == Params::kFp16 ? 4 * hd : p == Params::kP8 ? 2 * hd : 0;
}

// Byte offsets in a group record (see above).
struct RecordLayout {
  size_t H = 0, hd = 0, G = 0;
  size_t hdr = 0;    // one head's K (or V) parameters
  size_t ktile = 0;  // one head's K tile
  size_t vw = 16;    // V channels per operand
  size_t vop = 0;    // bytes of a V operand (4 vw codes)
  RecordLayout() = default;
  RecordLayout(size_t H_, size_t hd_, size_t G_, Params p, size_t ktile_, int v_bits)
      : H(H_), hd(hd_), G(G_), hdr(GroupHeaderBytes(hd_, p)), ktile(ktile_), vw(hd_ % 16 == 0 ? 16 : 8),
        vop(OperandBytes(static_cast<int>(4 * vw), v_bits)) {}
  size_t kparams(size_t h) const { return h * hdr; }
  size_t vparams(size_t h) const { return (H + h) * hdr; }
  size_t codes() const { return 2 * H * hdr; }  // where the codes start
  size_t tile(size_t j, size_t h) const { return codes() + (j * H + h) * ktile; }
  size_t vblocks() const { return hd / vw; }
  size_t vquads() const { return G / 4; }
  size_t vcodes() const { return codes() + (G / kTile) * H * ktile; }
  size_t voperand(size_t h, size_t x, size_t r) const { return vcodes() + ((h * vblocks() + x) * vquads() + r) * vop; }
  size_t bytes() const { return vcodes() + H * vblocks() * vquads() * vop; }
};

// One head's group parameters from its header at p: lo[hd] and step[hd].
// fp16 (grid null): lo[hd] | step[hd] as halves. p8: the codes a[hd] | b[hd]
// (u8) on the channel's grid, grid = base[hd] | unit[hd] | ustep[hd] with
// base and unit fp16 values and ustep = unit / (2^B - 1):
//   lo = base + unit a,  step = ustep (b - a).
// unit * a is exact in float (11 x 8 significant bits), so the result is
// the same with or without a fused multiply-add, on every target.
inline void DecodeGroupParams(const uint8_t* p, size_t hd, const float* grid, float* lo, float* step) {
  if (grid == nullptr) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);  // group headers are 2-byte aligned
    f16_to_f32({h, hd}, {lo, hd});
    f16_to_f32({h + hd, hd}, {step, hd});
    return;
  }
  for (size_t i = 0; i < hd; ++i) {
    lo[i] = grid[i] + grid[hd + i] * static_cast<float>(p[i]);
    step[i] = grid[2 * hd + i] * static_cast<float>(p[hd + i] - p[i]);
  }
}

// ---- the kernel -----------------------------------------------------------------

// Fixed-point scales. K: per group and query head, the tile's weights W_i =
// q'_i step_i are written as integers W^ = rne(W / sigma) with |W^| <= kMaxW
// (one signed byte, or two base-128 digits lo + 128 hi, lo in 0..127, hi
// signed); V: the softmax weights of a group as P^ = rne(p / sigma_p) in
// 0..kMaxP (7-bit digits). The digits are a property of the scheme:
// KDigits / VDigits.
inline constexpr int kMaxW[3] = {0, 127, 127 * 128 + 127};
inline constexpr int kMaxP[3] = {0, 127, 127 * 128 + 127};
// One digit where the rounding error is small against the codes' own (see
// grouped_kv.h): K codes of at most 2 bits, V codes of at most 3.
inline int KDigits(int max_k_bits) { return max_k_bits <= 2 ? 1 : 2; }
inline int VDigits(int v_bits) { return v_bits <= 3 ? 1 : 2; }

struct Call {
  const uint8_t* const* groups = nullptr;  // record of group g (all heads)
  RecordLayout layout;
  int n_kv_heads = 0, head_dim = 0, n_heads = 0, group = 0, v_bits = 0;
  Params params = Params::kFp16;
  int k_digits = 2, v_digits = 2;
  int64_t first = 0;       // position of group 0's first token (the sinks before it)
  int64_t g0 = 0, g1 = 0;  // groups [g0, g1) to attend
  const float* q = nullptr;         // n_heads * head_dim, after RoPE, multiplied by the score scale
  // The rotation at every tile start first + 16 j: (tiles, head_dim / 2).
  const float* tile_cos = nullptr;
  const float* tile_sin = nullptr;
  // Calibrated: per KV head lo[hd] | step[hd] (floats) of K and of V.
  const float* k_static = nullptr;
  const float* v_static = nullptr;
  // p8: per KV head the grid (base | unit | ustep, 3 hd floats) of K and V.
  const float* k_grid = nullptr;
  const float* v_grid = nullptr;
  // Per KV head and channel quad: its K bits and byte offset in a tile.
  const uint8_t* k_quad_bits = nullptr;
  const uint32_t* k_quad_off = nullptr;
  double* log_mass = nullptr;  // n_heads outputs: log sum exp(score), -inf when no token
  float* value = nullptr;      // n_heads * head_dim outputs (normalised)
};

// One thread; never throws.
void Attend(const Call& c);

// Which integer dot products Attend uses: kAuto (VNNI on AVX3_DL when
// head_dim % 16 == 0, else the wide 16-bit path), or, for tests, the wide
// path or the scalar loops on every target. Process-wide.
enum class DotPath : int { kAuto = 0, kWide = 1, kScalar = 2 };
void SetDotPathForTest(DotPath p);

// n codes of `bits` bits (1..8) packed as an operand is, LSB first -> a
// byte each (the portable kernel and the cache's reads of open codes).
void UnpackCodes(const uint8_t* p, size_t n, int bits, uint8_t* out);

}  // namespace kvq::grouped
