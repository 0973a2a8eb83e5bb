// Low-bit grouped KV caches (see kvq/grouped_kv.h).
#include "kvq/grouped_kv.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "kvq/error.h"
#include "kvq/half.h"
#include "src/grouped_attention.h"

namespace kvq {

namespace {

constexpr float kF16Max = 65504.0f;
constexpr int kMaxGroup = 1024;
constexpr int kMaxBits = 8;
constexpr int kClipSteps = 4;  // m: each end of a group's range moved in by up to 4/16 of its width

// Adjacent fp16 values (h finite).
uint16_t F16Down(uint16_t h) {
  if (h == 0x0000) return 0x8001;
  return (h & 0x8000) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}
uint16_t F16Up(uint16_t h) {
  if (h == 0x8000) return 0x0001;
  return (h & 0x8000) ? static_cast<uint16_t>(h - 1) : static_cast<uint16_t>(h + 1);
}

// Reads a decimal count after `prefix` at s[i]; returns false when absent.
bool ReadNumber(const std::string& s, size_t& i, char prefix, int& out) {
  if (i >= s.size() || s[i] != prefix) return false;
  size_t j = i + 1;
  int64_t v = 0;
  while (j < s.size() && j - i <= 6 && s[j] >= '0' && s[j] <= '9') v = v * 10 + (s[j++] - '0');
  if (j == i + 1 || j - i > 6) return false;
  out = static_cast<int>(v);
  i = j;
  return true;
}

bool ParseName(const std::string& s, GroupedKvScheme& out) {
  GroupedKvScheme g;
  size_t i = 0;
  if (!ReadNumber(s, i, 'k', g.k_bits)) return false;
  if (i < s.size() && s[i] == 'a') g.k_allocated = true, ++i;
  if (!ReadNumber(s, i, 'v', g.v_bits)) return false;
  if (i < s.size() && s[i] == 'c') {
    g.calibrated = true;
    g.group = 16;
    ++i;
  } else if (!ReadNumber(s, i, 'g', g.group)) {
    return false;
  }
  int p = 0;
  if (!g.calibrated && ReadNumber(s, i, 'p', p)) {
    if (p != 8) return false;
    g.params8 = true;
  }
  if (!g.calibrated && i < s.size() && s[i] == 'm') g.mse_ranges = true, ++i;
  if (!g.calibrated && ReadNumber(s, i, 'o', g.open_bits)) {
    if (g.open_bits < 3 || g.open_bits > 8) return false;
    ReadNumber(s, i, 'x', g.exact_recent);
    ReadNumber(s, i, 'w', g.wide_recent);
  }
  ReadNumber(s, i, 'r', g.recent);
  ReadNumber(s, i, 's', g.sinks);
  if (i != s.size()) return false;
  out = g;
  return true;
}

}  // namespace

// ---- GroupedKvScheme -------------------------------------------------------

std::string GroupedKvScheme::name() const {
  std::string s;
  s.append("k").append(std::to_string(k_bits)).append(k_allocated ? "a" : "");
  s.append("v").append(std::to_string(v_bits));
  if (calibrated) {
    s.append("c");
  } else {
    s.append("g").append(std::to_string(group));
    if (params8) s.append("p8");
    if (mse_ranges) s.append("m");
    if (open_coded()) s.append("o").append(std::to_string(open_bits));
    if (open_coded() && exact_recent > 0) s.append("x").append(std::to_string(exact_recent));
    if (open_coded() && wide_recent > 0) s.append("w").append(std::to_string(wide_recent));
  }
  if (recent > 0) s.append("r").append(std::to_string(recent));
  if (sinks > 0) s.append("s").append(std::to_string(sinks));
  return s;
}

int64_t GroupedKvScheme::coded_end(int64_t T) const {
  if (calibrated) return std::max<int64_t>(sinks, T - recent);
  const int64_t open = std::max<int64_t>(0, T - recent - sinks);
  return sinks + group * (open / group);
}

int64_t GroupedKvScheme::stored_bits(int64_t T) const {
  if (T <= 0) return 0;
  const int64_t kv = k_bits + v_bits;
  if (calibrated) {  // every token after the sinks coded on arrival; the recent ones also exact; the table
    const int64_t coded = std::max<int64_t>(0, T - sinks);
    const int64_t exact = std::min<int64_t>(T, sinks) + std::min<int64_t>(recent, coded);
    return coded * kv + exact * 32 + 64;
  }
  const int64_t ce = coded_end(T), coded = ce - sinks, o0 = std::max<int64_t>(sinks, ce);
  const int64_t open = std::max<int64_t>(0, T - o0);
  // Per group and channel, K and V: fp16 lo and step (64 bits), or p8's
  // 8-bit a and b (32 bits) plus its grid table (fp16 base and unit of K and
  // V: 64 bits per channel, once).
  int64_t bits = coded * kv + coded / group * (params8 ? 32 : 64) + (params8 ? 64 : 0) + std::min<int64_t>(T, sinks) * 32;
  if (!open_coded() || open == 0) return bits + open * 32;
  // N-bit open tokens, except in fp16 the first group's (no previous range:
  // [S, S + G) while nothing is coded) and the last x, and in 8 bits the w
  // before those.
  const auto [f0, f1, x0] = OpenFp16(T);
  const int64_t fp16 = (f1 - f0) + (T - x0) - std::max<int64_t>(0, f1 - x0);
  const int64_t wide = std::max<int64_t>(0, x0 - std::max(wide_start(T), f1));
  return bits + fp16 * 32 + wide * 16 + (open - fp16 - wide) * 2 * open_bits;
}

std::tuple<int64_t, int64_t, int64_t> GroupedKvScheme::OpenFp16(int64_t T) const {
  const int64_t ce = coded_end(T), o0 = std::max<int64_t>(sinks, ce);
  const int64_t f1 = ce == sinks ? std::clamp<int64_t>(static_cast<int64_t>(sinks) + group, o0, std::max(o0, T)) : o0;
  const int64_t x0 = std::clamp<int64_t>(T - exact_recent, o0, std::max(o0, T));
  return {o0, f1, x0};
}

int64_t GroupedKvScheme::wide_start(int64_t T) const {
  const auto [o0, f1, x0] = OpenFp16(T);
  return std::clamp<int64_t>(x0 - wide_recent, o0, x0);
}

double GroupedKvScheme::bits(int64_t T) const {
  return T > 0 ? static_cast<double>(stored_bits(T)) / (2.0 * static_cast<double>(T)) : 0.0;
}

double GroupedKvScheme::steady_state_bits(int64_t ctx) const {
  const int64_t lo = std::max<int64_t>(1, ctx - 127);
  double s = 0;
  for (int64_t T = lo; T <= ctx; ++T) s += bits(T);
  return ctx >= 1 ? s / static_cast<double>(ctx - lo + 1) : 0.0;
}

void GroupedKvScheme::validate(const char* arg) const {
  KVQ_CHECK_ARG(k_bits >= 2 && k_bits <= kMaxBits && v_bits >= 2 && v_bits <= kMaxBits, arg,
                ": grouped code bits must be 2..8, got k", k_bits, " v", v_bits);
  KVQ_CHECK_ARG(!calibrated || !params8, arg, ": p8 (8-bit group parameters) needs dynamic groups, not c");
  KVQ_CHECK_ARG(!calibrated || group == 16, arg, ": calibrated schemes store tiles of 16 tokens, got group ", group);
  KVQ_CHECK_ARG(open_bits == 16 || (open_bits >= 3 && open_bits <= 8 && !calibrated), arg,
                ": open tokens are held in 16 or (dynamic groups, o<N>) 3..8 bits, got ", open_bits);
  KVQ_CHECK_ARG(wide_recent >= 0 && wide_recent <= (1 << 20) && (wide_recent == 0 || (open_coded() && open_bits < 8)),
                arg, ": w<W> (the last W open tokens in 8 bits) needs o<N> with N < 8 and W in 0..1048576, got ",
                wide_recent);
  KVQ_CHECK_ARG(exact_recent >= 0 && exact_recent <= (1 << 20) && (exact_recent == 0 || open_coded()), arg,
                ": x<X> (the last X open tokens in fp16) needs o<N> and X in 0..1048576, got ", exact_recent);
  KVQ_CHECK_ARG(group >= 16 && group <= kMaxGroup && group % 16 == 0, arg,
                ": group size G must be a multiple of 16 (one K tile) in 16..1024, got ", group);
  KVQ_CHECK_ARG(recent >= 0 && recent <= (1 << 20), arg, ": recent window must be 0..1048576, got ", recent);
  KVQ_CHECK_ARG(sinks >= 0 && sinks <= (1 << 20), arg, ": sinks must be 0..1048576, got ", sinks);
}

namespace {
GroupedKvScheme Named(const char* name) {
  GroupedKvScheme g;
  KVQ_ASSERT(ParseName(name, g));
  g.validate("preset");
  return g;
}
}  // namespace

const std::vector<std::pair<std::string, GroupedKvScheme>>& grouped_kv_presets() {
  // Chosen on stories260K's dev text at ctx 512 (see README): per quality
  // tier, few steady-state bits with a margin under both of its bounds.
  // Every one allocates K bits by calibrated weights and all but kvq-6.5
  // code group parameters on a calibrated grid, so they need ranges (kvq
  // eval measures them on text the model generates).
  static const std::vector<std::pair<std::string, GroupedKvScheme>> p = {
      {"kvq-6.5", Named("k6av5g128o8x16")},
      {"kvq-4.5", Named("k4av3g64p8o8r16")},
      {"kvq-3.5", Named("k3av2g64p8o8r8")},
      {"kvq-2.5", Named("k2av2g96p8mo4w4r4")},
  };
  return p;
}

bool is_grouped_kv_scheme(const std::string& name) {
  for (const auto& [n, s] : grouped_kv_presets()) {
    if (n == name) return true;
  }
  GroupedKvScheme g;
  return ParseName(name, g);
}

GroupedKvScheme parse_grouped_kv_scheme(const std::string& name, const char* arg) {
  for (const auto& [n, s] : grouped_kv_presets()) {
    if (n == name) return s;
  }
  GroupedKvScheme g;
  KVQ_CHECK_ARG(ParseName(name, g), arg,
                ": expected a grouped scheme k<bits>[a]v<bits>g<G>[p8][m][o<N>[x<X>][w<W>]][r<R>][s<S>] (e.g. k4v3g64r16)",
                " or a preset, got '", name, "'");
  g.validate(arg);
  return g;
}

// ---- StaticRanges ------------------------------------------------------------

StaticRanges StaticRanges::from_samples(const std::vector<std::vector<float>>& k,
                                        const std::vector<std::vector<float>>& v, int n_kv_heads, int head_dim,
                                        double clip) {
  KVQ_CHECK_ARG(!k.empty() && k.size() == v.size(), "ranges: expected the same number (>= 1) of K and V layers, got ",
                k.size(), " and ", v.size());
  KVQ_CHECK_ARG(n_kv_heads >= 1 && head_dim >= 1, "ranges: expected n_kv_heads, head_dim >= 1");
  KVQ_CHECK_ARG(clip >= 0.0 && clip < 0.25, "ranges: clip must be in [0, 0.25), got ", clip);
  const size_t E = static_cast<size_t>(n_kv_heads) * static_cast<size_t>(head_dim);
  StaticRanges r;
  r.n_layers = static_cast<int>(k.size());
  r.n_kv_heads = n_kv_heads;
  r.head_dim = head_dim;
  const size_t rows = k[0].size() / E;
  KVQ_CHECK_ARG(rows >= 1, "ranges: expected at least one sample row");
  r.samples = static_cast<int64_t>(rows);
  std::vector<float> col(rows);
  for (int which = 0; which < 2; ++which) {
    const auto& src = which == 0 ? k : v;
    std::vector<float>& lo = which == 0 ? r.k_lo : r.v_lo;
    std::vector<float>& hi = which == 0 ? r.k_hi : r.v_hi;
    for (const auto& layer : src) {
      KVQ_CHECK_ARG(layer.size() == rows * E, "ranges: every layer needs ", rows, " rows of ", E, " values");
      for (size_t c = 0; c < E; ++c) {
        for (size_t t = 0; t < rows; ++t) {
          col[t] = layer[t * E + c];
          KVQ_CHECK_ARG(std::isfinite(col[t]), "ranges: non-finite sample");
        }
        const size_t cut = static_cast<size_t>(clip * static_cast<double>(rows));
        std::nth_element(col.begin(), col.begin() + static_cast<std::ptrdiff_t>(cut), col.end());
        lo.push_back(col[cut]);
        std::nth_element(col.begin(), col.begin() + static_cast<std::ptrdiff_t>(rows - 1 - cut), col.end());
        hi.push_back(col[rows - 1 - cut]);
      }
    }
  }
  return r;
}

void StaticRanges::validate(int layers, int heads, int hd, const char* arg) const {
  const size_t n = static_cast<size_t>(layers) * static_cast<size_t>(heads) * static_cast<size_t>(hd);
  KVQ_CHECK_ARG(n_layers == layers && n_kv_heads == heads && head_dim == hd && k_lo.size() == n && k_hi.size() == n &&
                    v_lo.size() == n && v_hi.size() == n,
                arg, ": ranges for ", layers, " layers x ", heads, " heads x ", hd, " expected, got ", n_layers, " x ",
                n_kv_heads, " x ", head_dim);
  for (size_t i = 0; i < n; ++i) {
    KVQ_CHECK_ARG(std::isfinite(k_lo[i]) && std::isfinite(k_hi[i]) && k_lo[i] <= k_hi[i] && std::isfinite(v_lo[i]) &&
                      std::isfinite(v_hi[i]) && v_lo[i] <= v_hi[i] && std::fabs(k_lo[i]) <= kF16Max &&
                      std::fabs(k_hi[i]) <= kF16Max && std::fabs(v_lo[i]) <= kF16Max && std::fabs(v_hi[i]) <= kF16Max,
                  arg, ": channel ", i, " needs finite lo <= hi within the fp16 range");
  }
}

std::vector<int> allocate_channel_bits(std::span<const float> weights, int avg_bits, int min_bits, int max_bits) {
  const int n = static_cast<int>(weights.size());
  KVQ_CHECK_ARG(n >= 1 && min_bits >= 1 && min_bits <= avg_bits && avg_bits <= max_bits && max_bits <= kMaxBits,
                "bits: expected 1 <= min ", min_bits, " <= average ", avg_bits, " <= max ", max_bits, " <= 8 over ", n,
                " channels");
  for (float w : weights) KVQ_CHECK_ARG(std::isfinite(w) && w >= 0.0f, "weights: expected finite values >= 0");
  std::vector<int> b(static_cast<size_t>(n), min_bits);
  std::vector<double> err(static_cast<size_t>(n));  // w_i 4^-b_i
  for (int i = 0; i < n; ++i) err[static_cast<size_t>(i)] = weights[static_cast<size_t>(i)] * std::ldexp(1.0, -2 * min_bits);
  for (int64_t left = static_cast<int64_t>(avg_bits - min_bits) * n; left > 0; --left) {
    int best = -1;
    for (int i = 0; i < n; ++i) {
      const size_t u = static_cast<size_t>(i);
      if (b[u] >= max_bits) continue;
      const size_t ub = static_cast<size_t>(best);
      if (best < 0 || err[u] > err[ub] || (err[u] == err[ub] && b[u] < b[ub])) best = i;
    }
    ++b[static_cast<size_t>(best)];
    err[static_cast<size_t>(best)] *= 0.25;
  }
  return b;
}

// ---- RopeTable -------------------------------------------------------------

RopeTable::RopeTable(int max_seq, int head_dim) : max_seq_(max_seq), head_dim_(head_dim) {
  KVQ_CHECK_ARG(max_seq >= 1, "rope: max_seq must be >= 1, got ", max_seq);
  KVQ_CHECK_ARG(head_dim >= 2 && head_dim % 2 == 0, "rope: head_dim must be even (RoPE rotates pairs), got ",
                head_dim);
  const size_t n = static_cast<size_t>(max_seq) * static_cast<size_t>(head_dim / 2);
  cos_.resize(n);
  sin_.resize(n);
  for (int pos = 0; pos < max_seq; ++pos) {
    for (int i = 0; i < head_dim; i += 2) {
      const float freq = 1.0f / std::pow(10000.0f, static_cast<float>(i) / static_cast<float>(head_dim));
      const float val = static_cast<float>(pos) * freq;
      cos_[static_cast<size_t>(pos * (head_dim / 2) + i / 2)] = std::cos(val);
      sin_[static_cast<size_t>(pos * (head_dim / 2) + i / 2)] = std::sin(val);
    }
  }
}

void RopeTable::apply(float* x, int n_heads, int pos) const {
  const float* c = cos(pos);
  const float* s = sin(pos);
  for (int h = 0; h < n_heads; ++h) {
    float* xh = x + static_cast<size_t>(h) * static_cast<size_t>(head_dim_);
    for (int p = 0; p < head_dim_ / 2; ++p) {
      const float x0 = xh[2 * p], x1 = xh[2 * p + 1];
      xh[2 * p] = x0 * c[p] - x1 * s[p];
      xh[2 * p + 1] = x0 * s[p] + x1 * c[p];
    }
  }
}

// ---- group codes -------------------------------------------------------------

namespace {

// fp16 lo (rounded down) and step (rounded up) covering [mn, mx].
void RangeParams(float mn, float mx, int bits, uint16_t* lo, uint16_t* step) {
  uint16_t l16 = f32_to_f16_ref(mn);
  if (f16_to_f32_ref(l16) > mn) l16 = F16Down(l16);
  const float lof = f16_to_f32_ref(l16);
  const int levels = (1 << bits) - 1;
  uint16_t s16 = 0;
  if (mx > lof) {
    const float st = (mx - lof) / static_cast<float>(levels);
    s16 = f32_to_f16_ref(st);
    if (f16_to_f32_ref(s16) < st) s16 = F16Up(s16);
  }
  *lo = l16;
  *step = s16;
}

uint8_t Code(float x, float lo, float step, int levels) {
  if (step == 0.0f) return 0;
  const float q = std::nearbyint((x - lo) / step);
  return static_cast<uint8_t>(std::clamp(q, 0.0f, static_cast<float>(levels)));
}

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

// p8 codes of a group channel's range [mn, mx] on its grid (base, unit):
// a rounded down, b up, both clamped to 0..255 (values beyond the grid
// are clamped by the codes).
// The decoded range (DecodeGroupParams) then covers [mn, mx] where the grid
// does: a and b are moved by one unit where float rounding left it short.
void P8Codes(float mn, float mx, float base, float unit, float ustep, int levels, uint8_t* a, uint8_t* b) {
  const float fa = std::floor((mn - base) / unit), fb = std::ceil((mx - base) / unit);
  int ia = static_cast<int>(std::clamp(fa, 0.0f, 255.0f));
  if (ia > 0 && base + unit * static_cast<float>(ia) > mn) --ia;
  int ib = static_cast<int>(std::clamp(fb, static_cast<float>(ia), 255.0f));
  const auto top = [&](int x) {
    return base + unit * static_cast<float>(ia) + ustep * static_cast<float>(x - ia) * static_cast<float>(levels);
  };
  if (ib < 255 && top(ib) < mx) ++ib;
  *a = static_cast<uint8_t>(ia);
  *b = static_cast<uint8_t>(ib);
}

// One group channel's code: values x[t * stride], t < n, in `bits`. Its
// range is, among [mn + a w / 16, mx - b w / 16] for a, b = 0..clip (w =
// mx - mn; clip 0: min / max), the one whose codes have the least squared
// error (ties: the wider, tried first), stored as fp16 lo / step (grid
// null) or as p8's a / b on grid = {base, unit, ustep}.
struct ChannelParams {
  uint16_t lo = 0, step = 0;  // fp16
  uint8_t a = 0, b = 0;       // p8
};
ChannelParams CodeChannel(const float* x, int n, size_t stride, int bits, const float* grid, int clip,
                          uint8_t* codes) {
  const size_t un = static_cast<size_t>(n);
  float mn = x[0], mx = x[0];
  for (size_t t = 1; t < un; ++t) mn = std::min(mn, x[t * stride]), mx = std::max(mx, x[t * stride]);
  const float w = mx - mn;
  const int levels = (1 << bits) - 1;
  ChannelParams best_p;
  double best = std::numeric_limits<double>::infinity();
  uint8_t qs[kMaxGroup];
  for (int ca = 0; ca <= clip; ++ca) {
    for (int cz = 0; cz <= clip && ca + cz < 16; ++cz) {
      const float rlo = mn + w * static_cast<float>(ca) / 16.0f, rhi = mx - w * static_cast<float>(cz) / 16.0f;
      ChannelParams p;
      float lof, stf;
      if (grid) {
        P8Codes(rlo, rhi, grid[0], grid[1], grid[2], levels, &p.a, &p.b);
        const uint8_t hdr[2] = {p.a, p.b};  // one channel's a | b
        grouped::DecodeGroupParams(hdr, 1, grid, &lof, &stf);
      } else {
        RangeParams(rlo, rhi, bits, &p.lo, &p.step);
        lof = f16_to_f32_ref(p.lo), stf = f16_to_f32_ref(p.step);
      }
      double sse = 0;
      for (size_t t = 0; t < un; ++t) {
        const float xt = x[t * stride];
        qs[t] = Code(xt, lof, stf, levels);
        const double e = static_cast<double>(xt) - (lof + stf * static_cast<float>(qs[t]));
        sse += e * e;
      }
      if (sse < best) best = sse, best_p = p, std::copy(qs, qs + un, codes);
    }
  }
  return best_p;
}

}  // namespace

void encode_group_channel_ref(const float* x, int n, size_t stride, int bits, uint16_t* lo, uint16_t* step,
                              uint8_t* codes) {
  const ChannelParams p = CodeChannel(x, n, stride, bits, nullptr, 0, codes);
  *lo = p.lo;
  *step = p.step;
}

// ---- GroupedKvCache ------------------------------------------------------------

namespace {
// Checked before any member is built (scheme_ is the first member).
const GroupedKvScheme& Validated(const GroupedKvScheme& s, int n_layers, int max_seq, int n_kv_heads, int head_dim) {
  s.validate("kv");
  KVQ_CHECK_ARG(head_dim >= 2 && head_dim % 8 == 0 && head_dim <= 512,
                "head_dim: grouped schemes need an even head_dim (RoPE rotates pairs), a multiple of 8 up to 512, got ",
                head_dim);
  KVQ_CHECK_ARG(n_layers >= 1 && n_kv_heads >= 1 && max_seq >= 1, "grouped cache: expected n_layers, n_kv_heads, ",
                "max_seq >= 1, got ", n_layers, ", ", n_kv_heads, ", ", max_seq);
  // Every position keeps an fp16 row and 8-bit codes besides its group codes:
  // about 8 bytes per element; refuse what cannot be allocated on purpose.
  const double bytes = 8.0 * n_layers * static_cast<double>(max_seq) * n_kv_heads * head_dim;
  KVQ_CHECK_ARG(int64_t{n_kv_heads} * head_dim <= (1 << 20) && bytes <= 0x1p40, "grouped cache: ", n_layers,
                " layers x ", max_seq, " positions x ", n_kv_heads, " heads x ", head_dim,
                " exceeds the limits (n_kv_heads * head_dim <= 2^20, about 1 TiB in all)");
  return s;
}
}  // namespace

GroupedKvCache::GroupedKvCache(const GroupedKvScheme& scheme, int n_layers, int max_seq, int n_kv_heads,
                               int head_dim, const StaticRanges* ranges)
    : scheme_(Validated(scheme, n_layers, max_seq, n_kv_heads, head_dim)),
      n_layers_(n_layers),
      max_seq_(max_seq),
      n_kv_heads_(n_kv_heads),
      head_dim_(head_dim),
      rope_(std::max(max_seq, 16), head_dim),
      exact_(KvScheme::Fp16, n_layers, max_seq, n_kv_heads, head_dim) {
  const size_t hd = static_cast<size_t>(head_dim), H = static_cast<size_t>(n_kv_heads);
  G_ = scheme_.calibrated ? 16 : scheme_.group;
  header_bytes_ = scheme_.calibrated ? 0 : grouped::GroupHeaderBytes(hd, scheme_.params8);
  // Calibrated: every token after the sinks has a tile lane (the last tile
  // may be partial); dynamic: whole groups only.
  const int64_t after = std::max<int64_t>(0, static_cast<int64_t>(max_seq) - scheme_.sinks);
  max_groups_ = scheme_.calibrated ? (after + G_ - 1) / G_ : after / G_;
  // K bits per channel: the scheme's, or allocated per head from the
  // calibrated weights (each head keeps k_bits * head_dim bits).
  const size_t E = H * hd;
  const bool need_ranges = scheme_.needs_ranges();
  KVQ_CHECK_ARG(!need_ranges || ranges != nullptr, "ranges: the scheme ", scheme_.name(),
                " needs calibrated ranges (StaticRanges)");
  if (need_ranges) ranges->validate(n_layers, n_kv_heads, head_dim, "ranges");
  KVQ_CHECK_ARG(!scheme_.k_allocated || ranges->k_weight.size() == static_cast<size_t>(n_layers) * E, "ranges: the ",
                "scheme ", scheme_.name(), " allocates K bits by calibrated weights, but the ranges have none");
  kbits_.assign(static_cast<size_t>(n_layers) * E, static_cast<uint8_t>(scheme_.k_bits));
  koff_.resize(kbits_.size());
  for (int l = 0; l < n_layers; ++l) {
    for (size_t h = 0; h < H; ++h) {
      const size_t base = static_cast<size_t>(l) * E + h * hd;
      if (scheme_.k_allocated) {
        const std::vector<int> b = allocate_channel_bits({ranges->k_weight.data() + base, hd}, scheme_.k_bits, std::min(2, scheme_.k_bits));
        for (size_t i = 0; i < hd; ++i) kbits_[base + i] = static_cast<uint8_t>(b[i]);
      }
      uint32_t off = 0;
      for (size_t i = 0; i < hd; ++i) koff_[base + i] = off, off += 2 * kbits_[base + i];
    }
  }
  ktile_bytes_ = 2 * hd * static_cast<size_t>(scheme_.k_bits);  // the same for every head
  group_bytes_k_ = header_bytes_ + static_cast<size_t>(G_ / 16) * ktile_bytes_;
  group_bytes_v_ = header_bytes_ + static_cast<size_t>(G_) * hd * static_cast<size_t>(scheme_.v_bits) / 8;
  const size_t per_layer = H * static_cast<size_t>(max_groups_) * (group_bytes_k_ + group_bytes_v_);
  codes_.assign(per_layer * static_cast<size_t>(n_layers) + 16, 0);  // + 16: readers load 4 bytes past a block
  // Per (layer, K or V, head, channel) tables from the calibrated ranges: p8's
  // grid (base | unit | ustep) and the calibrated form's lo | step.
  const auto each_range = [&](const auto& fn) {
    for (int l = 0; l < n_layers; ++l) {
      for (int which = 0; which < 2; ++which) {
        for (size_t h = 0; h < H; ++h) {
          for (size_t i = 0; i < hd; ++i) {
            const size_t c = static_cast<size_t>(l) * E + h * hd + i;
            const int bits = which == 0 ? kbits_[c] : scheme_.v_bits;
            const float lo = (which == 0 ? ranges->k_lo : ranges->v_lo)[c];
            const float hi = (which == 0 ? ranges->k_hi : ranges->v_hi)[c];
            fn(l, which, static_cast<int>(h), i, lo, hi, bits);
          }
        }
      }
    }
  };
  if (scheme_.params8) {
    grid_.resize(static_cast<size_t>(n_layers) * 2 * E * 3);
    each_range([&](int l, int which, int h, size_t i, float lo, float hi, int bits) {
      float* out = const_cast<float*>(Grid(l, which, h));
      P8Grid(lo, hi, bits, out + i, out + hd + i, out + 2 * hd + i);
    });
  }
  if (scheme_.calibrated) {
    static_params_.resize(static_cast<size_t>(n_layers) * 2 * E * 2);
    each_range([&](int l, int which, int h, size_t i, float lo, float hi, int bits) {
      float* out = const_cast<float*>(StaticParams(l, which, h));
      uint16_t l16, s16;
      RangeParams(lo, hi, bits, &l16, &s16);
      out[i] = f16_to_f32_ref(l16);
      out[hd + i] = f16_to_f32_ref(s16);
    });
  } else {
    pending_k_.assign(static_cast<size_t>(n_layers) * static_cast<size_t>(G_) * E, 0.0f);
    pending_v_.assign(pending_k_.size(), 0.0f);
    if (scheme_.open_coded()) {
      open8_.assign(static_cast<size_t>(n_layers) * static_cast<size_t>(max_seq) * 2 * E, 0);
      if (scheme_.wide_recent > 0) openw_.assign(open8_.size(), 0);
      open_exact_.assign(static_cast<size_t>(n_layers) * static_cast<size_t>(max_seq) * 2 * H, 1);
      open_grid_.assign(static_cast<size_t>(n_layers) * 6 * E, 0.0f);
    }
  }
  written_.assign(static_cast<size_t>(n_layers), 0);
}

const float* GroupedKvCache::Grid(int layer, int which, int head) const {
  const size_t hd = static_cast<size_t>(head_dim_), E = static_cast<size_t>(n_kv_heads_) * hd;
  return grid_.data() + ((static_cast<size_t>(layer) * 2 + static_cast<size_t>(which)) * E +
                         static_cast<size_t>(head) * hd) * 3;
}

const float* GroupedKvCache::StaticParams(int layer, int which, int head) const {
  const size_t hd = static_cast<size_t>(head_dim_), E = static_cast<size_t>(n_kv_heads_) * hd;
  return static_params_.data() + ((static_cast<size_t>(layer) * 2 + static_cast<size_t>(which)) * E +
                                  static_cast<size_t>(head) * hd) * 2;
}

int64_t GroupedKvCache::TileEnd(int64_t T) const {
  const int64_t S = scheme_.sinks, ce = scheme_.coded_end(T);
  if (ce <= S) return S;
  return S + (ce - S) / G_ * G_;
}

int64_t GroupedKvCache::written(int layer) const {
  KVQ_CHECK_ARG(layer >= 0 && layer < n_layers_, "layer: expected 0..", n_layers_ - 1, ", got ", layer);
  return written_[static_cast<size_t>(layer)];
}

const uint8_t* GroupedKvCache::group_data(int layer, int which, int head, int64_t group) const {
  KVQ_CHECK_ARG(layer >= 0 && layer < n_layers_ && (which == 0 || which == 1) && head >= 0 && head < n_kv_heads_ &&
                    group >= 0 && group < max_groups_,
                "group_data: layer, K/V, head or group out of range");
  const size_t H = static_cast<size_t>(n_kv_heads_), mg = static_cast<size_t>(max_groups_);
  const size_t per_layer = H * mg * (group_bytes_k_ + group_bytes_v_);
  const uint8_t* base = codes_.data() + static_cast<size_t>(layer) * per_layer;
  if (which == 0) return base + (static_cast<size_t>(head) * mg + static_cast<size_t>(group)) * group_bytes_k_;
  return base + H * mg * group_bytes_k_ + (static_cast<size_t>(head) * mg + static_cast<size_t>(group)) * group_bytes_v_;
}

void GroupedKvCache::write(int layer, int pos, std::span<const float> k, std::span<const float> v) {
  KVQ_CHECK_ARG(layer >= 0 && layer < n_layers_, "layer: expected 0..", n_layers_ - 1, ", got ", layer);
  const size_t E = static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(head_dim_);
  KVQ_CHECK_ARG(k.size() == E && v.size() == E, "k, v: expected ", E, " values each, got ", k.size(), " and ",
                v.size());
  int64_t& w = written_[static_cast<size_t>(layer)];
  KVQ_CHECK_ARG(pos >= 0 && pos < max_seq_ && (pos == w || pos == 0), "pos: grouped caches are written in order: ",
                "expected ", w, " (or 0, a new sequence) below max_seq ", max_seq_, ", got ", pos);
  for (size_t i = 0; i < E; ++i) {
    KVQ_CHECK_ARG(std::isfinite(k[i]) && std::isfinite(v[i]) && std::fabs(k[i]) <= kF16Max &&
                      std::fabs(v[i]) <= kF16Max,
                  "k, v: expected finite values within the fp16 range (|x| <= 65504) at element ", i);
  }
  std::vector<float> kr(k.begin(), k.end());
  rope_.apply(kr.data(), n_kv_heads_, pos);
  exact_.write(layer, pos, kr, v);
  w = pos + 1;
  const int S = scheme_.sinks, G = G_;
  if (pos < S) return;
  if (scheme_.calibrated) {
    EncodeToken(layer, pos, k, v);
    return;
  }
  const int64_t idx = (pos - S) % G, g = (pos - S) / G;
  const size_t off = (static_cast<size_t>(layer) * static_cast<size_t>(G) + static_cast<size_t>(idx)) * E;
  // The group is encoded from the values the store holds: fp16, or the
  // open codes' values (o<N>).
  float* pk = pending_k_.data() + off;
  float* pv = pending_v_.data() + off;
  for (size_t i = 0; i < E; ++i) pk[i] = f16_to_f32_ref(f32_to_f16_ref(k[i])), pv[i] = f16_to_f32_ref(f32_to_f16_ref(v[i]));
  if (scheme_.open_coded()) {
    const size_t at = static_cast<size_t>(layer) * static_cast<size_t>(max_seq_) + static_cast<size_t>(pos);
    uint8_t* codes = open8_.data() + at * 2 * E;
    // Per unit (K or V of one KV head): its codes, or fp16 when a value falls
    // outside the grid; every unit of the first group is fp16 (no grid yet).
    const size_t hd = static_cast<size_t>(head_dim_), H = static_cast<size_t>(n_kv_heads_);
    uint8_t* exact = open_exact_.data() + at * 2 * H;
    std::fill(exact, exact + 2 * H, 1);
    if (g >= 1) {
      // The group's grids, computed at its first token (positions come in order).
      float* lo = open_grid_.data() + static_cast<size_t>(layer) * 6 * E;
      float* st = lo + 2 * E;
      float* st8 = st + 2 * E;
      if (idx == 0) OpenGrids(layer, g, lo, st, st8);
      const bool wide = scheme_.wide_recent > 0;
      uint8_t* codes8 = wide ? openw_.data() + at * 2 * E : nullptr;
      float dec[512];
      for (size_t u = 0; u < 2 * H; ++u) {
        bool fits = true;
        for (size_t i = 0; i < hd; ++i) {
          // From the fp16 value (what the store holds for the last x), via
          // the 8-bit code when the last w are held in 8 bits (the N-bit code
          // is then made from it).
          const size_t c = u * hd + i;
          const float x = c < E ? pk[c] : pv[c - E];
          float y = x, half = 0.0f;
          if (wide) {
            codes8[c] = Code(x, lo[c], st8[c], 255);
            y = lo[c] + st8[c] * static_cast<float>(codes8[c]);
            half = 0.5f * st8[c];
          }
          const uint8_t q = Code(y, lo[c], st[c], (1 << scheme_.open_bits) - 1);
          const float yn = lo[c] + st[c] * static_cast<float>(q);
          if (!wide) y = yn, half = 0.5f * st[c];
          fits = fits && std::fabs(y - x) <= half;  // else outside the grid (or a zero-width range)
          codes[c] = q;
          dec[i] = yn;
        }
        exact[u] = fits ? 0 : 1;
        if (fits) std::copy(dec, dec + hd, (u < H ? pk : pv) + (u % H) * hd);
      }
    }
  }
  if (idx == G - 1 && g < max_groups_) EncodeGroup(layer, g);
}

void GroupedKvCache::EncodeToken(int layer, int pos, std::span<const float> k, std::span<const float> v) {
  const int hd = head_dim_;
  const int64_t u = pos - scheme_.sinks, g = u / G_;
  const int lane = static_cast<int>(u % G_);
  for (int h = 0; h < n_kv_heads_; ++h) {
    for (int which = 0; which < 2; ++which) {
      uint8_t* codes = const_cast<uint8_t*>(group_data(layer, which, h, g));
      const float* prm = StaticParams(layer, which, h);
      const float* x = (which == 0 ? k.data() : v.data()) + static_cast<size_t>(h) * static_cast<size_t>(hd);
      const int bits = which == 0 ? scheme_.k_bits : scheme_.v_bits;
      const size_t bb = static_cast<size_t>(bits);
      uint8_t q[512];
      for (int i = 0; i < hd; ++i) {
        const int cb = which == 0 ? k_channel_bits(layer, h * hd + i) : bits;
        q[i] = Code(x[i], prm[i], prm[hd + i], (1 << cb) - 1);
      }
      if (which == 0) {  // lane `lane` of each channel's two 8-code blocks
        for (int i = 0; i < hd; ++i) {
          const int cb = k_channel_bits(layer, h * hd + i);
          grouped::SetCodeInBlock8(codes + KOff(layer, h * hd + i) + static_cast<size_t>(lane / 8) * static_cast<size_t>(cb),
                                   lane % 8, cb, q[i]);
        }
      } else {
        for (int i = 0; i < hd; i += 8) {
          grouped::PackBlock8(q + i, bits, codes + static_cast<size_t>(lane) * hd * bb / 8 + static_cast<size_t>(i / 8) * bb);
        }
      }
    }
  }
}

void GroupedKvCache::EncodeGroup(int layer, int64_t g) {
  const int G = G_, hd = head_dim_;
  const size_t E = static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(hd);
  const float* pk = pending_k_.data() + static_cast<size_t>(layer) * static_cast<size_t>(G) * E;
  const float* pv = pending_v_.data() + static_cast<size_t>(layer) * static_cast<size_t>(G) * E;
  std::vector<uint8_t> codes(static_cast<size_t>(G) * static_cast<size_t>(hd));  // [channel][token]
  std::vector<uint8_t> row(static_cast<size_t>(hd));
  for (int h = 0; h < n_kv_heads_; ++h) {
    for (int which = 0; which < 2; ++which) {
      uint8_t* grp = const_cast<uint8_t*>(group_data(layer, which, h, g));
      const float* src = (which == 0 ? pk : pv) + static_cast<size_t>(h) * static_cast<size_t>(hd);
      const int bits = which == 0 ? scheme_.k_bits : scheme_.v_bits;
      // Per channel its range (m: of least squared error; CodeChannel) as fp16
      // lo / step or p8's a / b, and its codes.
      const size_t uhd = static_cast<size_t>(hd);
      const float* grid = scheme_.params8 ? Grid(layer, which, h) : nullptr;
      for (size_t i = 0; i < uhd; ++i) {
        const int cb = which == 0 ? k_channel_bits(layer, h * hd + static_cast<int>(i)) : bits;
        const float g3[3] = {grid ? grid[i] : 0.0f, grid ? grid[uhd + i] : 0.0f, grid ? grid[2 * uhd + i] : 0.0f};
        const ChannelParams p = CodeChannel(src + i, G, E, cb, grid ? g3 : nullptr,
                                            scheme_.mse_ranges ? kClipSteps : 0, codes.data() + i * static_cast<size_t>(G));
        if (grid) {
          grp[i] = p.a, grp[uhd + i] = p.b;
        } else {
          std::memcpy(grp + 2 * i, &p.lo, 2);
          std::memcpy(grp + 2 * (uhd + i), &p.step, 2);
        }
      }
      uint8_t* out = grp + header_bytes_;
      const size_t bb = static_cast<size_t>(bits);  // bytes of an 8-code block
      if (which == 0) {  // K tiles: tile j, channel i: tokens 16j..16j+7, then 16j+8..16j+15
        for (int j = 0; j < G / 16; ++j) {
          for (int i = 0; i < hd; ++i) {
            const int cb = k_channel_bits(layer, h * hd + i);
            const uint8_t* c = codes.data() + static_cast<size_t>(i) * G + static_cast<size_t>(j) * 16;
            uint8_t* o = out + static_cast<size_t>(j) * ktile_bytes_ + KOff(layer, h * hd + i);
            grouped::PackBlock8(c, cb, o);
            grouped::PackBlock8(c + 8, cb, o + static_cast<size_t>(cb));
          }
        }
      } else {  // V rows: token u's channels in blocks of 8
        for (int u = 0; u < G; ++u) {
          for (int i = 0; i < hd; ++i) row[static_cast<size_t>(i)] = codes[static_cast<size_t>(i) * G + static_cast<size_t>(u)];
          for (int i = 0; i < hd; i += 8) {
            grouped::PackBlock8(row.data() + i, bits, out + static_cast<size_t>(u) * hd * bb / 8 + static_cast<size_t>(i / 8) * bb);
          }
        }
      }
    }
  }
}

void GroupedKvCache::OpenGrids(int layer, int64_t g, float* lo, float* step, float* step8) const {
  const size_t hd = static_cast<size_t>(head_dim_), E = this->E();
  std::vector<float> prm(2 * hd);
  for (int which = 0; which < 2; ++which) {
    for (int h = 0; h < n_kv_heads_; ++h) {
      grouped::DecodeGroupParams(group_data(layer, which, h, g - 1), hd,
                                 scheme_.params8 ? Grid(layer, which, h) : nullptr, prm.data(), prm.data() + hd);
      for (size_t i = 0; i < hd; ++i) {
        const size_t c = static_cast<size_t>(h) * hd + i;
        const int bits = which == 0 ? k_channel_bits(layer, static_cast<int>(c)) : scheme_.v_bits;
        const float w = prm[hd + i] * static_cast<float>((1 << bits) - 1);
        lo[static_cast<size_t>(which) * E + c] = prm[i] - 0.5f * w;
        step[static_cast<size_t>(which) * E + c] = 2.0f * w / static_cast<float>((1 << scheme_.open_bits) - 1);
        step8[static_cast<size_t>(which) * E + c] = 2.0f * w / 255.0f;
      }
    }
  }
}

void GroupedKvCache::DecodeOpen8(int layer, int64_t pos, int64_t T, const float* lo, const float* step,
                                 const float* step8, float* k, float* v) const {
  const size_t E = this->E();
  const bool wide = scheme_.wide_recent > 0 && pos >= scheme_.wide_start(T);  // the 8-bit codes
  const uint8_t* codes = (wide ? openw_ : open8_).data() +
                         (static_cast<size_t>(layer) * static_cast<size_t>(max_seq_) + static_cast<size_t>(pos)) * 2 * E;
  if (wide) step = step8;
  for (size_t c = 0; c < E; ++c) k[c] = lo[c] + step[c] * static_cast<float>(codes[c]);
  for (size_t c = 0; c < E; ++c) v[c] = lo[E + c] + step[E + c] * static_cast<float>(codes[E + c]);
  rope_.apply(k, n_kv_heads_, static_cast<int>(pos));
  // Units held in fp16 instead (outside the grid): the exact rows (K after RoPE).
  const size_t H = static_cast<size_t>(n_kv_heads_), hd = static_cast<size_t>(head_dim_);
  const uint8_t* exact =
      open_exact_.data() + (static_cast<size_t>(layer) * static_cast<size_t>(max_seq_) + static_cast<size_t>(pos)) * 2 * H;
  if (std::find(exact, exact + 2 * H, 1) == exact + 2 * H) return;
  std::vector<float> ek(E), ev(E);
  exact_.read_k(layer, static_cast<int>(pos), ek);
  exact_.read_v(layer, static_cast<int>(pos), ev);
  for (size_t u = 0; u < 2 * H; ++u) {
    if (!exact[u]) continue;
    const float* from = (u < H ? ek.data() : ev.data()) + (u % H) * hd;
    std::copy(from, from + hd, (u < H ? k : v) + (u % H) * hd);
  }
}

bool GroupedKvCache::IsOpen(int64_t pos, int64_t T) const {
  return scheme_.open_coded() && pos >= scheme_.sinks + G_ && pos >= scheme_.coded_end(T) &&
         pos < T - scheme_.exact_recent;
}

void GroupedKvCache::read(int layer, int64_t pos, int64_t T, std::span<float> k, std::span<float> v) const {
  KVQ_CHECK_ARG(T >= 1 && T <= written(layer) && pos >= 0 && pos < T, "read: expected 0 <= pos < T <= ",
                written(layer), ", got pos ", pos, ", T ", T);
  const size_t E = static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(head_dim_);
  KVQ_CHECK_ARG(k.size() == E && v.size() == E, "k, v: expected ", E, " values each");
  const int S = scheme_.sinks, G = G_, hd = head_dim_;
  if (IsOpen(pos, T)) {
    std::vector<float> lo(2 * E), st(2 * E);
    std::vector<float> st8(2 * E);
    OpenGrids(layer, (pos - S) / G, lo.data(), st.data(), st8.data());
    DecodeOpen8(layer, pos, T, lo.data(), st.data(), st8.data(), k.data(), v.data());
    return;
  }
  if (pos < S || pos >= scheme_.coded_end(T)) {
    exact_.read_k(layer, static_cast<int>(pos), k);
    exact_.read_v(layer, static_cast<int>(pos), v);
    return;
  }
  const int64_t g = (pos - S) / G;
  const int u = static_cast<int>((pos - S) % G);
  std::vector<float> prm(2 * static_cast<size_t>(hd));
  for (int h = 0; h < n_kv_heads_; ++h) {
    for (int which = 0; which < 2; ++which) {
      const uint8_t* grp = group_data(layer, which, h, g);
      if (scheme_.calibrated) {
        const float* sp = StaticParams(layer, which, h);
        std::copy(sp, sp + 2 * hd, prm.begin());
      } else {
        grouped::DecodeGroupParams(grp, static_cast<size_t>(hd), scheme_.params8 ? Grid(layer, which, h) : nullptr,
                                   prm.data(), prm.data() + hd);
      }
      const uint8_t* codes = grp + header_bytes_;
      const int bits = which == 0 ? scheme_.k_bits : scheme_.v_bits;
      const size_t bb = static_cast<size_t>(bits);
      float* out = (which == 0 ? k.data() : v.data()) + static_cast<size_t>(h) * static_cast<size_t>(hd);
      for (int i = 0; i < hd; ++i) {
        const int cb = which == 0 ? k_channel_bits(layer, h * hd + i) : bits;
        const uint32_t q =
            which == 0
                ? grouped::CodeInBlock8(codes + static_cast<size_t>(u / 16) * ktile_bytes_ + KOff(layer, h * hd + i) +
                                            static_cast<size_t>((u % 16) / 8) * static_cast<size_t>(cb),
                                        u % 8, cb)
                : grouped::CodeInBlock8(codes + static_cast<size_t>(u) * hd * bb / 8 + static_cast<size_t>(i / 8) * bb,
                                        i % 8, bits);
        out[i] = prm[static_cast<size_t>(i)] + prm[static_cast<size_t>(hd + i)] * static_cast<float>(q);
      }
    }
  }
  rope_.apply(k.data(), n_kv_heads_, static_cast<int>(pos));
}

void GroupedKvCache::Check(int layer, int64_t T, std::span<const float> q, int n_heads) const {
  KVQ_CHECK_ARG(T >= 1 && T <= written(layer), "T: expected 1..", written(layer), " (tokens written), got ", T);
  KVQ_CHECK_ARG(n_heads >= 1 && n_heads % n_kv_heads_ == 0 && n_heads / n_kv_heads_ <= 64, "n_heads: expected a ",
                "multiple of n_kv_heads ", n_kv_heads_, " (at most 64 per KV head), got ", n_heads);
  KVQ_CHECK_ARG(q.size() == static_cast<size_t>(n_heads) * static_cast<size_t>(head_dim_), "q: expected ",
                n_heads * head_dim_, " values, got ", q.size());
  for (size_t i = 0; i < q.size(); ++i) KVQ_CHECK_ARG(std::isfinite(q[i]), "q: non-finite value at ", i);
}

AttentionPart GroupedKvCache::coded_part(int layer, int64_t T, std::span<const float> q, int n_heads, int threads,
                                         float scale) const {
  Check(layer, T, q, n_heads);
  KVQ_CHECK_ARG(threads >= 0 && threads <= 1024, "threads: expected 0..1024, got ", threads);
  KVQ_CHECK_ARG(std::isfinite(scale) && scale >= 0.0f, "scale: expected a finite value >= 0, got ", scale);
  const int hd = head_dim_;
  const float s = scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> qs(q.begin(), q.end());
  for (float& x : qs) x *= s;
  const int64_t n_groups = (TileEnd(T) - scheme_.sinks) / G_;
  const size_t nv = static_cast<size_t>(n_heads) * static_cast<size_t>(hd);
  AttentionPart out;
  out.log_mass.assign(static_cast<size_t>(n_heads), -std::numeric_limits<double>::infinity());
  out.value.assign(nv, 0.0f);
  if (n_groups == 0) return out;
  grouped::Call c;
  c.k = group_data(layer, 0, 0, 0);
  c.v = group_data(layer, 1, 0, 0);
  c.gbk = group_bytes_k_, c.gbv = group_bytes_v_, c.max_groups = max_groups_;
  c.n_kv_heads = n_kv_heads_, c.head_dim = hd, c.n_heads = n_heads;
  c.k_bits = scheme_.k_bits, c.v_bits = scheme_.v_bits, c.group = G_, c.first = scheme_.sinks;
  if (scheme_.calibrated) c.k_static = StaticParams(layer, 0, 0), c.v_static = StaticParams(layer, 1, 0);
  if (scheme_.params8) c.k_grid = Grid(layer, 0, 0), c.v_grid = Grid(layer, 1, 0);
  c.k_bits_ch = kbits_.data() + static_cast<size_t>(layer) * E();
  c.k_off_ch = koff_.data() + static_cast<size_t>(layer) * E();
  c.ktile_bytes = ktile_bytes_;
  c.q = qs.data();
  c.rope_cos = rope_.cos(0), c.rope_sin = rope_.sin(0);
  const int nt = static_cast<int>(std::min<int64_t>(threads > 0 ? threads : omp_get_max_threads(), n_groups));
  if (nt <= 1) {
    c.g0 = 0, c.g1 = n_groups, c.log_mass = out.log_mass.data(), c.value = out.value.data();
    grouped::Attend(c);
    return out;
  }
  std::vector<AttentionPart> parts(static_cast<size_t>(nt));
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int i = 0; i < nt; ++i) {
    AttentionPart& p = parts[static_cast<size_t>(i)];
    p.log_mass.resize(static_cast<size_t>(n_heads));
    p.value.resize(nv);
    grouped::Call ci = c;
    ci.g0 = n_groups * i / nt, ci.g1 = n_groups * (i + 1) / nt;
    ci.log_mass = p.log_mass.data(), ci.value = p.value.data();
    grouped::Attend(ci);
  }
  return merge_attention_parts(parts);
}

void GroupedKvCache::attend(int layer, int64_t T, std::span<const float> q, int n_heads, std::span<float> out,
                            int threads, float scale) const {
  Check(layer, T, q, n_heads);
  KVQ_CHECK_ARG(out.size() == q.size(), "out: expected ", q.size(), " values, got ", out.size());
  DecodeAttentionOptions o;
  o.scale = scale;
  o.threads = threads;
  const KvRowsView all = exact_.view(layer, T);
  const int64_t S = std::min<int64_t>(scheme_.sinks, T);
  const int64_t ce = std::max<int64_t>(S, std::min<int64_t>(scheme_.coded_end(T), T));
  if (ce == S && !scheme_.open_coded()) {  // nothing coded yet: every token exact
    decode_attention(q, n_heads, all, out, o);
    return;
  }
  std::vector<AttentionPart> parts;
  if (S > 0) parts.push_back(decode_attention_part(q, n_heads, all.subview(0, S), o));
  const int64_t te = TileEnd(T);
  if (te > S) parts.push_back(coded_part(layer, T, q, n_heads, threads, scale));
  if (te < ce) parts.push_back(DecodedPart(layer, te, ce, T, q, n_heads, o));  // calibrated: a partial tile
  if (ce < T && scheme_.open_coded()) {  // coded open tokens decoded, the last x in fp16
    const int64_t x0 = std::max<int64_t>(ce, T - scheme_.exact_recent);
    if (ce < x0) parts.push_back(DecodedPart(layer, ce, x0, T, q, n_heads, o));
    if (x0 < T) parts.push_back(decode_attention_part(q, n_heads, all.subview(x0, T), o));
  } else if (ce < T) {
    parts.push_back(decode_attention_part(q, n_heads, all.subview(ce, T), o));
  }
  const AttentionPart m = parts.size() == 1 ? parts.front() : merge_attention_parts(parts);
  std::copy(m.value.begin(), m.value.end(), out.begin());
}

AttentionPart GroupedKvCache::DecodedPart(int layer, int64_t t0, int64_t t1, int64_t T, std::span<const float> q,
                                          int n_heads, const DecodeAttentionOptions& o) const {
  const size_t E = static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(head_dim_);
  std::vector<float> kr(static_cast<size_t>(t1 - t0) * E), vr(kr.size());
  std::vector<float> lo(2 * E), st(2 * E), st8(2 * E);
  int64_t grid_of = -1;  // the group whose 8-bit grids lo / st hold
  for (int64_t t = t0; t < t1; ++t) {
    float* k = kr.data() + static_cast<size_t>(t - t0) * E;
    float* v = vr.data() + static_cast<size_t>(t - t0) * E;
    if (IsOpen(t, T)) {
      const int64_t g = (t - scheme_.sinks) / G_;
      if (g != grid_of) OpenGrids(layer, g, lo.data(), st.data(), st8.data()), grid_of = g;
      DecodeOpen8(layer, t, T, lo.data(), st.data(), st8.data(), k, v);
    } else {
      read(layer, t, T, {k, E}, {v, E});
    }
  }
  KvRowsView rows;
  rows.scheme = KvScheme::Fp32;
  rows.n_kv_heads = n_kv_heads_;
  rows.head_dim = head_dim_;
  rows.k = reinterpret_cast<const uint8_t*>(kr.data());
  rows.v = reinterpret_cast<const uint8_t*>(vr.data());
  rows.slice_bytes = E * sizeof(float);
  rows.tokens = t1 - t0;
  return decode_attention_part(q, n_heads, rows, o);
}

void GroupedKvCache::attend_ref(int layer, int64_t T, std::span<const float> q, int n_heads, std::span<float> out,
                                float scale) const {
  Check(layer, T, q, n_heads);
  KVQ_CHECK_ARG(out.size() == q.size(), "out: expected ", q.size(), " values, got ", out.size());
  const int hd = head_dim_, rep = n_heads / n_kv_heads_;
  const size_t E = static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(hd);
  const double s = scale > 0.0f ? scale : 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<float> K(static_cast<size_t>(T) * E), V(K.size());
  for (int64_t t = 0; t < T; ++t) {
    read(layer, t, T, {K.data() + static_cast<size_t>(t) * E, E}, {V.data() + static_cast<size_t>(t) * E, E});
  }
  std::vector<double> sc(static_cast<size_t>(T));
  for (int qh = 0; qh < n_heads; ++qh) {
    const size_t kh = static_cast<size_t>(qh / rep) * static_cast<size_t>(hd);
    const float* qv = q.data() + static_cast<size_t>(qh) * static_cast<size_t>(hd);
    double mx = -std::numeric_limits<double>::infinity();
    for (int64_t t = 0; t < T; ++t) {
      double d = 0;
      for (int i = 0; i < hd; ++i) d += static_cast<double>(qv[i]) * K[static_cast<size_t>(t) * E + kh + static_cast<size_t>(i)];
      sc[static_cast<size_t>(t)] = d * s;
      mx = std::max(mx, sc[static_cast<size_t>(t)]);
    }
    double z = 0;
    for (double& x : sc) z += (x = std::exp(x - mx));
    for (int i = 0; i < hd; ++i) {
      double a = 0;
      for (int64_t t = 0; t < T; ++t) a += sc[static_cast<size_t>(t)] * V[static_cast<size_t>(t) * E + kh + static_cast<size_t>(i)];
      out[static_cast<size_t>(qh) * static_cast<size_t>(hd) + static_cast<size_t>(i)] = static_cast<float>(a / z);
    }
  }
}

uint64_t GroupedKvCache::bytes(int64_t T) const {
  if (T <= 0) return 0;
  const uint64_t E = static_cast<uint64_t>(n_kv_heads_) * static_cast<uint64_t>(head_dim_);
  uint64_t total = static_cast<uint64_t>(scheme_.stored_bits(T)) * E / 8 * static_cast<uint64_t>(n_layers_);
  if (scheme_.open_coded()) {  // open tokens held in fp16 instead (outside the grid), per unit
    const auto [o0, f1, x0] = scheme_.OpenFp16(T);
    const int64_t w0 = scheme_.wide_start(T);
    for (int l = 0; l < n_layers_; ++l) {
      const size_t H = static_cast<size_t>(n_kv_heads_);
      for (int64_t t = f1; t < x0; ++t) {
        const uint8_t* exact =
            open_exact_.data() + (static_cast<size_t>(l) * static_cast<size_t>(max_seq_) + static_cast<size_t>(t)) * 2 * H;
        for (size_t u = 0; u < 2 * H; ++u) {  // a unit: head_dim values, 16 - N bits more each
          const int held = t >= w0 ? 8 : scheme_.open_bits;  // the unit's code width
          if (exact[u]) total += static_cast<uint64_t>(head_dim_) * static_cast<uint64_t>(16 - held) / 8;
        }
      }
    }
  }
  return total;
}

double GroupedKvCache::bits(int64_t T) const {
  const double elements = 2.0 * static_cast<double>(T) * static_cast<double>(E()) * n_layers_;
  return T > 0 ? 8.0 * static_cast<double>(bytes(T)) / elements : 0.0;
}

double GroupedKvCache::steady_state_bits(int64_t ctx) const {
  for (int l = 0; l < n_layers_; ++l) {
    KVQ_CHECK_ARG(ctx >= 1 && ctx <= written_[static_cast<size_t>(l)], "ctx: expected 1..", written_[static_cast<size_t>(l)],
                  " (tokens written), got ", ctx);
  }
  const int64_t lo = std::max<int64_t>(1, ctx - 127);
  double s = 0;
  for (int64_t T = lo; T <= ctx; ++T) s += bits(T);
  return s / static_cast<double>(ctx - lo + 1);
}

}  // namespace kvq
