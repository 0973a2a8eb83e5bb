// Low-bit grouped KV caches (see kvq/grouped_kv.h).
#include "kvq/grouped_kv.h"

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
#include "src/groups/attention.h"
#include "src/groups/encode.h"

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

const std::vector<std::pair<std::string, GroupedKvScheme>>& grouped_kv_presets() {
  // Chosen on stories260K's dev text at ctx 512 (see README): per quality
  // tier, few steady-state bits with a margin under both of its bounds.
  // Every one allocates K bits by calibrated weights and all but kvq-6.5
  // code group parameters on a calibrated grid, so they need ranges (kvq
  // eval measures them on text the model generates).
  static const std::vector<std::pair<std::string, GroupedKvScheme>> p = {
      {"kvq-6.5", Named("k6av5g128o8x16r8")},
      {"kvq-4.5", Named("k4av3g64p8o8r16")},
      {"kvq-3.5", Named("k3av2g64p8o8r8")},
      {"kvq-2.5", Named("k2av2g96p8mo4w4r3")},
  };
  return p;
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

// ---- GroupedKvCache ------------------------------------------------------------

namespace {

constexpr int kQuad = 4;  // channels per K operand lane

// A layer's group records, back to back in chunks: a thread's share of the
// groups is one run of memory that the hardware prefetchers follow (a heap
// block a record scattered them: cold reads took 1.6x as long). Chunks
// double from one record up to kChunkBytes, so what is allocated grows with
// the records, at most one chunk ahead of them (the pages not yet taken are
// not touched); a record is zero when taken (fresh pages).
class RecordStore {
 public:
  static constexpr size_t kChunkBytes = size_t{256} << 10;
  void init(size_t rec_bytes) { rec_ = rec_bytes; }
  uint8_t* add() {
    if (left_ == 0) {
      if (used_ < chunks_.size()) {  // a chunk an earlier sequence filled (reset)
        next_ = chunks_[used_].p, left_ = chunks_[used_].bytes / rec_;
      } else {
        const size_t n = std::clamp<size_t>(ptr_.size(), 1, std::max<size_t>(1, kChunkBytes / rec_));
        const size_t bytes = (n * rec_ + kPage - 1) / kPage * kPage;
        // Pages of their own (mmap): what is resident is what was taken,
        // and a dropped cache returns them (heap chunks between other
        // allocations are neither).
        void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) throw std::bad_alloc();
        chunks_.push_back({static_cast<uint8_t*>(p), bytes});
        allocated_ += bytes;
        next_ = static_cast<uint8_t*>(p), left_ = bytes / rec_;
      }
      ++used_;
    }
    uint8_t* r = next_;
    // A fresh mapping's pages are zero; a reused slot is zeroed.
    if (used_ <= reused_) std::memset(r, 0, rec_);
    next_ += rec_, --left_;
    ptr_.push_back(r);
    return r;
  }
  // A new sequence: the records are dropped, their chunks kept for the
  // next ones (as an engine keeps its cache's memory; no page is faulted in
  // again). allocated() still counts them.
  void reset() {
    ptr_.clear();
    reused_ = used_, used_ = 0, left_ = 0, next_ = nullptr;
  }
  size_t size() const { return ptr_.size(); }
  uint8_t* operator[](size_t i) const { return ptr_[i]; }
  uint8_t* back() const { return ptr_.back(); }
  const uint8_t* const* data() const { return ptr_.data(); }
  void clear() {
    for (const Chunk& c : chunks_) ::munmap(c.p, c.bytes);
    chunks_.clear(), ptr_.clear(), ptr_.shrink_to_fit();
    left_ = 0, next_ = nullptr, allocated_ = 0, used_ = reused_ = 0;
  }
  RecordStore() = default;
  RecordStore(const RecordStore&) = delete;
  RecordStore& operator=(const RecordStore&) = delete;
  RecordStore(RecordStore&& o) noexcept { *this = std::move(o); }
  RecordStore& operator=(RecordStore&& o) noexcept {
    if (this != &o) {
      clear();
      chunks_ = std::move(o.chunks_), ptr_ = std::move(o.ptr_);
      rec_ = o.rec_, left_ = o.left_, next_ = o.next_, allocated_ = o.allocated_;
      used_ = o.used_, reused_ = o.reused_;
      o.chunks_.clear(), o.ptr_.clear(), o.left_ = 0, o.next_ = nullptr, o.allocated_ = 0;
      o.used_ = o.reused_ = 0;
    }
    return *this;
  }
  ~RecordStore() { clear(); }
  uint64_t allocated() const { return allocated_ + ptr_.capacity() * sizeof(void*) + chunks_.capacity() * sizeof(void*); }

 private:
  static constexpr size_t kPage = 4096;
  struct Chunk {
    uint8_t* p;
    size_t bytes;
  };
  std::vector<Chunk> chunks_;
  std::vector<uint8_t*> ptr_;
  size_t rec_ = 0, left_ = 0;
  size_t used_ = 0;    // chunks taken from, this sequence
  size_t reused_ = 0;  // chunks an earlier sequence wrote (zeroed as they are taken again)
  uint8_t* next_ = nullptr;
  uint64_t allocated_ = 0;
};

// fp16 units (a token's K or V of one KV head, head_dim halves) held for
// open tokens: the first group's and those outside their grid. Keys
// (pos * 2H + unit) are added in increasing order and dropped from the
// front at a hand-over.
class Fp16Pool {
 public:
  explicit Fp16Pool(size_t hd = 0) : hd_(hd) {}
  void add(int64_t key, const float* x) {
    key_.push_back(key);
    const size_t at = data_.size();
    data_.resize(at + hd_);
    f32_to_f16({x, hd_}, {data_.data() + at, hd_});
  }
  void add_halves(int64_t key, const uint16_t* h) {
    key_.push_back(key);
    data_.insert(data_.end(), h, h + hd_);
  }
  const uint16_t* find(int64_t key) const {
    const auto it = std::lower_bound(key_.begin(), key_.end(), key);
    if (it == key_.end() || *it != key) return nullptr;
    return data_.data() + static_cast<size_t>(it - key_.begin()) * hd_;
  }
  // Drops every key below `key`; gives memory back once mostly empty.
  void drop_before(int64_t key) {
    const size_t n = static_cast<size_t>(std::lower_bound(key_.begin(), key_.end(), key) - key_.begin());
    if (n == 0) return;
    key_.erase(key_.begin(), key_.begin() + static_cast<std::ptrdiff_t>(n));
    data_.erase(data_.begin(), data_.begin() + static_cast<std::ptrdiff_t>(n * hd_));
    if (data_.capacity() > 4 * data_.size() + 4096) {
      data_.shrink_to_fit();
      key_.shrink_to_fit();
    }
  }
  void clear() {
    std::vector<int64_t>().swap(key_);
    std::vector<uint16_t>().swap(data_);
  }
  size_t size() const { return key_.size(); }
  uint64_t allocated() const { return key_.capacity() * sizeof(int64_t) + data_.capacity() * sizeof(uint16_t); }
  const std::vector<int64_t>& keys() const { return key_; }

 private:
  size_t hd_;
  std::vector<int64_t> key_;
  std::vector<uint16_t> data_;
};

// Grids of the open tokens of one group g >= 1 (from group g - 1's range):
// per channel (K then V, 2E) lo, the N-bit step and the 8-bit step.
struct OpenGrid {
  int64_t group = -1;
  std::vector<float> lo, st, st8;
};

}  // namespace

struct GroupedKvCache::Impl {
  // Geometry and layout.
  int L = 0, max_seq = 0, H = 0, hd = 0;
  size_t E = 0;
  int G = 0, S = 0, R = 0, X = 0, W = 0, N = 16;
  bool calibrated = false, open_coded = false, mse = false;
  grouped::Params params = grouped::Params::kFp16;
  grouped::RecordLayout lay;  // a group record's byte layout
  size_t hdr = 0;         // one head's K (or V) parameter bytes in a record
  size_t ktile = 0;       // one head's K tile
  size_t rec_bytes = 0;   // a record (every head)
  int vw = 16;            // V channels per operand
  int k_digits = 2, v_digits = 2;
  size_t cap = 0;         // open ring slots (dynamic: G + R)
  size_t nslot = 0;       // bytes of one slot's N-bit codes (2E N / 8)
  size_t fslot = 0;       // bytes of one slot's flags
  size_t wslots = 0;      // 8-bit ring slots (W + X)
  size_t xslots = 0;      // fp16 ring slots: the last X (o<N>), every open token (fp16 open), R (calibrated)
  // Tables, per layer: K bits and offset of every (head, quad); p8 grids and
  // static lo | step, per (K|V, head): base | unit | ustep / lo | step.
  std::vector<uint8_t> qbits;
  std::vector<uint32_t> qoff;
  std::vector<float> grid, stat;
  std::vector<uint16_t> table16;  // the stored form of the grid / static table: [layer][K|V][channel][2] fp16
  std::vector<float> tcos, tsin;  // rotation at every tile start S + 16 j: (tiles, hd / 2)

  struct Layer {
    int64_t T = 0;
    RecordStore recs;                              // complete groups (calibrated: started tiles)
    int64_t n_coded = 0;                           // records with their codes (dynamic)
    std::vector<uint16_t> sink;                    // S x [K (after RoPE) | V] fp16
    std::vector<uint16_t> f16;                     // fp16 ring: slot x [K (tile frame) | V]
    std::vector<uint8_t> ncodes, flags, w8;        // o<N> rings
    Fp16Pool pool;
    std::vector<OpenGrid> grids;                   // of the groups with open tokens
  };
  std::vector<Layer> layers;

  // ---- tables ----
  const uint8_t* QuadBits(int l, int h) const { return qbits.data() + (static_cast<size_t>(l) * H + static_cast<size_t>(h)) * (static_cast<size_t>(hd) / kQuad); }
  const uint32_t* QuadOff(int l, int h) const { return qoff.data() + (static_cast<size_t>(l) * H + static_cast<size_t>(h)) * (static_cast<size_t>(hd) / kQuad); }
  int ChannelBits(int l, size_t which, size_t c) const {
    return which == 0 ? QuadBits(l, 0)[c / kQuad] : 0;  // (c spans the heads: quads are contiguous)
  }
  const float* Grid(int l, size_t which, size_t h) const {
    return grid.data() + ((static_cast<size_t>(l) * 2 + which) * E + h * static_cast<size_t>(hd)) * 3;
  }
  const float* Stat(int l, size_t which, size_t h) const {
    return stat.data() + ((static_cast<size_t>(l) * 2 + which) * E + h * static_cast<size_t>(hd)) * 2;
  }
  const float* TileCos(int64_t tile) const { return tcos.data() + static_cast<size_t>(tile) * (static_cast<size_t>(hd) / 2); }
  const float* TileSin(int64_t tile) const { return tsin.data() + static_cast<size_t>(tile) * (static_cast<size_t>(hd) / 2); }
  int64_t TileOf(int64_t pos) const { return (pos - S) / grouped::kTile; }
  // Bits of channel c (= head * hd + i) of K (which 0) or V (1).
  int Bits(int l, size_t which, size_t c) const { return which == 0 ? qbits[static_cast<size_t>(l) * E / kQuad + c / kQuad] : vbits; }
  int vbits = 0;
  int levels_k_max = 0;

  // ---- records ----
  uint8_t* NewRecord(Layer& ly) { return ly.recs.add(); }
  // Channel c's parameters in a record (decoded): lo, step.
  void RecordParams(int l, const uint8_t* rec, size_t which, size_t h, float* lo, float* st) const {
    if (params == grouped::Params::kStatic) {
      const float* sp = Stat(l, which, h);
      std::copy(sp, sp + hd, lo);
      std::copy(sp + hd, sp + 2 * hd, st);
      return;
    }
    const uint8_t* p = rec + (which == 0 ? lay.kparams(h) : lay.vparams(h));
    grouped::DecodeGroupParams(p, static_cast<size_t>(hd), params == grouped::Params::kP8 ? Grid(l, which, h) : nullptr,
                               lo, st);
  }
  // The code of token u (0..G-1 in the record) and channel i of head h.
  uint32_t RecordCode(int l, const uint8_t* rec, size_t which, size_t h, int u, size_t i) const {
    if (which == 0) {
      const size_t k = i / kQuad;
      const uint8_t* tile = rec + lay.tile(static_cast<size_t>(u / grouped::kTile), h);
      return grouped::OperandCode(tile + QuadOff(l, static_cast<int>(h))[k], kQuad * (u % grouped::kTile) + static_cast<int>(i % kQuad),
                                  QuadBits(l, static_cast<int>(h))[k]);
    }
    const size_t x = i / static_cast<size_t>(vw), n = i % static_cast<size_t>(vw);
    return grouped::OperandCode(rec + lay.voperand(h, x, static_cast<size_t>(u / 4)), static_cast<int>(4 * n) + u % 4, vbits);
  }
  void SetRecordCode(int l, uint8_t* rec, size_t which, size_t h, int u, size_t i, uint32_t q) const {
    if (which == 0) {
      const size_t k = i / kQuad;
      uint8_t* tile = rec + lay.tile(static_cast<size_t>(u / grouped::kTile), h);
      grouped::SetOperandCode(tile + QuadOff(l, static_cast<int>(h))[k], kQuad * (u % grouped::kTile) + static_cast<int>(i % kQuad),
                              QuadBits(l, static_cast<int>(h))[k], q);
      return;
    }
    const size_t x = i / static_cast<size_t>(vw), n = i % static_cast<size_t>(vw);
    grouped::SetOperandCode(rec + lay.voperand(h, x, static_cast<size_t>(u / 4)), static_cast<int>(4 * n) + u % 4, vbits, q);
  }
};

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
          KVQ_CHECK_ARG(qb[k] >= std::min(2, s.k_bits) && qb[k] <= kMaxBits, "cache tables: a K width of ", int{qb[k]},
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

namespace {

// The grid of group g's open tokens (g >= 1) from group g - 1's record, as
// the previous version computed it: per channel lo' = lo - w / 2, step' =
// 2 w / (2^N - 1), step8 = 2 w / 255, w = step (2^B - 1).
void MakeOpenGrid(const GroupedKvCache::Impl& m, int l, const uint8_t* prev, int64_t g, OpenGrid& out) {
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

const OpenGrid& GridOf(const GroupedKvCache::Impl::Layer& ly, int64_t g) {
  for (const OpenGrid& og : ly.grids) {
    if (og.group == g) return og;
  }
  KVQ_ASSERT(false);
  return ly.grids.front();
}

}  // namespace

namespace {

// The value the store holds for token pos, unit un, channel i of the open
// store, for encoding its group (fallback units and the first group in
// fp16, the rest their N-bit codes' values) or for attention at length T
// (also the last x in fp16 and the w tier's 8-bit codes).
struct OpenReader {
  const GroupedKvCache::Impl& m;
  const GroupedKvCache::Impl::Layer& ly;
  const GroupedKvScheme& s;
  int layer;
  // All 2E values of token pos into out (K in the tile frame).
  void Token(int64_t pos, bool for_attention, float* out) const {
    const size_t E = m.E, hd = static_cast<size_t>(m.hd), H = static_cast<size_t>(m.H);
    const int64_t T = ly.T;
    if (!m.open_coded) {
      f16_to_f32({ly.f16.data() + static_cast<size_t>(pos) % m.cap * 2 * E, 2 * E}, {out, 2 * E});
      return;
    }
    const int64_t g = (pos - m.S) / m.G;
    if (g >= 1 && for_attention && m.X > 0 && pos >= T - m.X) {
      f16_to_f32({ly.f16.data() + static_cast<size_t>(pos) % m.xslots * 2 * E, 2 * E}, {out, 2 * E});
      return;
    }
    const size_t slot = static_cast<size_t>(pos) % m.cap;
    const uint8_t* fl = ly.flags.data() + slot * m.fslot;
    if (g >= 1) {
      const OpenGrid& og = GridOf(ly, g);
      const bool wide = for_attention && m.W > 0 && pos >= s.wide_start(T);
      if (wide) {
        const uint8_t* c8 = ly.w8.data() + static_cast<size_t>(pos) % m.wslots * 2 * E;
        for (size_t c = 0; c < 2 * E; ++c) out[c] = og.lo[c] + og.st8[c] * static_cast<float>(c8[c]);
      } else {
        thread_local std::vector<uint8_t> q;  // read once per open token and attend: no allocation each time
        if (q.size() < 2 * E) q.resize(2 * E);
        grouped::UnpackCodes(ly.ncodes.data() + slot * m.nslot, 2 * E, m.N, q.data());
        for (size_t c = 0; c < 2 * E; ++c) out[c] = og.lo[c] + og.st[c] * static_cast<float>(q[c]);
      }
    }
    for (size_t un = 0; un < 2 * H; ++un) {
      if (g >= 1 && !((fl[un / 8] >> (un % 8)) & 1)) continue;
      const uint16_t* h = ly.pool.find(pos * static_cast<int64_t>(2 * H) + static_cast<int64_t>(un));
      KVQ_ASSERT(h != nullptr);
      f16_to_f32({h, hd}, {out + un * hd, hd});
    }
  }
};

}  // namespace

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

namespace {
// The open store of token pos (group g >= 1) from its fp16 values, as the
// store holds it (grouped_kv.h): the N-bit codes, the 8-bit ones (w), a flag
// per unit outside the grid (its fp16 values to the pool), the x ring.
void OpenFromHalves(GroupedKvCache::Impl& m, GroupedKvCache::Impl::Layer& ly, int64_t pos, const OpenGrid& og,
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
}  // namespace

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

// ---- reading -------------------------------------------------------------------

namespace {

// Token pos (0..T-1, past the sinks) of layer l as attention reads it at the
// layer's length: K in the tile frame (not yet rotated), V.
void HeldToken(const GroupedKvCache::Impl& m, const GroupedKvScheme& s, int l, int64_t pos, float* out) {
  const GroupedKvCache::Impl::Layer& ly = m.layers[static_cast<size_t>(l)];
  const size_t E = m.E, hd = static_cast<size_t>(m.hd);
  const int64_t T = ly.T, u = pos - m.S;
  if (m.calibrated && m.R > 0 && pos >= T - m.R) {
    f16_to_f32({ly.f16.data() + static_cast<size_t>(pos % m.R) * 2 * E, 2 * E}, {out, 2 * E});
    return;
  }
  if (m.calibrated || pos < s.coded_end(T)) {
    const uint8_t* rec = ly.recs[static_cast<size_t>(u / m.G)];
    std::vector<float> lo(hd), st(hd);
    for (size_t which = 0; which < 2; ++which) {
      for (size_t h = 0; h < static_cast<size_t>(m.H); ++h) {
        m.RecordParams(l, rec, which, h, lo.data(), st.data());
        for (size_t i = 0; i < hd; ++i) {
          out[which * E + h * hd + i] =
              lo[i] + st[i] * static_cast<float>(m.RecordCode(l, rec, which, h, static_cast<int>(u % m.G), i));
        }
      }
    }
    return;
  }
  OpenReader{m, ly, s, l}.Token(pos, /*for_attention=*/true, out);
}

// Tokens [t0, t1) (past the sinks) decoded to fp32 rows, K after RoPE.
AttentionPart DecodedPart(const GroupedKvCache::Impl& m, const GroupedKvScheme& s, int l, int64_t t0, int64_t t1,
                          std::span<const float> q, int n_heads, const DecodeAttentionOptions& o) {
  const size_t E = m.E;
  std::vector<float> kr(static_cast<size_t>(t1 - t0) * E), vr(kr.size()), x(2 * E);
  for (int64_t t = t0; t < t1; ++t) {
    HeldToken(m, s, l, t, x.data());
    float* k = kr.data() + static_cast<size_t>(t - t0) * E;
    std::copy(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(E), k);
    std::copy(x.begin() + static_cast<std::ptrdiff_t>(E), x.end(), vr.data() + static_cast<size_t>(t - t0) * E);
    const int64_t tile = m.TileOf(t);
    rope_rotate(k, m.H, m.hd, m.TileCos(tile), m.TileSin(tile), /*transpose=*/false);
  }
  KvRowsView rows;
  rows.scheme = KvScheme::Fp32;
  rows.n_kv_heads = m.H;
  rows.head_dim = m.hd;
  rows.k = reinterpret_cast<const uint8_t*>(kr.data());
  rows.v = reinterpret_cast<const uint8_t*>(vr.data());
  rows.slice_bytes = E * sizeof(float);
  rows.slice_stride = rows.slice_bytes * static_cast<size_t>(t1 - t0);
  rows.tokens = t1 - t0;
  return decode_attention_part(q, n_heads, rows, o);
}

// The sinks' fp16 rows (K after RoPE) as a row view.
KvRowsView SinkRows(const GroupedKvCache::Impl& m, const GroupedKvCache::Impl::Layer& ly, int64_t n) {
  KvRowsView rows;
  rows.scheme = KvScheme::Fp16;
  rows.n_kv_heads = m.H;
  rows.head_dim = m.hd;
  rows.k = reinterpret_cast<const uint8_t*>(ly.sink.data());
  rows.v = reinterpret_cast<const uint8_t*>(ly.sink.data() + static_cast<size_t>(m.S) * m.E);
  rows.slice_bytes = m.E * sizeof(uint16_t);
  rows.slice_stride = rows.slice_bytes * static_cast<size_t>(m.S);
  rows.tokens = n;
  return rows;
}

}  // namespace

void GroupedKvCache::read(int layer, int64_t pos, std::span<float> k, std::span<float> v) const {
  const int64_t T = written(layer);
  KVQ_CHECK_ARG(pos >= 0 && pos < T, "read: expected 0 <= pos < ", T, " (tokens written), got ", pos);
  const Impl& m = *impl_;
  const size_t E = m.E;
  KVQ_CHECK_ARG(k.size() == E && v.size() == E, "k, v: expected ", E, " values each");
  const Impl::Layer& ly = m.layers[static_cast<size_t>(layer)];
  if (pos < m.S) {
    f16_to_f32({ly.sink.data() + static_cast<size_t>(pos) * E, E}, k);
    f16_to_f32({ly.sink.data() + (static_cast<size_t>(m.S) + static_cast<size_t>(pos)) * E, E}, v);
    return;
  }
  std::vector<float> x(2 * E);
  HeldToken(m, scheme_, layer, pos, x.data());
  std::copy(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(E), k.begin());
  std::copy(x.begin() + static_cast<std::ptrdiff_t>(E), x.end(), v.begin());
  const int64_t tile = m.TileOf(pos);
  rope_rotate(k.data(), m.H, m.hd, m.TileCos(tile), m.TileSin(tile), /*transpose=*/false);
}

namespace {
void CheckQuery(const GroupedKvCache& c, int layer, std::span<const float> q, int n_heads) {
  const int64_t T = c.written(layer);
  KVQ_CHECK_ARG(T >= 1, "layer ", layer, ": nothing written to attend to");
  KVQ_CHECK_ARG(n_heads >= 1 && n_heads % c.n_kv_heads() == 0 && n_heads / c.n_kv_heads() <= 64, "n_heads: expected a ",
                "multiple of n_kv_heads ", c.n_kv_heads(), " (at most 64 per KV head), got ", n_heads);
  KVQ_CHECK_ARG(q.size() == static_cast<size_t>(n_heads) * static_cast<size_t>(c.head_dim()), "q: expected ",
                n_heads * c.head_dim(), " values, got ", q.size());
  for (size_t i = 0; i < q.size(); ++i) KVQ_CHECK_ARG(std::isfinite(q[i]), "q: non-finite value at ", i);
}
}  // namespace

namespace {

// The fused kernel's call for layer l over its coded groups (calibrated:
// whole tiles), q already scaled.
grouped::Call KernelCall(const GroupedKvCache::Impl& m, int l, const float* qs, int n_heads) {
  grouped::Call c;
  c.groups = m.layers[static_cast<size_t>(l)].recs.data();
  c.layout = m.lay;
  c.n_kv_heads = m.H, c.head_dim = m.hd, c.n_heads = n_heads, c.group = m.G, c.v_bits = m.vbits;
  c.params = m.params;
  c.k_digits = m.k_digits, c.v_digits = m.v_digits;
  c.first = m.S;
  c.q = qs;
  c.tile_cos = m.tcos.data(), c.tile_sin = m.tsin.data();
  if (m.calibrated) c.k_static = m.Stat(l, 0, 0), c.v_static = m.Stat(l, 1, 0);
  if (m.params == grouped::Params::kP8) c.k_grid = m.Grid(l, 0, 0), c.v_grid = m.Grid(l, 1, 0);
  c.k_quad_bits = m.QuadBits(l, 0);
  c.k_quad_off = m.QuadOff(l, 0);
  return c;
}

// Groups the kernel reads at the layer's length, and where the tokens it
// does not read start.
std::pair<int64_t, int64_t> KernelExtent(const GroupedKvCache::Impl& m, const GroupedKvScheme& s, int l) {
  const GroupedKvCache::Impl::Layer& ly = m.layers[static_cast<size_t>(l)];
  const int64_t S = std::min<int64_t>(m.S, ly.T);
  if (m.calibrated) {
    const int64_t ce = std::max<int64_t>(S, s.coded_end(ly.T));
    const int64_t n = (ce - S) / grouped::kTile;
    return {n, S + n * grouped::kTile};
  }
  return {ly.n_coded, S + ly.n_coded * m.G};
}

}  // namespace

AttentionPart GroupedKvCache::coded_part(int layer, std::span<const float> q, int n_heads, int threads,
                                         float scale) const {
  CheckQuery(*this, layer, q, n_heads);
  KVQ_CHECK_ARG(threads >= 0 && threads <= 1024, "threads: expected 0..1024, got ", threads);
  KVQ_CHECK_ARG(std::isfinite(scale) && scale >= 0.0f, "scale: expected a finite value >= 0, got ", scale);
  const Impl& m = *impl_;
  const size_t nv = static_cast<size_t>(n_heads) * static_cast<size_t>(m.hd);
  const float sc = scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(m.hd));
  std::vector<float> qs(q.begin(), q.end());
  for (float& x : qs) x *= sc;
  const int64_t n_groups = KernelExtent(m, scheme_, layer).first;
  AttentionPart out;
  out.log_mass.assign(static_cast<size_t>(n_heads), -std::numeric_limits<double>::infinity());
  out.value.assign(nv, 0.0f);
  if (n_groups <= 0) return out;
  grouped::Call c = KernelCall(m, layer, qs.data(), n_heads);
  c.g0 = 0, c.g1 = n_groups, c.log_mass = out.log_mass.data(), c.value = out.value.data();
  if (threads == 1) {
    grouped::Attend(c);
    return out;
  }
  const int nt = static_cast<int>(std::min<int64_t>(threads > 0 ? threads : omp_get_max_threads(), n_groups));
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

void GroupedKvCache::attend(int layer, std::span<const float> q, int n_heads, std::span<float> out, int threads,
                            float scale) const {
  CheckQuery(*this, layer, q, n_heads);
  KVQ_CHECK_ARG(out.size() == q.size(), "out: expected ", q.size(), " values, got ", out.size());
  KVQ_CHECK_ARG(threads >= 0 && threads <= 1024, "threads: expected 0..1024, got ", threads);
  KVQ_CHECK_ARG(std::isfinite(scale) && scale >= 0.0f, "scale: expected a finite value >= 0, got ", scale);
  const Impl& m = *impl_;
  const Impl::Layer& ly = m.layers[static_cast<size_t>(layer)];
  const size_t nv = static_cast<size_t>(n_heads) * static_cast<size_t>(m.hd);
  const int64_t T = ly.T, S = std::min<int64_t>(m.S, T);
  const auto extent = KernelExtent(m, scheme_, layer);
  const int64_t n_groups = extent.first, ke = extent.second;  // (lambdas capture no bindings before clang 16)
  const float sc = scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(m.hd));
  std::vector<float> qs(q.begin(), q.end());
  for (float& x : qs) x *= sc;
  const grouped::Call c = KernelCall(m, layer, qs.data(), n_heads);
  DecodeAttentionOptions o;
  o.scale = scale;
  o.threads = 1;
  // The coded groups in chunks (a few per thread, taken as threads come
  // free: one slow core does not hold the call), then the tokens read
  // decoded (the open tokens, a calibrated cache's partial tile) in a
  // share per thread, then the sinks. Parts merge by log-sum-exp.
  const int64_t n_open = T - ke;
  int nt = threads > 0 ? threads : omp_get_max_threads();
  if (n_groups * 16 + n_open < 256) nt = 1;  // short: not worth a thread team
  const int64_t chunks = nt == 1 ? std::min<int64_t>(n_groups, 1) : std::min<int64_t>(n_groups, 4 * nt);
  const int64_t opens = n_open > 0 ? nt : 0, items = chunks + opens + (S > 0 ? 1 : 0);
  std::vector<AttentionPart> parts(static_cast<size_t>(items));
  const auto work = [&](int64_t i) {
    AttentionPart& p = parts[static_cast<size_t>(i)];
    if (i < chunks) {
      p.log_mass.resize(static_cast<size_t>(n_heads));
      p.value.resize(nv);
      grouped::Call ci = c;
      ci.g0 = n_groups * i / chunks, ci.g1 = n_groups * (i + 1) / chunks;
      ci.log_mass = p.log_mass.data(), ci.value = p.value.data();
      grouped::Attend(ci);
    } else if (i < chunks + opens) {
      const int64_t j = i - chunks, t0 = ke + n_open * j / opens, t1 = ke + n_open * (j + 1) / opens;
      if (t1 > t0) p = DecodedPart(m, scheme_, layer, t0, t1, q, n_heads, o);
    } else {
      p = decode_attention_part(q, n_heads, SinkRows(m, ly, S), o);
    }
  };
  if (nt == 1) {
    for (int64_t i = 0; i < items; ++i) work(i);
  } else {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) work(i);
  }
  std::vector<AttentionPart> used;
  for (AttentionPart& p : parts) {
    if (!p.log_mass.empty()) used.push_back(std::move(p));
  }
  const AttentionPart r = used.size() == 1 ? used.front() : merge_attention_parts(used);
  std::copy(r.value.begin(), r.value.end(), out.begin());
}

void GroupedKvCache::attend_ref(int layer, std::span<const float> q, int n_heads, std::span<float> out,
                                float scale) const {
  CheckQuery(*this, layer, q, n_heads);
  KVQ_CHECK_ARG(out.size() == q.size(), "out: expected ", q.size(), " values, got ", out.size());
  const int64_t T = written(layer);
  const int hd = head_dim_, rep = n_heads / n_kv_heads_;
  const size_t E = static_cast<size_t>(n_kv_heads_) * static_cast<size_t>(hd);
  const double s = scale > 0.0f ? scale : 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<float> K(static_cast<size_t>(T) * E), V(K.size());
  for (int64_t t = 0; t < T; ++t) {
    read(layer, t, {K.data() + static_cast<size_t>(t) * E, E}, {V.data() + static_cast<size_t>(t) * E, E});
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

// ---- accounting ------------------------------------------------------------------

uint64_t GroupedKvCache::layer_bytes(int layer) const {
  const int64_t T = written(layer);
  const Impl& m = *impl_;
  uint64_t total = scheme_.layer_bytes(T, n_kv_heads_, head_dim_);
  if (!m.open_coded || T <= 0) return total;
  // Open units held in fp16 instead of their codes (outside the grid).
  const Impl::Layer& ly = m.layers[static_cast<size_t>(layer)];
  const auto [o0, f1, x0] = scheme_.OpenFp16(T);
  const int64_t w0 = scheme_.wide_start(T);
  const size_t hd = static_cast<size_t>(m.hd), H2 = 2 * static_cast<size_t>(m.H);
  for (int64_t t = std::max(o0, f1); t < x0; ++t) {
    const uint8_t* fl = ly.flags.data() + static_cast<size_t>(t) % m.cap * m.fslot;
    const int held = m.W > 0 && t >= w0 ? 8 : m.N;  // the unit's code width
    for (size_t un = 0; un < H2; ++un) {
      if ((fl[un / 8] >> (un % 8)) & 1) total += 2 * hd - hd * static_cast<size_t>(held) / 8;
    }
  }
  return total;
}

uint64_t GroupedKvCache::bytes() const {
  uint64_t total = 0;
  for (int l = 0; l < n_layers_; ++l) total += layer_bytes(l);
  return total;
}

double GroupedKvCache::bits() const {
  double tokens = 0;
  for (int l = 0; l < n_layers_; ++l) tokens += static_cast<double>(written(l));
  const double elements = 2.0 * tokens * static_cast<double>(impl_->E);
  return elements > 0 ? 8.0 * static_cast<double>(bytes()) / elements : 0.0;
}

uint64_t GroupedKvCache::allocated_bytes() const {
  const Impl& m = *impl_;
  uint64_t b = m.qbits.capacity() + 4 * m.qoff.capacity() + 4 * (m.grid.capacity() + m.stat.capacity()) +
               2 * m.table16.capacity() + 4 * (m.tcos.capacity() + m.tsin.capacity());
  for (const Impl::Layer& ly : m.layers) {
    b += ly.recs.allocated();
    b += 2 * (ly.sink.capacity() + ly.f16.capacity()) + ly.ncodes.capacity() + ly.flags.capacity() + ly.w8.capacity();
    b += ly.pool.allocated();
    for (const OpenGrid& og : ly.grids) b += 4 * (og.lo.capacity() + og.st.capacity() + og.st8.capacity());
  }
  return b;
}

// ---- the held state as bytes -----------------------------------------------------
//
// Per layer, in this order (little-endian; T = the layer's length, o0 =
// max(S, coded_end(T))):
//   sinks      min(S, T) K rows then as many V rows, fp16 (K after RoPE)
//   calibrated every started tile's record (codes), then the last
//              min(R, T - S) tokens' fp16 K (tile frame) | V
//   dynamic    every complete group's record, per head: K parameters, K
//              tiles (coded groups only), V parameters, V codes (coded only);
//              then each open token in [o0, T): fp16 K | V (no o<N>, the
//              first group, the last x), or its flags (a bit per unit) and per
//              unit its codes (N-bit, or 8-bit in the w tier) or, when
//              flagged, its fp16 values.
// Its size is layer_bytes() less the tables (saved by the container).

namespace {

void PutHalves(std::vector<uint8_t>& out, const uint16_t* h, size_t n) {
  if (n == 0) return;
  const size_t at = out.size();
  out.resize(at + 2 * n);
  std::memcpy(out.data() + at, h, 2 * n);
}
void PutBytes(std::vector<uint8_t>& out, const uint8_t* p, size_t n) { out.insert(out.end(), p, p + n); }

// Bounds-checked reads of a saved state held in one or more pieces (a
// restore from ranges reads the ranges' pieces in place). A read within a
// piece points into it; one across pieces is gathered into a scratch buffer
// (valid until the next read).
struct StateReader {
  std::span<const std::span<const uint8_t>> pieces;
  size_t total = 0, pos = 0, piece = 0, off = 0;
  std::vector<uint8_t> scratch;
  explicit StateReader(std::span<const std::span<const uint8_t>> p) : pieces(p) {
    for (const auto& x : pieces) total += x.size();
  }
  size_t left() const { return total - pos; }
  const uint8_t* take(size_t n) {
    static const uint8_t kNone = 0;
    if (n > total - pos) Fail("cache state: truncated (needs ", n, " bytes at byte ", pos, " of ", total, ")");
    pos += n;
    if (n == 0) return &kNone;
    while (off == pieces[piece].size()) ++piece, off = 0;
    if (pieces[piece].size() - off >= n) {
      const uint8_t* p = pieces[piece].data() + off;
      off += n;
      return p;
    }
    scratch.resize(n);
    for (size_t got = 0; got < n;) {
      while (off == pieces[piece].size()) ++piece, off = 0;
      const size_t k = std::min(n - got, pieces[piece].size() - off);
      std::memcpy(scratch.data() + got, pieces[piece].data() + off, k);
      got += k, off += k;
    }
    return scratch.data();
  }
  // fp16 values that must be finite.
  void halves(uint16_t* out, size_t n, const char* what) {
    if (n == 0) return;
    std::memcpy(out, take(2 * n), 2 * n);
    for (size_t i = 0; i < n; ++i) {
      if ((out[i] & 0x7C00) == 0x7C00) Fail("cache state: non-finite fp16 value in ", what);
    }
  }
};

}  // namespace

// Records that never change once the cache holds T tokens: the coded groups
// (dynamic) or the full tiles (calibrated).
int64_t GroupedKvCache::final_records(int64_t T) const {
  const int64_t S = scheme_.sinks;
  if (T <= S) return 0;
  return scheme_.calibrated ? (T - S) / 16 : (scheme_.coded_end(T) - S) / scheme_.group;
}

// One layer's held bytes as save_state writes them, from token `from` on:
// the sinks in [from, T), the final records made since `from` and the rest
// (the records still changing and the open tokens; in a range, after its
// u64 size).
void GroupedKvCache::SaveLayer(int l, int64_t from, bool range, std::vector<uint8_t>& out) const {
  const Impl& m = *impl_;
  const size_t E = m.E, hd = static_cast<size_t>(m.hd), H2 = 2 * static_cast<size_t>(m.H);
  const Impl::Layer& ly = m.layers[static_cast<size_t>(l)];
  const int64_t T = ly.T;
  const size_t s0 = static_cast<size_t>(std::min<int64_t>(m.S, from)), s1 = static_cast<size_t>(std::min<int64_t>(m.S, T));
  PutHalves(out, ly.sink.data() + s0 * E, (s1 - s0) * E);
  PutHalves(out, ly.sink.data() + (static_cast<size_t>(m.S) + s0) * E, (s1 - s0) * E);
  const size_t f0 = static_cast<size_t>(final_records(from)), f1 = static_cast<size_t>(final_records(T));
  KVQ_ASSERT(f1 <= ly.recs.size() && (m.calibrated || static_cast<int64_t>(f1) == ly.n_coded));
  for (size_t g = f0; g < f1; ++g) PutBytes(out, ly.recs[g], m.rec_bytes);
  size_t size_at = out.size();
  if (range) out.resize(out.size() + 8);
  const size_t tail_at = out.size();
  if (T > m.S && m.calibrated) {
    for (size_t g = f1; g < ly.recs.size(); ++g) PutBytes(out, ly.recs[g], m.rec_bytes);
    for (int64_t t = std::max<int64_t>(m.S, T - m.R); t < T; ++t) {
      PutHalves(out, ly.f16.data() + static_cast<size_t>(t % m.R) * 2 * E, 2 * E);
    }
  } else if (T > m.S) {
    // parameters from completion, codes from the hand-over
    for (size_t g = f1; g < ly.recs.size(); ++g) PutBytes(out, ly.recs[g], m.lay.codes());
    const int64_t o0 = std::max<int64_t>(m.S, scheme_.coded_end(T)), w0 = scheme_.wide_start(T);
    std::vector<float> x(2 * E);
    std::vector<uint16_t> h16(2 * E);
    const OpenReader rd{m, ly, scheme_, l};
    for (int64_t t = o0; t < T; ++t) {
      const int64_t g = (t - m.S) / m.G;
      if (!m.open_coded || g == 0 || (m.X > 0 && t >= T - m.X)) {  // fp16 whole
        rd.Token(t, /*for_attention=*/true, x.data());
        f32_to_f16(x, h16);
        PutHalves(out, h16.data(), 2 * E);
        continue;
      }
      const size_t slot = static_cast<size_t>(t) % m.cap;
      const uint8_t* fl = ly.flags.data() + slot * m.fslot;
      PutBytes(out, fl, m.fslot);
      const bool wide = m.W > 0 && t >= w0;
      for (size_t un = 0; un < H2; ++un) {
        if ((fl[un / 8] >> (un % 8)) & 1) {
          PutHalves(out, ly.pool.find(t * static_cast<int64_t>(H2) + static_cast<int64_t>(un)), hd);
        } else if (wide) {
          PutBytes(out, ly.w8.data() + static_cast<size_t>(t) % m.wslots * 2 * E + un * hd, hd);
        } else {
          const size_t ub = hd * static_cast<size_t>(m.N) / 8;
          PutBytes(out, ly.ncodes.data() + slot * m.nslot + un * ub, ub);
        }
      }
    }
  }
  if (range) {
    const uint64_t tail = out.size() - tail_at;
    std::memcpy(out.data() + size_at, &tail, 8);
  }
}

void GroupedKvCache::save_state(std::vector<uint8_t>& out) const {
  for (int l = 0; l < n_layers_; ++l) SaveLayer(l, 0, /*range=*/false, out);
}

void GroupedKvCache::save_range_state(int64_t from, std::vector<uint8_t>& out) const {
  for (int l = 0; l < n_layers_; ++l) {
    const int64_t T = written(l);
    KVQ_CHECK_ARG(from >= 0 && from < T, "range: expected a first token in 0..", T - 1, " (layer ", l, " holds ", T,
                  " tokens), got ", from);
  }
  for (int l = 0; l < n_layers_; ++l) SaveLayer(l, from, /*range=*/true, out);
}

void GroupedKvCache::load_range_states(std::span<const std::span<const uint8_t>> parts,
                                       std::span<const int64_t> ends) {
  KVQ_CHECK_ARG(!parts.empty() && parts.size() == ends.size(), "ranges: expected as many ends as states (>= 1), got ",
                ends.size(), " and ", parts.size());
  const Impl& m = *impl_;
  const size_t L = static_cast<size_t>(n_layers_), E = m.E;
  // Where each piece lies (no copy yet): per layer the sinks' K and V, the
  // final records of every range, and the open state of the last one.
  using Piece = std::span<const uint8_t>;
  std::vector<std::vector<Piece>> sk(L), sv(L), recs(L);
  std::vector<Piece> tail(L);
  int64_t begin = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t end = ends[i];
    KVQ_CHECK_ARG(end > begin && end <= max_seq_, "ranges: range ", i, " ends at ", end, ", expected ", begin + 1,
                  "..", max_seq_);
    StateReader rd{std::span(&parts[i], 1)};
    const size_t ns = static_cast<size_t>(std::min<int64_t>(m.S, end) - std::min<int64_t>(m.S, begin));
    const size_t nf = static_cast<size_t>(final_records(end) - final_records(begin));
    auto take = [&](size_t n) { return Piece(rd.take(n), n); };
    for (size_t l = 0; l < L; ++l) {
      sk[l].push_back(take(2 * ns * E));
      sv[l].push_back(take(2 * ns * E));
      KVQ_CHECK_ARG(nf <= rd.left() / std::max<size_t>(m.rec_bytes, 1), "cache state: range ", i,
                    " is truncated (", nf, " records of ", m.rec_bytes, " bytes)");
      recs[l].push_back(take(nf * m.rec_bytes));
      uint64_t n;
      std::memcpy(&n, rd.take(8), 8);
      KVQ_CHECK_ARG(n <= rd.left(), "cache state: range ", i, " layer ", l, ": ", n,
                    " bytes of open state past the end");
      tail[l] = take(static_cast<size_t>(n));
    }
    KVQ_CHECK_ARG(rd.left() == 0, "cache state: range ", i, " has ", rd.left(), " bytes past its last layer");
    begin = end;
  }
  // The whole state's order, read in place.
  std::vector<Piece> whole;
  for (size_t l = 0; l < L; ++l) {
    for (const auto* v : {&sk[l], &sv[l], &recs[l]}) whole.insert(whole.end(), v->begin(), v->end());
    whole.push_back(tail[l]);
  }
  const std::vector<int64_t> lengths(L, begin);
  LoadPieces(whole, lengths);
}

void GroupedKvCache::load_state(std::span<const uint8_t> in, std::span<const int64_t> lengths) {
  LoadPieces(std::span(&in, 1), lengths);
}

void GroupedKvCache::LoadPieces(std::span<const std::span<const uint8_t>> in, std::span<const int64_t> lengths) {
  Impl& m = *impl_;
  KVQ_CHECK_ARG(lengths.size() == static_cast<size_t>(n_layers_), "cache state: expected ", n_layers_,
                " layer lengths, got ", lengths.size());
  for (int64_t T : lengths) {
    KVQ_CHECK_ARG(T >= 0 && T <= max_seq_, "cache state: a layer length of ", T, " is outside 0..", max_seq_);
  }
  const size_t E = m.E, hd = static_cast<size_t>(m.hd), H2 = 2 * static_cast<size_t>(m.H);
  StateReader rd{in};
  try {
    for (int l = 0; l < n_layers_; ++l) {
      Impl::Layer& ly = m.layers[static_cast<size_t>(l)];
      ly.recs.clear(), ly.n_coded = 0, ly.pool.clear(), ly.grids.clear();
      const int64_t T = lengths[static_cast<size_t>(l)];
      ly.T = T;
      const size_t ns = static_cast<size_t>(std::min<int64_t>(m.S, T));
      rd.halves(ly.sink.data(), ns * E, "the sinks");
      rd.halves(ly.sink.data() + static_cast<size_t>(m.S) * E, ns * E, "the sinks");
      if (T <= m.S) continue;
      if (m.calibrated) {
        for (int64_t j = 0; j < (T - m.S + 15) / 16; ++j) std::memcpy(m.NewRecord(ly), rd.take(m.rec_bytes), m.rec_bytes);
        for (int64_t t = std::max<int64_t>(m.S, T - m.R); t < T; ++t) {
          rd.halves(ly.f16.data() + static_cast<size_t>(t % m.R) * 2 * E, 2 * E, "the recent tokens");
        }
        continue;
      }
      const int64_t complete = (scheme_.complete_end(T) - m.S) / m.G, coded = (scheme_.coded_end(T) - m.S) / m.G;
      for (int64_t g = 0; g < complete; ++g) {
        uint8_t* rec = m.NewRecord(ly);
        std::memcpy(rec, rd.take(g < coded ? m.rec_bytes : m.lay.codes()), g < coded ? m.rec_bytes : m.lay.codes());
        for (size_t which = 0; which < 2; ++which) {
          for (size_t h = 0; h < static_cast<size_t>(m.H); ++h) {
            const uint8_t* prm = rec + (which == 0 ? m.lay.kparams(h) : m.lay.vparams(h));
            if (m.params == grouped::Params::kP8) {
              for (size_t i = 0; i < hd; ++i) {
                if (prm[i] > prm[hd + i]) Fail("cache state: a group range with its low end above its high end");
              }
            } else {
              for (size_t i = 0; i < 2 * hd; ++i) {
                uint16_t h16;
                std::memcpy(&h16, prm + 2 * i, 2);
                if ((h16 & 0x7C00) == 0x7C00 || (i >= hd && (h16 & 0x8000) && (h16 & 0x7FFF))) {
                  Fail("cache state: a group parameter that is not finite or a negative step");
                }
              }
            }
          }
        }
      }
      ly.n_coded = coded;
      const int64_t o0 = std::max<int64_t>(m.S, scheme_.coded_end(T)), w0 = scheme_.wide_start(T);
      std::vector<uint16_t> h16(2 * E);
      std::vector<float> x(2 * E);
      for (int64_t t = o0; t < T; ++t) {
        const int64_t g = (t - m.S) / m.G;
        const size_t slot = static_cast<size_t>(t) % std::max<size_t>(m.cap, 1);
        if (m.open_coded && g >= 1 && (ly.grids.empty() || ly.grids.back().group != g)) {
          ly.grids.emplace_back();
          MakeOpenGrid(m, l, ly.recs[static_cast<size_t>(g - 1)], g, ly.grids.back());
        }
        if (!m.open_coded) {
          rd.halves(ly.f16.data() + slot * 2 * E, 2 * E, "an open token");
          continue;
        }
        if (g == 0) {
          rd.halves(h16.data(), 2 * E, "an open token");
          std::fill(ly.flags.begin() + static_cast<std::ptrdiff_t>(slot * m.fslot),
                    ly.flags.begin() + static_cast<std::ptrdiff_t>((slot + 1) * m.fslot), 0xFF);
          for (size_t un = 0; un < H2; ++un) ly.pool.add_halves(t * static_cast<int64_t>(H2) + static_cast<int64_t>(un), h16.data() + un * hd);
          continue;
        }
        const OpenGrid& og = ly.grids.back();
        if (m.X > 0 && t >= T - m.X) {
          rd.halves(h16.data(), 2 * E, "an open token");
          f16_to_f32(h16, x);
          OpenFromHalves(m, ly, t, og, x.data());
          continue;
        }
        uint8_t* fl = ly.flags.data() + slot * m.fslot;
        std::memcpy(fl, rd.take(m.fslot), m.fslot);
        if (H2 % 8 != 0 && (fl[m.fslot - 1] >> (H2 % 8)) != 0) Fail("cache state: flag bits set past the last unit");
        const bool wide = m.W > 0 && t >= w0;
        const size_t ub = hd * static_cast<size_t>(m.N) / 8;
        std::vector<uint8_t> qn(2 * E, 0);
        uint8_t* c8 = wide ? ly.w8.data() + static_cast<size_t>(t) % m.wslots * 2 * E : nullptr;
        for (size_t un = 0; un < H2; ++un) {
          if ((fl[un / 8] >> (un % 8)) & 1) {
            rd.halves(h16.data(), hd, "a fallback unit");
            ly.pool.add_halves(t * static_cast<int64_t>(H2) + static_cast<int64_t>(un), h16.data());
          } else if (wide) {
            std::memcpy(c8 + un * hd, rd.take(hd), hd);
            const int nlev = (1 << m.N) - 1;
            for (size_t i = 0; i < hd; ++i) {  // the N-bit codes made from the 8-bit ones, as write() does
              const size_t c = un * hd + i;
              qn[c] = Code(og.lo[c] + og.st8[c] * static_cast<float>(c8[c]), og.lo[c], og.st[c], nlev);
            }
          } else {
            const uint8_t* p = rd.take(ub);
            for (size_t i = 0; i < hd; ++i) qn[un * hd + i] = static_cast<uint8_t>(grouped::OperandCode(p, static_cast<int>(i), m.N));
          }
        }
        grouped::PackOperand(qn.data(), static_cast<int>(2 * E), m.N, ly.ncodes.data() + slot * m.nslot);
      }
    }
    if (rd.left() != 0) Fail("cache state: ", rd.left(), " bytes past the end of the last layer");
  } catch (...) {
    for (Impl::Layer& ly : m.layers) {
      ly.T = 0, ly.recs.clear(), ly.n_coded = 0, ly.pool.clear(), ly.grids.clear();
    }
    throw;
  }
}

}  // namespace kvq
