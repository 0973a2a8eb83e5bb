// Grouped schemes: the name grammar, presets, byte counts (kvq/grouped_kv.h).
#include "kvq/grouped_kv.h"

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <tuple>

#include "kvq/error.h"
#include "src/groups/attention.h"

namespace kvq {

namespace {

constexpr int kMaxGroup = 1024;
constexpr int kMaxBits = 8;


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

int64_t GroupedKvScheme::complete_end(int64_t T) const {
  if (calibrated) return std::max<int64_t>(sinks, T);
  return sinks + group * (std::max<int64_t>(0, T - sinks) / group);
}

namespace {
// Bytes a flag set of one open token takes: a bit per unit (K or V of a head).
inline uint64_t FlagBytes(int n_kv_heads) { return (2 * static_cast<uint64_t>(n_kv_heads) + 7) / 8; }
}  // namespace

uint64_t GroupedKvScheme::layer_bytes(int64_t T, int H, int hd) const {
  const uint64_t E = static_cast<uint64_t>(H) * static_cast<uint64_t>(hd);
  const uint64_t kv = static_cast<uint64_t>(k_bits + v_bits);
  // The tables: p8's grid or the static ranges (fp16 base | unit, or lo |
  // step, of K and V: 8 bytes a channel) and the allocated K widths (a byte
  // per channel quad).
  uint64_t bytes = (params8 || calibrated ? 8 * E : 0) + (k_allocated ? E / 4 : 0);
  if (T <= 0) return bytes;
  bytes += static_cast<uint64_t>(std::min<int64_t>(T, sinks)) * 4 * E;  // sinks, fp16 K and V
  if (calibrated) {  // codes of every started tile of 16 tokens, and the last R tokens in fp16 too
    const int64_t after = std::max<int64_t>(0, T - sinks);
    return bytes + static_cast<uint64_t>((after + 15) / 16) * 16 * E * kv / 8 +
           static_cast<uint64_t>(std::min<int64_t>(recent, after)) * 4 * E;
  }
  const int64_t ce = coded_end(T), coded = (ce - sinks) / group, complete = (complete_end(T) - sinks) / group;
  // Per group: K and V parameters (fp16 lo | step: 8 bytes a channel; p8: 4)
  // from the group's completion, codes from its hand-over.
  bytes += static_cast<uint64_t>(complete) * E * (params8 ? 4 : 8) +
           static_cast<uint64_t>(coded) * static_cast<uint64_t>(group) * E * kv / 8;
  const int64_t o0 = std::max<int64_t>(sinks, ce);
  const int64_t open = std::max<int64_t>(0, T - o0);
  if (!open_coded()) return bytes + static_cast<uint64_t>(open) * 4 * E;
  // N-bit open tokens with a flag set, except in fp16 the first group's
  // (no previous range: [S, S + G) while nothing is coded) and the last x,
  // and in 8 bits the w before those.
  const auto [f0, f1, x0] = OpenFp16(T);
  const int64_t fp16 = (f1 - f0) + (T - x0) - std::max<int64_t>(0, f1 - x0);
  const int64_t wide = std::max<int64_t>(0, x0 - std::max(wide_start(T), f1));
  const int64_t narrow = open - fp16 - wide;
  return bytes + static_cast<uint64_t>(fp16) * 4 * E + static_cast<uint64_t>(wide) * 2 * E +
         static_cast<uint64_t>(narrow) * 2 * E * static_cast<uint64_t>(open_bits) / 8 +
         static_cast<uint64_t>(wide + narrow) * FlagBytes(H);
}

double GroupedKvScheme::bits(int64_t T, int H, int hd) const {
  return T > 0 ? 8.0 * static_cast<double>(layer_bytes(T, H, hd)) / (2.0 * static_cast<double>(T) * H * hd) : 0.0;
}

double GroupedKvScheme::steady_state_bits(int64_t ctx, int H, int hd) const {
  const int64_t lo = std::max<int64_t>(1, ctx - 127);
  double s = 0;
  for (int64_t T = lo; T <= ctx; ++T) s += bits(T, H, hd);
  return ctx >= 1 ? s / static_cast<double>(ctx - lo + 1) : 0.0;
}

int GroupedKvScheme::k_digits(int max_k_bits) const { return grouped::KDigits(max_k_bits); }
int GroupedKvScheme::v_digits() const { return grouped::VDigits(v_bits); }

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

namespace {
// A preset's scheme per head size: `scheme` below `wide_from` channels a
// head, `wide` from there on (empty: the same). Chosen on both models and
// both protocols (docs/schemes.md). `bits`: what the name promises.
// `token`/`token_wide`: the inner schemes it may take when layer 0 is held
// as token ids (t0+, kvq/kv_cache.h resolve_kv_preset), in order of
// preference (the first whose bits fit is taken; the last when none does).
struct PresetEntry {
  const char* name;
  double bits;
  const char* scheme;
  int wide_from;
  const char* wide;
  std::array<const char*, 6> token;       // unused slots nullptr
  std::array<const char*, 6> token_wide;  // from wide_from channels a head; all nullptr: the same as token
};
// Chosen on stories260K's dev text at ctx 512 (see README): per quality
// tier, few steady-state bits with a margin under both of its bounds.
// Every one allocates K bits by calibrated weights and all but kvq-6.5
// code group parameters on a calibrated grid, so they need ranges (kvq
// eval measures them on text the model generates). kvq-2.5 at heads of 64
// and more holds its open tokens in 3 bits: a unit of 64 values falls out
// of the 4-bit grid (and costs 16 bits a value) far more often than one of
// 8 (stories-hd64: 2.65 bits with o4, 2.48 with o3, ΔPPL +0.8% and +0.04%
// on the two protocols), and at K = 2 bits `a` has no bits to move.
// The token ladders were measured with layer 0 as ids on both models, both
// protocols, at ctx 256 and 512 (docs/schemes.md "How a preset resolves on
// a model"): layer 0 was where foreign text broke the plain presets, and
// the bits its ids free go to the other layers. From heads of 64 kvq-4.5
// and kvq-3.5 first try groups of 128 with fp16 ranges and the last 8 / 4
// open tokens fp16 (x): on stories-hd64 at ctx 512 the step that fits
// there has 2.9-3.8x / 1.5-1.9x less KLD than the first shared step (the
// recent tokens, which draw most of the attention, exact; V at 5 bits).
const PresetEntry kPresets[] = {
    {"kvq-6.5", 6.5, "k6av5g128o8x16r8", 0, "",
     {"k8av7g128o8x16r8", "k8av6g128o8x16r8", "k7av6g128o8x16r8", "k6av6g128o8x16r8", "k6av5g128o8x16r8"},
     {}},
    {"kvq-4.5", 4.5, "k4av3g64p8o8r16", 64, "",
     {"k5av4g64p8o8r16", "k4av4g64p8o8r16", "k4av3g64p8o8r16", "k4av3g32p8o8r8"},
     {"k5av5g128o8x8r8", "k5av4g64p8o8r16", "k4av4g64p8o8r16", "k4av3g64p8o8r16", "k4av3g32p8o8r8"}},
    {"kvq-3.5", 3.5, "k3av2g64p8o8r8", 64, "",
     {"k4av3g64p8o8r8", "k3av3g64p8o8r8", "k3av3g32p8o8r6", "k3av2g64p8o8r8"},
     {"k4av3g128o8x4r8", "k4av3g64p8o8r8", "k3av3g64p8o8r8", "k3av3g32p8o8r6", "k3av2g64p8o8r8"}},
    {"kvq-2.5", 2.5, "k2av2g96p8mo4w4r3", 64, "k2v2g96p8mo3w4r3",
     {"k3av2g96p8mo4w4r3", "k2av2g96p8mo4w4r3"},
     {"k3av2g64p8o8r4", "k3av2g64p8o4w4r3", "k3v2g96p8mo3w4r3", "k2v2g96p8mo3w4r3"}},
};

const PresetEntry* FindPreset(const std::string& name) {
  for (const PresetEntry& e : kPresets) {
    if (name == e.name) return &e;
  }
  return nullptr;
}
}  // namespace

const std::vector<std::pair<std::string, GroupedKvScheme>>& grouped_kv_presets() {
  static const std::vector<std::pair<std::string, GroupedKvScheme>> p = [] {
    std::vector<std::pair<std::string, GroupedKvScheme>> v;
    for (const PresetEntry& e : kPresets) v.emplace_back(e.name, Named(e.scheme));
    return v;
  }();
  return p;
}

std::optional<GroupedKvScheme> grouped_kv_preset(const std::string& name, int head_dim) {
  const PresetEntry* e = FindPreset(name);
  if (e == nullptr) return std::nullopt;
  return Named(e->wide_from > 0 && head_dim >= e->wide_from && e->wide[0] != '\0' ? e->wide : e->scheme);
}

std::optional<GroupedKvPresetLadder> grouped_kv_preset_token_ladder(const std::string& name, int head_dim) {
  const PresetEntry* e = FindPreset(name);
  if (e == nullptr) return std::nullopt;
  GroupedKvPresetLadder l;
  l.bits = e->bits;
  const bool wide = e->wide_from > 0 && head_dim >= e->wide_from && e->token_wide[0] != nullptr;
  for (const char* s : wide ? e->token_wide : e->token) {
    if (s != nullptr) l.inner.push_back(Named(s));
  }
  return l;
}

const char* grouped_kv_grammar() {
  return "k<bits>[a]v<bits>g<G>[p8][m][o<N>[x<X>][w<W>]][r<R>][s<S>] or k<bits>[a]v<bits>c[r<R>][s<S>]";
}

bool is_grouped_kv_scheme(const std::string& name) {
  for (const auto& [n, s] : grouped_kv_presets()) {
    if (n == name) return true;
  }
  GroupedKvScheme g;
  return ParseName(name, g);
}

std::optional<GroupedKvScheme> find_grouped_kv_scheme(const std::string& name, const char* arg) {
  for (const auto& [n, s] : grouped_kv_presets()) {
    if (n == name) return s;
  }
  GroupedKvScheme g;
  if (!ParseName(name, g)) return std::nullopt;
  g.validate(arg);
  return g;
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
}  // namespace kvq
