// Low-bit grouped KV caches (see kvq/grouped_kv.h).
#include "kvq/grouped_kv.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kvq/error.h"
#include "kvq/half.h"
#include "src/grouped_attention.h"

namespace kvq {

namespace {

constexpr float kF16Max = 65504.0f;
constexpr int kMaxGroup = 1024;
constexpr int kMaxBits = 8;

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
  if (!ReadNumber(s, i, 'k', g.k_bits) || !ReadNumber(s, i, 'v', g.v_bits) || !ReadNumber(s, i, 'g', g.group)) {
    return false;
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
  s.append("k").append(std::to_string(k_bits)).append("v").append(std::to_string(v_bits));
  s.append("g").append(std::to_string(group));
  if (recent > 0) s.append("r").append(std::to_string(recent));
  if (sinks > 0) s.append("s").append(std::to_string(sinks));
  return s;
}

int64_t GroupedKvScheme::coded_end(int64_t T) const {
  const int64_t open = std::max<int64_t>(0, T - recent - sinks);
  return sinks + group * (open / group);
}

double GroupedKvScheme::bits(int64_t T) const {
  if (T <= 0) return 0.0;
  const int64_t coded = std::max<int64_t>(0, coded_end(T) - sinks);
  const int64_t exact = T - coded, groups = coded / group;
  const double stored = static_cast<double>(coded) * (k_bits + v_bits) + static_cast<double>(groups) * 2 * 32 +
                        static_cast<double>(exact) * 2 * 16;
  return stored / (2.0 * static_cast<double>(T));
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
  KVQ_CHECK_ARG(group >= 16 && group <= kMaxGroup && group % 16 == 0, arg,
                ": group size G must be a multiple of 16 (one K tile) in 16..1024, got ", group);
  KVQ_CHECK_ARG(recent >= 0 && recent <= (1 << 20), arg, ": recent window must be 0..1048576, got ", recent);
  KVQ_CHECK_ARG(sinks >= 0 && sinks <= (1 << 20), arg, ": sinks must be 0..1048576, got ", sinks);
}

const std::vector<std::pair<std::string, GroupedKvScheme>>& grouped_kv_presets() {
  static const std::vector<std::pair<std::string, GroupedKvScheme>> p = {
      {"kvq-6.5", {6, 6, 64, 0, 0}},
      {"kvq-4.5", {4, 4, 64, 0, 0}},
      {"kvq-3.5", {3, 3, 64, 0, 0}},
      {"kvq-2.5", {2, 2, 64, 0, 0}},
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
  KVQ_CHECK_ARG(ParseName(name, g), arg, ": expected a grouped scheme k<bits>v<bits>g<G>[r<R>][s<S>] (e.g. k4v3g64r16)",
                " or a preset, got '", name, "'");
  g.validate(arg);
  return g;
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

void encode_group_channel_ref(const float* x, int n, size_t stride, int bits, uint16_t* lo, uint16_t* step,
                              uint8_t* codes) {
  float mn = x[0], mx = x[0];
  for (int t = 1; t < n; ++t) {
    mn = std::min(mn, x[static_cast<size_t>(t) * stride]);
    mx = std::max(mx, x[static_cast<size_t>(t) * stride]);
  }
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
  const float stf = f16_to_f32_ref(s16);
  for (int t = 0; t < n; ++t) {
    if (stf == 0.0f) {
      codes[t] = 0;
      continue;
    }
    const float q = std::nearbyint((x[static_cast<size_t>(t) * stride] - lof) / stf);
    codes[t] = static_cast<uint8_t>(std::clamp(q, 0.0f, static_cast<float>(levels)));
  }
}

// ---- GroupedKvCache ------------------------------------------------------------

namespace {
const GroupedKvScheme& Validated(const GroupedKvScheme& s, int head_dim) {
  s.validate("kv");
  KVQ_CHECK_ARG(head_dim >= 2 && head_dim % 8 == 0 && head_dim <= 512,
                "head_dim: grouped schemes need an even head_dim (RoPE rotates pairs), a multiple of 8 up to 512, got ",
                head_dim);
  return s;
}
}  // namespace

GroupedKvCache::GroupedKvCache(const GroupedKvScheme& scheme, int n_layers, int max_seq, int n_kv_heads,
                               int head_dim)
    : scheme_(Validated(scheme, head_dim)),
      n_layers_(n_layers),
      max_seq_(max_seq),
      n_kv_heads_(n_kv_heads),
      head_dim_(head_dim),
      rope_(std::max(max_seq, 16), head_dim),
      exact_(KvScheme::Fp16, n_layers, max_seq, n_kv_heads, head_dim) {
  KVQ_CHECK_ARG(n_layers >= 1 && n_kv_heads >= 1 && max_seq >= 1, "grouped cache: expected n_layers, n_kv_heads, ",
                "max_seq >= 1, got ", n_layers, ", ", n_kv_heads, ", ", max_seq);
  const int G = scheme_.group;
  max_groups_ = std::max<int64_t>(0, (static_cast<int64_t>(max_seq) - scheme_.sinks) / G);
  const size_t hd = static_cast<size_t>(head_dim);
  group_bytes_k_ = 4 * hd + static_cast<size_t>(G) * hd * static_cast<size_t>(scheme_.k_bits) / 8;
  group_bytes_v_ = 4 * hd + static_cast<size_t>(G) * hd * static_cast<size_t>(scheme_.v_bits) / 8;
  const size_t per_layer = static_cast<size_t>(n_kv_heads) * static_cast<size_t>(max_groups_) *
                           (group_bytes_k_ + group_bytes_v_);
  codes_.assign(per_layer * static_cast<size_t>(n_layers) + 16, 0);  // + 16: Unpack8 reads 8 bytes
  const size_t E = static_cast<size_t>(n_kv_heads) * hd;
  pending_k_.assign(static_cast<size_t>(n_layers) * static_cast<size_t>(G) * E, 0.0f);
  pending_v_.assign(pending_k_.size(), 0.0f);
  written_.assign(static_cast<size_t>(n_layers), 0);
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
  const int S = scheme_.sinks, G = scheme_.group;
  if (pos < S) return;
  const int64_t idx = (pos - S) % G, g = (pos - S) / G;
  const size_t off = (static_cast<size_t>(layer) * static_cast<size_t>(G) + static_cast<size_t>(idx)) * E;
  std::copy(k.begin(), k.end(), pending_k_.begin() + static_cast<std::ptrdiff_t>(off));
  std::copy(v.begin(), v.end(), pending_v_.begin() + static_cast<std::ptrdiff_t>(off));
  if (idx == G - 1 && g < max_groups_) EncodeGroup(layer, g);
}

void GroupedKvCache::EncodeGroup(int layer, int64_t g) {
  const int G = scheme_.group, hd = head_dim_;
  const size_t E = static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(hd);
  const float* pk = pending_k_.data() + static_cast<size_t>(layer) * static_cast<size_t>(G) * E;
  const float* pv = pending_v_.data() + static_cast<size_t>(layer) * static_cast<size_t>(G) * E;
  std::vector<uint8_t> codes(static_cast<size_t>(G) * static_cast<size_t>(hd));  // [channel][token]
  std::vector<uint8_t> row(static_cast<size_t>(hd));
  for (int h = 0; h < n_kv_heads_; ++h) {
    for (int which = 0; which < 2; ++which) {
      uint8_t* grp = const_cast<uint8_t*>(group_data(layer, which, h, g));
      uint16_t* lo = reinterpret_cast<uint16_t*>(grp);
      const float* src = (which == 0 ? pk : pv) + static_cast<size_t>(h) * static_cast<size_t>(hd);
      const int bits = which == 0 ? scheme_.k_bits : scheme_.v_bits;
      for (int i = 0; i < hd; ++i) {
        encode_group_channel_ref(src + i, G, E, bits, lo + i, lo + hd + i, codes.data() + static_cast<size_t>(i) * G);
      }
      uint8_t* out = grp + 4 * static_cast<size_t>(hd);
      const size_t bb = static_cast<size_t>(bits);  // bytes of an 8-code block
      if (which == 0) {  // K tiles: tile j, channel i: tokens 16j..16j+7, then 16j+8..16j+15
        for (int j = 0; j < G / 16; ++j) {
          for (int i = 0; i < hd; ++i) {
            const uint8_t* c = codes.data() + static_cast<size_t>(i) * G + static_cast<size_t>(j) * 16;
            uint8_t* o = out + (static_cast<size_t>(j) * hd + static_cast<size_t>(i)) * 2 * bb;
            grouped::PackBlock8(c, bits, o);
            grouped::PackBlock8(c + 8, bits, o + bb);
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

void GroupedKvCache::read(int layer, int64_t pos, int64_t T, std::span<float> k, std::span<float> v) const {
  KVQ_CHECK_ARG(T >= 1 && T <= written(layer) && pos >= 0 && pos < T, "read: expected 0 <= pos < T <= ",
                written(layer), ", got pos ", pos, ", T ", T);
  const size_t E = static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(head_dim_);
  KVQ_CHECK_ARG(k.size() == E && v.size() == E, "k, v: expected ", E, " values each");
  const int S = scheme_.sinks, G = scheme_.group, hd = head_dim_;
  if (pos < S || pos >= scheme_.coded_end(T)) {
    exact_.read_k(layer, static_cast<int>(pos), k);
    exact_.read_v(layer, static_cast<int>(pos), v);
    return;
  }
  const int64_t g = (pos - S) / G;
  const int u = static_cast<int>((pos - S) % G);
  for (int h = 0; h < n_kv_heads_; ++h) {
    for (int which = 0; which < 2; ++which) {
      const uint8_t* grp = group_data(layer, which, h, g);
      const uint16_t* lo = reinterpret_cast<const uint16_t*>(grp);
      const uint8_t* codes = grp + 4 * static_cast<size_t>(hd);
      const int bits = which == 0 ? scheme_.k_bits : scheme_.v_bits;
      float* out = (which == 0 ? k.data() : v.data()) + static_cast<size_t>(h) * static_cast<size_t>(hd);
      for (int i = 0; i < hd; ++i) {
        const size_t bb = static_cast<size_t>(bits);
        const uint32_t q =
            which == 0
                ? grouped::CodeInBlock8(codes + (static_cast<size_t>(u / 16) * hd + static_cast<size_t>(i)) * 2 * bb +
                                            static_cast<size_t>((u % 16) / 8) * bb,
                                        u % 8, bits)
                : grouped::CodeInBlock8(codes + static_cast<size_t>(u) * hd * bb / 8 + static_cast<size_t>(i / 8) * bb,
                                        i % 8, bits);
        out[i] = f16_to_f32_ref(lo[i]) + f16_to_f32_ref(lo[hd + i]) * static_cast<float>(q);
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
  const int64_t n_groups = std::max<int64_t>(0, scheme_.coded_end(T) - scheme_.sinks) / scheme_.group;
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
  c.k_bits = scheme_.k_bits, c.v_bits = scheme_.v_bits, c.group = scheme_.group, c.first = scheme_.sinks;
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
  if (ce == S) {  // nothing coded yet: every token exact
    decode_attention(q, n_heads, all, out, o);
    return;
  }
  std::vector<AttentionPart> parts;
  if (S > 0) parts.push_back(decode_attention_part(q, n_heads, all.subview(0, S), o));
  parts.push_back(coded_part(layer, T, q, n_heads, threads, scale));
  if (ce < T) parts.push_back(decode_attention_part(q, n_heads, all.subview(ce, T), o));
  const AttentionPart m = parts.size() == 1 ? parts.front() : merge_attention_parts(parts);
  std::copy(m.value.begin(), m.value.end(), out.begin());
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
  const int64_t coded = std::max<int64_t>(0, scheme_.coded_end(T) - scheme_.sinks);
  const int64_t exact = T - coded, groups = coded / scheme_.group;
  const uint64_t E = static_cast<uint64_t>(n_kv_heads_) * static_cast<uint64_t>(head_dim_);
  const uint64_t per_layer = static_cast<uint64_t>(coded) * E * static_cast<uint64_t>(scheme_.k_bits + scheme_.v_bits) / 8 +
                             static_cast<uint64_t>(groups) * E * 8 + static_cast<uint64_t>(exact) * E * 4;
  return per_layer * static_cast<uint64_t>(n_layers_);
}

}  // namespace kvq
