// The grouped streaming store: codes, construction, writing (kvq/grouped_kv.h).
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <limits>
#include <tuple>

#include "kvq/error.h"
#include "kvq/half.h"
#include "src/groups/store.h"

namespace kvq {

using grouped::kClipSteps;
using grouped::kF16Max;
using grouped::kQuad;
using grouped::Fp16Pool;
using grouped::OpenGrid;
using grouped::OpenReader;
using grouped::MakeOpenGrid;
using grouped::OpenFromHalves;
using grouped::F16Down;
using grouped::F16Up;

// ---- group codes -------------------------------------------------------------

namespace {

// fp16 lo (rounded down) and step (rounded up) covering [mn, mx]
// (grouped_encode.h's rule, for the static ranges).
void RangeParams(float mn, float mx, int bits, uint16_t* lo, uint16_t* step) {
  const float lof = grouped::F16Floor(mn);
  *lo = grouped::F16Bits(lof);
  *step = grouped::F16Bits(mx > lof ? grouped::F16Ceil((mx - lof) / static_cast<float>((1 << bits) - 1)) : 0.0f);
}

uint8_t Code(float x, float lo, float step, int levels) { return grouped::CodeOf(x, lo, step, levels); }

// p8's grid of one channel from its calibrated range [mn, mx] (width w):
// [mn - w, mx + w] in 255 units, base rounded down and unit up to fp16
// values, ustep = unit / (2^bits - 1). A zero-width range gets w = 2^-8
// max(1, |mn|).
void P8Grid(float mn, float mx, int bits, float* base, float* unit, float* ustep) {
  float w = mx - mn;
  if (!(w > 0.0f)) w = std::ldexp(std::max(1.0f, std::fabs(mn)), -8);
  uint16_t b16 = f32_to_f16_ref(std::max(mn - w, -kF16Max));
  if (f16_to_f32_ref(b16) > mn - w && b16 != 0xFBFF) b16 = F16Down(b16);  // not below -65504
  const float u = 3.0f * w / 255.0f;
  uint16_t u16 = f32_to_f16_ref(u);
  if (f16_to_f32_ref(u16) < u) u16 = F16Up(u16);
  *base = f16_to_f32_ref(b16);
  *unit = f16_to_f32_ref(u16);
  *ustep = *unit / static_cast<float>((1 << bits) - 1);
}

}  // namespace

void encode_group_channel_ref(const float* x, int n, size_t stride, int bits, uint16_t* lo, uint16_t* step,
                              uint8_t* codes) {
  const uint8_t b = static_cast<uint8_t>(bits);
  grouped::EncodeArgs a;
  a.x = x, a.n = n, a.stride = stride, a.n_ch = 1, a.bits = &b;
  a.lo16 = lo, a.step16 = step, a.codes = codes;
  grouped::EncodeChannelRef(a);
}

std::pair<float, float> encode_group_channel_ref(const float* x, int n, size_t stride, int bits, const float* grid,
                                                 bool mse, uint8_t* codes) {
  const uint8_t b = static_cast<uint8_t>(bits);
  uint16_t l16, s16;
  uint8_t pa, pb;
  float lo, st;
  grouped::EncodeArgs a;
  a.x = x, a.n = n, a.stride = stride, a.n_ch = 1, a.bits = &b, a.grid = grid, a.clip = mse ? kClipSteps : 0;
  a.lo16 = &l16, a.step16 = &s16, a.a = &pa, a.b = &pb, a.lo = &lo, a.step = &st, a.codes = codes;
  grouped::EncodeChannelRef(a);
  return {lo, st};
}

namespace {

// Checked before any member is built (scheme_ is the first member).
const GroupedKvScheme& Validated(const GroupedKvScheme& s, int n_layers, int max_seq, int n_kv_heads, int head_dim,
                                 const RopeConfig& rope) {
  s.validate("kv");
  rope.validate("rope");
  KVQ_CHECK_ARG(head_dim >= 8 && head_dim % 8 == 0 && head_dim <= 512,
                "head_dim: grouped schemes need a head_dim that is a multiple of 8 up to 512 (RoPE pairs, channel ",
                "quads), got ", head_dim);
  KVQ_CHECK_ARG(n_layers >= 1 && n_kv_heads >= 1 && max_seq >= 1, "grouped cache: expected n_layers, n_kv_heads, ",
                "max_seq >= 1, got ", n_layers, ", ", n_kv_heads, ", ", max_seq);
  // What the codes of max_seq tokens take at 8 bits a value, at most: refuse
  // what cannot be allocated on purpose.
  const double bytes = 2.0 * n_layers * static_cast<double>(max_seq) * n_kv_heads * head_dim;
  KVQ_CHECK_ARG(int64_t{n_kv_heads} * head_dim <= (1 << 20) && bytes <= 0x1p40 && max_seq <= (1 << 28), "grouped cache: ",
                n_layers, " layers x ", max_seq, " positions x ", n_kv_heads, " heads x ", head_dim,
                " exceeds the limits (n_kv_heads * head_dim <= 2^20, max_seq <= 2^28, about 1 TiB in all)");
  return s;
}

}  // namespace

GroupedKvCache::~GroupedKvCache() = default;
GroupedKvCache::GroupedKvCache(GroupedKvCache&&) noexcept = default;
GroupedKvCache& GroupedKvCache::operator=(GroupedKvCache&&) noexcept = default;

GroupedKvCache::GroupedKvCache(const GroupedKvScheme& scheme, int n_layers, int max_seq, int n_kv_heads,
                               int head_dim, const StaticRanges* ranges, const RopeConfig& rope)
    : GroupedKvCache(scheme, n_layers, max_seq, n_kv_heads, head_dim, ranges, nullptr, rope) {}

GroupedKvCache::GroupedKvCache(const GroupedKvScheme& scheme, int n_layers, int max_seq, int n_kv_heads,
                               int head_dim, std::span<const uint8_t> tables, const RopeConfig& rope)
    : GroupedKvCache(scheme, n_layers, max_seq, n_kv_heads, head_dim, nullptr, &tables, rope) {}

GroupedKvCache::GroupedKvCache(const GroupedKvScheme& scheme, int n_layers, int max_seq, int n_kv_heads,
                               int head_dim, const StaticRanges* ranges, const std::span<const uint8_t>* tables,
                               const RopeConfig& rope)
    : scheme_(Validated(scheme, n_layers, max_seq, n_kv_heads, head_dim, rope)),
      n_layers_(n_layers),
      max_seq_(max_seq),
      n_kv_heads_(n_kv_heads),
      head_dim_(head_dim),
      rope_(rope),
      impl_(std::make_unique<Impl>()) {
  Build(ranges, tables);
}

uint64_t GroupedKvCache::layer_table_bytes() const {
  const uint64_t E = static_cast<uint64_t>(n_kv_heads_) * static_cast<uint64_t>(head_dim_);
  return (scheme_.params8 || scheme_.calibrated ? 8 * E : 0) + (scheme_.k_allocated ? E / 4 : 0);
}

void GroupedKvCache::save_tables(std::vector<uint8_t>& out) const {
  const Impl& m = *impl_;
  const size_t E = m.E, nq = E / kQuad;
  for (int l = 0; l < n_layers_; ++l) {
    if (!m.table16.empty()) {
      const uint16_t* t = m.table16.data() + static_cast<size_t>(l) * 2 * E * 2;
      const size_t at = out.size();
      out.resize(at + 2 * E * 2 * 2);
      std::memcpy(out.data() + at, t, 2 * E * 2 * 2);
    }
    if (scheme_.k_allocated) out.insert(out.end(), m.qbits.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(l) * nq),
                                        m.qbits.begin() + static_cast<std::ptrdiff_t>((static_cast<size_t>(l) + 1) * nq));
  }
}

void GroupedKvCache::Build(const StaticRanges* ranges, const std::span<const uint8_t>* tables) {
  Impl& m = *impl_;
  const GroupedKvScheme& s = scheme_;
  const int n_layers = n_layers_, max_seq = max_seq_, n_kv_heads = n_kv_heads_, head_dim = head_dim_;
  const size_t hd = static_cast<size_t>(head_dim), H = static_cast<size_t>(n_kv_heads), E = H * hd;
  const size_t nq = hd / kQuad;
  const bool need_ranges = s.needs_ranges();
  if (tables == nullptr) {
    KVQ_CHECK_ARG(!need_ranges || ranges != nullptr, "ranges: the scheme ", s.name(),
                  " needs calibrated ranges (StaticRanges)");
    if (need_ranges) {
      ranges->validate(n_layers, n_kv_heads, head_dim, "ranges");
      KVQ_CHECK_ARG(!s.k_allocated || ranges->k_weight.size() == static_cast<size_t>(n_layers) * E, "ranges: the ",
                    "scheme ", s.name(), " allocates K bits by calibrated weights, but the ranges have none");
      ranges_ = std::make_shared<const StaticRanges>(*ranges);
    }
  } else {
    KVQ_CHECK_ARG(tables->size() == static_cast<size_t>(n_layers) * layer_table_bytes(), "cache tables: the scheme ",
                  s.name(), " holds ", layer_table_bytes(), " bytes of tables per layer (", n_layers, " layers), got ",
                  tables->size());
  }
  m.L = n_layers, m.max_seq = max_seq, m.H = n_kv_heads, m.hd = head_dim, m.E = E;
  m.calibrated = s.calibrated, m.G = s.calibrated ? grouped::kTile : s.group;
  m.S = s.sinks, m.R = s.recent, m.X = s.exact_recent, m.W = s.wide_recent, m.N = s.open_bits;
  m.open_coded = s.open_coded(), m.mse = s.mse_ranges, m.vbits = s.v_bits;
  m.params = s.calibrated ? grouped::Params::kStatic : s.params8 ? grouped::Params::kP8 : grouped::Params::kFp16;
  m.hdr = grouped::GroupHeaderBytes(hd, m.params);
  m.vw = hd % 16 == 0 ? 16 : 8;
  const size_t t16_layer = (s.params8 || s.calibrated) ? 2 * E * 2 : 0;  // halves per layer
  const auto saved = [&](int l) { return tables->data() + static_cast<size_t>(l) * layer_table_bytes(); };
  // K widths per (layer, head, quad): the scheme's, or allocated from the
  // calibrated weights summed over each quad (each head keeps k_bits x
  // head_dim bits), or as saved.
  m.qbits.assign(static_cast<size_t>(n_layers) * H * nq, static_cast<uint8_t>(s.k_bits));
  m.qoff.resize(m.qbits.size());
  int max_bits = s.k_bits;
  for (int l = 0; l < n_layers; ++l) {
    for (size_t h = 0; h < H; ++h) {
      uint8_t* qb = m.qbits.data() + (static_cast<size_t>(l) * H + h) * nq;
      if (s.k_allocated && tables == nullptr) {
        std::vector<float> w(nq, 0.0f);
        for (size_t i = 0; i < hd; ++i) w[i / kQuad] += ranges->k_weight[static_cast<size_t>(l) * E + h * hd + i];
        const std::vector<int> b = allocate_channel_bits(w, s.k_bits, std::min(2, s.k_bits));
        for (size_t k = 0; k < nq; ++k) qb[k] = static_cast<uint8_t>(b[k]);
      } else if (s.k_allocated) {
        std::memcpy(qb, saved(l) + t16_layer * 2 + h * nq, nq);
        int sum = 0;
        for (size_t k = 0; k < nq; ++k) {
          KVQ_CHECK_ARG(qb[k] >= std::min(2, s.k_bits) && qb[k] <= 8, "cache tables: a K width of ", int{qb[k]},
                        " bits (layer ", l, ", head ", h, ", quad ", k, "), expected 2..8");
          sum += qb[k];
        }
        KVQ_CHECK_ARG(sum == s.k_bits * static_cast<int>(nq), "cache tables: the K widths of layer ", l, " head ", h,
                      " sum to ", sum, " bits a quad row, expected ", s.k_bits * static_cast<int>(nq));
      }
      uint32_t off = 0;
      for (size_t k = 0; k < nq; ++k) {
        m.qoff[(static_cast<size_t>(l) * H + h) * nq + k] = off, off += 8u * qb[k];
        max_bits = std::max(max_bits, static_cast<int>(qb[k]));
      }
    }
  }
  m.k_digits = s.k_digits(max_bits), m.v_digits = s.v_digits();
  m.ktile = 2 * hd * static_cast<size_t>(s.k_bits);  // the same for every head (allocation keeps the sum)
  m.lay = grouped::RecordLayout(H, hd, static_cast<size_t>(m.G), m.params, m.ktile, s.v_bits);
  m.rec_bytes = m.lay.bytes();
  // Per (layer, K or V, head, channel) tables: p8's grid (base | unit |
  // ustep) and the calibrated form's lo | step, from the calibrated ranges
  // or from their saved fp16 form.
  if (t16_layer > 0) m.table16.resize(static_cast<size_t>(n_layers) * t16_layer);
  if (tables != nullptr && t16_layer > 0) {
    for (int l = 0; l < n_layers; ++l) std::memcpy(m.table16.data() + static_cast<size_t>(l) * t16_layer, saved(l), t16_layer * 2);
  }
  const auto each = [&](const auto& fn) {
    for (int l = 0; l < n_layers; ++l) {
      for (size_t which = 0; which < 2; ++which) {
        for (size_t c = 0; c < E; ++c) {
          const size_t at = static_cast<size_t>(l) * E + c;
          const int bits = which == 0 ? m.qbits[at / kQuad] : s.v_bits;
          uint16_t* t = m.table16.data() + ((static_cast<size_t>(l) * 2 + which) * E + c) * 2;
          fn(l, which, c / hd, c % hd, at, bits, t);
        }
      }
    }
  };
  if (s.params8) {
    m.grid.resize(static_cast<size_t>(n_layers) * 2 * E * 3);
    each([&](int l, size_t which, size_t h, size_t i, size_t at, int bits, uint16_t* t) {
      float* out = const_cast<float*>(m.Grid(l, which, h));
      if (tables == nullptr) {
        const float lo = (which == 0 ? ranges->k_lo : ranges->v_lo)[at];
        const float hi = (which == 0 ? ranges->k_hi : ranges->v_hi)[at];
        P8Grid(lo, hi, bits, out + i, out + hd + i, out + 2 * hd + i);
        t[0] = f32_to_f16_ref(out[i]), t[1] = f32_to_f16_ref(out[hd + i]);  // exact: both are fp16 values
      } else {
        out[i] = f16_to_f32_ref(t[0]), out[hd + i] = f16_to_f32_ref(t[1]);
        KVQ_CHECK_ARG(std::isfinite(out[i]) && std::isfinite(out[hd + i]) && out[hd + i] > 0.0f,
                      "cache tables: a p8 grid with a non-finite base or a unit that is not positive (layer ", l, ")");
        out[2 * hd + i] = out[hd + i] / static_cast<float>((1 << bits) - 1);
      }
    });
  }
  if (s.calibrated) {
    m.stat.resize(static_cast<size_t>(n_layers) * 2 * E * 2);
    each([&](int l, size_t which, size_t h, size_t i, size_t at, int bits, uint16_t* t) {
      float* out = const_cast<float*>(m.Stat(l, which, h));
      if (tables == nullptr) {
        const float lo = (which == 0 ? ranges->k_lo : ranges->v_lo)[at];
        const float hi = (which == 0 ? ranges->k_hi : ranges->v_hi)[at];
        RangeParams(lo, hi, bits, &t[0], &t[1]);
      }
      out[i] = f16_to_f32_ref(t[0]);
      out[hd + i] = f16_to_f32_ref(t[1]);
      KVQ_CHECK_ARG(std::isfinite(out[i]) && std::isfinite(out[hd + i]) && out[hd + i] >= 0.0f,
                    "cache tables: a static range with a non-finite end or a negative step (layer ", l, ")");
    });
  }
  // The rotation at every tile start.
  const std::vector<float> freq = rope_frequencies(head_dim, rope_);
  const int64_t tiles = (std::max<int64_t>(0, max_seq - s.sinks) + grouped::kTile - 1) / grouped::kTile + 1;
  m.tcos.resize(static_cast<size_t>(tiles) * hd / 2);
  m.tsin.resize(m.tcos.size());
  for (int64_t j = 0; j < tiles; ++j) {
    const float pos = static_cast<float>(s.sinks + grouped::kTile * j);
    for (size_t p = 0; p < hd / 2; ++p) {
      m.tcos[static_cast<size_t>(j) * hd / 2 + p] = std::cos(pos * freq[p]);
      m.tsin[static_cast<size_t>(j) * hd / 2 + p] = std::sin(pos * freq[p]);
    }
  }
  // Open rings.
  m.cap = s.calibrated ? 0 : static_cast<size_t>(m.G + m.R);
  m.nslot = m.open_coded ? 2 * E * static_cast<size_t>(m.N) / 8 : 0;
  m.fslot = m.open_coded ? static_cast<size_t>((2 * H + 7) / 8) : 0;
  m.wslots = m.W > 0 ? static_cast<size_t>(m.W + m.X) : 0;
  m.xslots = s.calibrated ? static_cast<size_t>(m.R) : m.open_coded ? static_cast<size_t>(m.X) : m.cap;
  m.layers.resize(static_cast<size_t>(n_layers));
  for (Impl::Layer& ly : m.layers) {
    ly.pool = Fp16Pool(hd);
    ly.recs.init(m.rec_bytes);
    ly.sink.resize(static_cast<size_t>(std::min(s.sinks, max_seq)) * 2 * E);
    ly.f16.resize(m.xslots * 2 * E);
    ly.ncodes.resize(m.cap * m.nslot);
    ly.flags.resize(m.cap * m.fslot);
    ly.w8.resize(m.wslots * 2 * E);
  }
}

GroupedKvCache GroupedKvCache::Copy() const {
  std::vector<uint8_t> tables;
  save_tables(tables);
  GroupedKvCache c(scheme_, n_layers_, max_seq_, n_kv_heads_, head_dim_, tables, rope_);
  c.ranges_ = ranges_;
  std::vector<uint8_t> state;
  save_state(state);
  std::vector<int64_t> lengths;
  for (int l = 0; l < n_layers_; ++l) lengths.push_back(written(l));
  c.load_state(state, lengths);
  return c;
}

int64_t GroupedKvCache::written(int layer) const {
  KVQ_CHECK_ARG(layer >= 0 && layer < n_layers_, "layer: expected 0..", n_layers_ - 1, ", got ", layer);
  return impl_->layers[static_cast<size_t>(layer)].T;
}

int64_t GroupedKvCache::complete_groups(int layer) const {
  (void)written(layer);
  return static_cast<int64_t>(impl_->layers[static_cast<size_t>(layer)].recs.size());
}

int64_t GroupedKvCache::coded_groups(int layer) const {
  (void)written(layer);
  const Impl::Layer& ly = impl_->layers[static_cast<size_t>(layer)];
  return impl_->calibrated ? static_cast<int64_t>(ly.recs.size()) : ly.n_coded;
}

void GroupedKvCache::group_params(int layer, int64_t g, int which, int head, std::span<float> lo,
                                  std::span<float> step) const {
  KVQ_CHECK_ARG(g >= 0 && g < complete_groups(layer) && (which == 0 || which == 1) && head >= 0 &&
                    head < n_kv_heads_ && lo.size() == static_cast<size_t>(head_dim_) && step.size() == lo.size(),
                "group_params: group, K/V, head or span size out of range");
  impl_->RecordParams(layer, impl_->layers[static_cast<size_t>(layer)].recs[static_cast<size_t>(g)],
                      static_cast<size_t>(which), static_cast<size_t>(head), lo.data(), step.data());
}

int GroupedKvCache::k_digits() const { return impl_->k_digits; }
int GroupedKvCache::v_digits() const { return impl_->v_digits; }

int GroupedKvCache::k_quad_bits(int layer, int head, int quad) const {
  KVQ_CHECK_ARG(layer >= 0 && layer < n_layers_ && head >= 0 && head < n_kv_heads_ && quad >= 0 &&
                    quad < head_dim_ / kQuad,
                "k_quad_bits: layer, head or quad out of range");
  return impl_->QuadBits(layer, head)[quad];
}

// The grid of group g's open tokens (g >= 1) from group g - 1's record, as
// the previous version computed it: per channel lo' = lo - w / 2, step' =
// 2 w / (2^N - 1), step8 = 2 w / 255, w = step (2^B - 1).
void grouped::MakeOpenGrid(const GroupedKvCache::Impl& m, int l, const uint8_t* prev, int64_t g, OpenGrid& out) {
  const size_t hd = static_cast<size_t>(m.hd), E = m.E;
  out.group = g;
  out.lo.resize(2 * E), out.st.resize(2 * E), out.st8.resize(2 * E);
  std::vector<float> lo(hd), st(hd);
  for (size_t which = 0; which < 2; ++which) {
    for (size_t h = 0; h < static_cast<size_t>(m.H); ++h) {
      m.RecordParams(l, prev, which, h, lo.data(), st.data());
      for (size_t i = 0; i < hd; ++i) {
        const size_t c = h * hd + i;
        const int bits = m.Bits(l, which, c);
        const float w = st[i] * static_cast<float>((1 << bits) - 1);
        out.lo[which * E + c] = lo[i] - 0.5f * w;
        out.st[which * E + c] = 2.0f * w / static_cast<float>((1 << m.N) - 1);
        out.st8[which * E + c] = 2.0f * w / 255.0f;
      }
    }
  }
}

namespace {

// Packs codes [which][head][channel][token] (G tokens) into a record's K
// tiles and V quads.
void PackRecord(const GroupedKvCache::Impl& m, int layer, const uint8_t* codes, uint8_t* rec) {
  const size_t E = m.E, hd = static_cast<size_t>(m.hd), G = static_cast<size_t>(m.G), nq = hd / kQuad;
  const size_t vw = static_cast<size_t>(m.vw);
  uint8_t op[64];
  for (size_t h = 0; h < static_cast<size_t>(m.H); ++h) {
    const uint8_t* kc = codes + h * hd * G;          // K, head h: [channel][token]
    const uint8_t* vc = codes + (E + h * hd) * G;    // V
    const uint8_t* qb = m.QuadBits(layer, static_cast<int>(h));
    const uint32_t* qo = m.QuadOff(layer, static_cast<int>(h));
    for (size_t j = 0; j < G / grouped::kTile; ++j) {
      uint8_t* tile = rec + m.lay.tile(j, h);
      for (size_t k = 0; k < nq; ++k) {
        for (int l = 0; l < grouped::kTile; ++l) {
          for (int c = 0; c < kQuad; ++c) op[kQuad * l + c] = kc[(kQuad * k + static_cast<size_t>(c)) * G + j * grouped::kTile + static_cast<size_t>(l)];
        }
        grouped::PackOperand(op, 64, qb[k], tile + qo[k]);
      }
    }
    for (size_t x = 0; x < hd / vw; ++x) {
      for (size_t r = 0; r < G / 4; ++r) {
        for (size_t n = 0; n < vw; ++n) {
          for (size_t jj = 0; jj < 4; ++jj) op[4 * n + jj] = vc[(x * vw + n) * G + 4 * r + jj];
        }
        grouped::PackOperand(op, static_cast<int>(4 * vw), m.vbits, rec + m.lay.voperand(h, x, r));
      }
    }
  }
}

// Group g's parameters (codes = false: at its completion) or codes (at its
// hand-over) from the values the store holds for its tokens.
void EncodeGroup(const GroupedKvCache::Impl& m, const GroupedKvScheme& s, int layer, int64_t g, uint8_t* rec, bool codes) {
  const GroupedKvCache::Impl::Layer& ly = m.layers[static_cast<size_t>(layer)];
  const size_t E = m.E, hd = static_cast<size_t>(m.hd), H = static_cast<size_t>(m.H);
  const int G = m.G;
  const size_t uG = static_cast<size_t>(G);
  // The group's held values, [token][K | V].
  thread_local std::vector<float> x;
  x.resize(uG * 2 * E);
  const OpenReader rd{m, ly, s, layer};
  for (int t = 0; t < G; ++t) rd.Token(m.S + g * G + t, /*for_attention=*/false, x.data() + static_cast<size_t>(t) * 2 * E);
  thread_local std::vector<uint8_t> q;
  q.resize(codes ? 2 * E * uG : 0);
  std::vector<float> lo(hd), st(hd);
  std::vector<uint8_t> bits(hd);
  std::vector<uint16_t> l16(hd), s16(hd);
  for (size_t which = 0; which < 2; ++which) {
    for (size_t h = 0; h < H; ++h) {
      for (size_t i = 0; i < hd; ++i) bits[i] = static_cast<uint8_t>(m.Bits(layer, which, h * hd + i));
      const float* xs = x.data() + which * E + h * hd;
      if (!codes) {
        // Per channel its range (m: of least squared error) as fp16 lo /
        // step or p8's a / b (grouped_encode.h).
        uint8_t* prm = rec + (which == 0 ? m.lay.kparams(h) : m.lay.vparams(h));
        grouped::EncodeArgs a;
        a.x = xs, a.n = G, a.stride = 2 * E, a.n_ch = static_cast<int>(hd), a.bits = bits.data();
        a.grid = m.params == grouped::Params::kP8 ? m.Grid(layer, which, h) : nullptr;
        a.clip = m.mse ? kClipSteps : 0;
        a.lo16 = l16.data(), a.step16 = s16.data(), a.a = prm, a.b = prm + hd;
        grouped::EncodeChannels(a);
        if (!a.grid) {
          std::memcpy(prm, l16.data(), 2 * hd);
          std::memcpy(prm + 2 * hd, s16.data(), 2 * hd);
        }
        continue;
      }
      // The codes on the stored parameters (those the coder chose).
      m.RecordParams(layer, rec, which, h, lo.data(), st.data());
      grouped::CodeValues(xs, G, 2 * E, static_cast<int>(hd), lo.data(), st.data(), bits.data(),
                          q.data() + (which * E + h * hd) * uG);
    }
  }
  if (codes) PackRecord(m, layer, q.data(), rec);
}

}  // namespace

void grouped::OpenFromHalves(GroupedKvCache::Impl& m, GroupedKvCache::Impl::Layer& ly, int64_t pos, const OpenGrid& og,
                    const float* x) {
  const size_t E = m.E, hd = static_cast<size_t>(m.hd), H2 = 2 * static_cast<size_t>(m.H);
  const size_t slot = static_cast<size_t>(pos) % m.cap;
  uint8_t* fl = ly.flags.data() + slot * m.fslot;
  std::fill(fl, fl + m.fslot, 0);
  uint8_t* c8 = m.W > 0 ? ly.w8.data() + static_cast<size_t>(pos) % m.wslots * 2 * E : nullptr;
  thread_local std::vector<uint8_t> qn, fits;
  qn.resize(2 * E), fits.resize(H2);
  grouped::OpenCodes(x, og.lo.data(), og.st.data(), og.st8.data(), H2, hd, m.N, qn.data(), c8, fits.data());
  for (size_t un = 0; un < H2; ++un) {
    if (fits[un]) continue;
    fl[un / 8] = static_cast<uint8_t>(fl[un / 8] | (1u << (un % 8)));
    ly.pool.add(pos * static_cast<int64_t>(H2) + static_cast<int64_t>(un), x + un * hd);
  }
  grouped::PackOperand(qn.data(), static_cast<int>(2 * E), m.N, ly.ncodes.data() + slot * m.nslot);
  if (m.X > 0) f32_to_f16({x, 2 * E}, {ly.f16.data() + static_cast<size_t>(pos) % m.xslots * 2 * E, 2 * E});
}

void GroupedKvCache::write(int layer, int pos, std::span<const float> k, std::span<const float> v) {
  KVQ_CHECK_ARG(layer >= 0 && layer < n_layers_, "layer: expected 0..", n_layers_ - 1, ", got ", layer);
  Impl& m = *impl_;
  const size_t E = m.E, hd = static_cast<size_t>(m.hd), H = static_cast<size_t>(m.H);
  KVQ_CHECK_ARG(k.size() == E && v.size() == E, "k, v: expected ", E, " values each, got ", k.size(), " and ",
                v.size());
  Impl::Layer& ly = m.layers[static_cast<size_t>(layer)];
  KVQ_CHECK_ARG(pos >= 0 && pos < max_seq_ && (pos == ly.T || pos == 0), "pos: grouped caches are written in order: ",
                "expected ", ly.T, " (or 0, a new sequence) below max_seq ", max_seq_, ", got ", pos);
  for (size_t i = 0; i < E; ++i) {
    KVQ_CHECK_ARG(std::isfinite(k[i]) && std::isfinite(v[i]) && std::fabs(k[i]) <= kF16Max &&
                      std::fabs(v[i]) <= kF16Max,
                  "k, v: expected finite values within the fp16 range (|x| <= 65504) at element ", i);
  }
  if (pos == 0 && ly.T > 0) {  // a new sequence: drop everything held (the record chunks are reused)
    ly.recs.reset();
    ly.n_coded = 0;
    ly.pool.clear();
    ly.grids.clear();
  }
  ly.T = pos + 1;
  const int S = m.S;
  if (pos < S) {  // sinks: fp16 rows, K (after RoPE) rows then V rows
    f32_to_f16(k, {ly.sink.data() + static_cast<size_t>(pos) * E, E});
    f32_to_f16(v, {ly.sink.data() + (static_cast<size_t>(S) + static_cast<size_t>(pos)) * E, E});
    return;
  }
  // K in the tile frame, then both as held in fp16.
  thread_local std::vector<float> x;
  thread_local std::vector<uint16_t> h16;
  x.resize(2 * E), h16.resize(2 * E);
  std::copy(k.begin(), k.end(), x.begin());
  const int64_t tile = m.TileOf(pos);
  rope_rotate(x.data(), m.H, m.hd, m.TileCos(tile), m.TileSin(tile), /*transpose=*/true);
  std::copy(v.begin(), v.end(), x.begin() + static_cast<std::ptrdiff_t>(E));
  f32_to_f16(x, h16);
  f16_to_f32(h16, x);
  const int64_t u = pos - S, G = m.G, g = u / G;

  if (m.calibrated) {  // every token coded on arrival with the static ranges; the last R also in fp16
    if (u % G == 0) m.NewRecord(ly);
    uint8_t* rec = ly.recs.back();
    for (size_t which = 0; which < 2; ++which) {
      for (size_t h = 0; h < H; ++h) {
        const float* sp = m.Stat(layer, which, h);
        for (size_t i = 0; i < hd; ++i) {
          const size_t c = h * hd + i;
          const uint8_t q = Code(x[which * E + c], sp[i], sp[hd + i], (1 << m.Bits(layer, which, c)) - 1);
          m.SetRecordCode(layer, rec, which, h, static_cast<int>(u % G), i, q);
        }
      }
    }
    if (m.R > 0) f32_to_f16(x, {ly.f16.data() + static_cast<size_t>(pos % m.R) * 2 * E, 2 * E});
    return;
  }

  // Dynamic groups: the open token as the store holds it.
  if (!m.open_coded) {
    f32_to_f16(x, {ly.f16.data() + static_cast<size_t>(pos) % m.cap * 2 * E, 2 * E});
  } else if (g == 0) {  // the first group: no range yet, every unit in fp16
    std::fill(ly.flags.begin() + static_cast<std::ptrdiff_t>((static_cast<size_t>(pos) % m.cap) * m.fslot),
              ly.flags.begin() + static_cast<std::ptrdiff_t>((static_cast<size_t>(pos) % m.cap + 1) * m.fslot), 0xFF);
    for (size_t un = 0; un < 2 * H; ++un) ly.pool.add(static_cast<int64_t>(pos) * static_cast<int64_t>(2 * H) + static_cast<int64_t>(un), x.data() + un * hd);
  } else {
    // Group g's grid (from g - 1's range), made at its first token.
    if (ly.grids.empty() || ly.grids.back().group != g) {
      ly.grids.emplace_back();
      MakeOpenGrid(m, layer, ly.recs[static_cast<size_t>(g - 1)], g, ly.grids.back());
    }
    OpenFromHalves(m, ly, pos, ly.grids.back(), x.data());
  }
  // A complete group: its parameters now (the next group's open tokens are
  // coded on its range); its codes at the hand-over.
  if ((u + 1) % G == 0) {
    uint8_t* rec = m.NewRecord(ly);
    EncodeGroup(m, scheme_, layer, g, rec, /*codes=*/false);
  }
  const int64_t coded = (scheme_.coded_end(ly.T) - S) / G;
  while (ly.n_coded < coded) {
    EncodeGroup(m, scheme_, layer, ly.n_coded, ly.recs[static_cast<size_t>(ly.n_coded)], /*codes=*/true);
    ++ly.n_coded;
    const int64_t end = S + ly.n_coded * G;  // the open store lets the group's tokens go
    ly.pool.drop_before(end * static_cast<int64_t>(2 * H));
    while (!ly.grids.empty() && ly.grids.front().group < ly.n_coded) ly.grids.erase(ly.grids.begin());
  }
}

}  // namespace kvq
