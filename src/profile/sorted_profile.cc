// G4: the sorted-profile (parametric tail) quantizer (SPEC §3).
#include "kvq/sorted_profile.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include <unsupported/Eigen/SpecialFunctions>

#include "hwy/contrib/sort/vqsort.h"

#include "src/io/container.h"
#include "src/base/names.h"

namespace kvq {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;

double GaussPdf(double z) { return std::isinf(z) ? 0.0 : kInvSqrt2Pi * std::exp(-0.5 * z * z); }

// Antiderivative of z * f(z) for the standard Laplace, zero at -inf.
double LaplacePartialMeanFromMinusInf(double z) {
  if (z == -kInf || z == kInf) return 0.0;
  return z < 0 ? 0.5 * (z - 1.0) * std::exp(z) : -0.5 * (z + 1.0) * std::exp(-z);
}

}  // namespace

// ---- Estimator: derived quantities --------------------------------------

double Estimator::std_interval_prob(double a, double b) const {
  if (!(b > a)) return 0.0;
  // Subtract on the side where both terms are small, avoiding cancellation.
  const double p = a >= 0 ? std_sf(a) - std_sf(b) : std_cdf(b) - std_cdf(a);
  return std::max(p, 0.0);
}

double Estimator::std_conditional_mean(double a, double b) const {
  const double p = std_interval_prob(a, b);
  if (p > 0.0) {
    const double m = std_partial_mean(a, b) / p;
    if (std::isfinite(m)) return std::clamp(m, a, b);
  }
  // The interval carries (numerically) no mass: pick its finite middle.
  if (std::isinf(a) && std::isinf(b)) return 0.0;
  if (std::isinf(a)) return b;
  if (std::isinf(b)) return a;
  return 0.5 * (a + b);
}

double Estimator::cdf(double x, const LocScale& p) const {
  return std_cdf((x - p.loc) / p.scale);
}
double Estimator::inv_cdf(double prob, const LocScale& p) const {
  return p.loc + p.scale * std_inv_cdf(prob);
}
double Estimator::conditional_mean(double a, double b, const LocScale& p) const {
  return p.loc + p.scale * std_conditional_mean((a - p.loc) / p.scale, (b - p.loc) / p.scale);
}

// ---- Gaussian ------------------------------------------------------------

namespace {

void CheckFitInput(std::span<const float> v, const char* who) {
  KVQ_CHECK_ARG(!v.empty(), "values: ", who, " needs at least one value");
  const int64_t bad = first_non_finite(v);
  KVQ_CHECK_ARG(bad < 0, "values: ", who, " expected finite values, element ", bad, " is ",
                bad >= 0 ? v[static_cast<size_t>(bad)] : 0.0f);
}

}  // namespace

LocScale GaussianEstimator::fit(std::span<const float> v) const {
  CheckFitInput(v, "GaussianEstimator::fit");
  double sum = 0.0;
  for (float x : v) sum += x;
  const double mean = sum / static_cast<double>(v.size());
  double ss = 0.0;
  for (float x : v) ss += (x - mean) * (x - mean);
  return {mean, std::sqrt(ss / static_cast<double>(v.size()))};
}
double GaussianEstimator::std_cdf(double z) const { return 0.5 * std::erfc(-z * kInvSqrt2); }
double GaussianEstimator::std_sf(double z) const { return 0.5 * std::erfc(z * kInvSqrt2); }
double GaussianEstimator::std_inv_cdf(double p) const {
  if (p <= 0.0) return -kInf;
  if (p >= 1.0) return kInf;
  return Eigen::numext::ndtri(p);
}
double GaussianEstimator::std_partial_mean(double a, double b) const {
  return GaussPdf(a) - GaussPdf(b);
}

// ---- Laplace -------------------------------------------------------------

LocScale LaplaceEstimator::fit(std::span<const float> v) const {
  CheckFitInput(v, "LaplaceEstimator::fit");
  std::vector<float> s(v.begin(), v.end());
  const size_t mid = s.size() / 2;
  std::nth_element(s.begin(), s.begin() + static_cast<ptrdiff_t>(mid), s.end());
  double median = s[mid];
  if (s.size() % 2 == 0) {
    const float lower = *std::max_element(s.begin(), s.begin() + static_cast<ptrdiff_t>(mid));
    median = 0.5 * (static_cast<double>(lower) + median);
  }
  double mad = 0.0;
  for (float x : v) mad += std::fabs(x - median);
  return {median, mad / static_cast<double>(v.size())};
}
double LaplaceEstimator::std_cdf(double z) const {
  return z < 0 ? 0.5 * std::exp(z) : 1.0 - 0.5 * std::exp(-z);
}
double LaplaceEstimator::std_sf(double z) const {
  return z > 0 ? 0.5 * std::exp(-z) : 1.0 - 0.5 * std::exp(z);
}
double LaplaceEstimator::std_inv_cdf(double p) const {
  if (p <= 0.0) return -kInf;
  if (p >= 1.0) return kInf;
  return p < 0.5 ? std::log(2.0 * p) : -std::log(2.0 * (1.0 - p));
}
double LaplaceEstimator::std_partial_mean(double a, double b) const {
  return LaplacePartialMeanFromMinusInf(b) - LaplacePartialMeanFromMinusInf(a);
}

// ---- codebooks -----------------------------------------------------------

constexpr NamedValue<Codebook> kCodebooks[] = {{Codebook::LloydMax, "lloyd_max"}, {Codebook::Quantile, "quantile"}};
const char* codebook_name(Codebook c) { return name_of(kCodebooks, c, "?"); }
Codebook parse_codebook(const std::string& s, const char* arg) { return parse_name(kCodebooks, s, arg); }

namespace {

StdCodebook QuantileCodebook(const Estimator& f, int bits) {
  const int L = 1 << bits;
  StdCodebook cb;
  cb.thresholds.resize(static_cast<size_t>(L - 1));
  for (int i = 1; i < L; ++i) cb.thresholds[i - 1] = f.std_inv_cdf(static_cast<double>(i) / L);
  cb.levels.resize(static_cast<size_t>(L));
  for (int i = 0; i < L; ++i) {
    const double a = i == 0 ? -kInf : cb.thresholds[i - 1];
    const double b = i == L - 1 ? kInf : cb.thresholds[i];
    cb.levels[i] = f.std_conditional_mean(a, b);
  }
  return cb;
}

// Lloyd's algorithm on the exact family: thresholds at midpoints of adjacent
// levels, levels at the centroids of their bins, from the quantile codebook.
StdCodebook LloydMaxCodebook(const Estimator& f, int bits) {
  StdCodebook cb = QuantileCodebook(f, bits);
  const size_t L = cb.levels.size();
  for (int iter = 0; iter < 200000; ++iter) {
    for (size_t i = 0; i + 1 < L; ++i) cb.thresholds[i] = 0.5 * (cb.levels[i] + cb.levels[i + 1]);
    double moved = 0.0;
    for (size_t i = 0; i < L; ++i) {
      const double a = i == 0 ? -kInf : cb.thresholds[i - 1];
      const double b = i == L - 1 ? kInf : cb.thresholds[i];
      const double y = f.std_conditional_mean(a, b);
      moved = std::max(moved, std::fabs(y - cb.levels[i]));
      cb.levels[i] = y;
    }
    if (moved < 1e-12) break;
  }
  for (size_t i = 0; i + 1 < L; ++i) cb.thresholds[i] = 0.5 * (cb.levels[i] + cb.levels[i + 1]);
  return cb;
}

}  // namespace

const StdCodebook& standard_codebook(const Estimator& family, Codebook kind, int bits) {
  KVQ_CHECK_ARG(bits >= 1 && bits <= 8, "bits: expected 1..8, got ", bits);
  KVQ_CHECK_ARG(kind == Codebook::LloydMax || kind == Codebook::Quantile,
                "codebook: expected LloydMax or Quantile, got ", static_cast<int>(kind));
  static std::mutex mu;
  static std::map<std::tuple<std::string, int, int>, std::unique_ptr<StdCodebook>> cache;
  const auto key = std::make_tuple(family.name(), static_cast<int>(kind), bits);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) {
    auto cb = std::make_unique<StdCodebook>(kind == Codebook::LloydMax ? LloydMaxCodebook(family, bits)
                                                                       : QuantileCodebook(family, bits));
    it = cache.emplace(key, std::move(cb)).first;
  }
  return *it->second;
}

// ---- KS ------------------------------------------------------------------

double ks_statistic_sorted(std::span<const float> sorted, const Estimator& family,
                           const LocScale& p) {
  const double m = static_cast<double>(sorted.size());
  double d = 0.0;
  for (size_t i = 0; i < sorted.size(); ++i) {
    const double F = family.cdf(sorted[i], p);
    d = std::max({d, static_cast<double>(i + 1) / m - F, F - static_cast<double>(i) / m});
  }
  return d;
}

double kolmogorov_q(double lambda) {
  if (!(lambda > 0.0)) return 1.0;
  if (lambda < 1.18) {
    // P(K <= l) = sqrt(2 pi) / l * sum_k exp(-(2k-1)^2 pi^2 / (8 l^2)), fast for small l.
    const double c = -M_PI * M_PI / (8.0 * lambda * lambda);
    double s = 0.0;
    for (int k = 1; k <= 20; ++k) {
      const double t = std::exp(c * (2.0 * k - 1) * (2.0 * k - 1));
      s += t;
      if (t < 1e-17 * s) break;
    }
    return std::clamp(1.0 - std::sqrt(2.0 * M_PI) / lambda * s, 0.0, 1.0);
  }
  double q = 0.0;
  for (int k = 1; k <= 100; ++k) {
    const double t = std::exp(-2.0 * k * k * lambda * lambda);
    q += (k % 2 ? 2.0 : -2.0) * t;
    if (t < 1e-17) break;
  }
  return std::clamp(q, 0.0, 1.0);
}

double ks_p_value(double d, int64_t m) {
  if (m <= 0) return 1.0;
  const double sq = std::sqrt(static_cast<double>(m));
  return kolmogorov_q((sq + 0.12 + 0.11 / sq) * d);
}

// ---- bit packing ---------------------------------------------------------

namespace {

// count <= kMaxProfileValues and bits <= 8 (checked by every caller), so
// count * bits cannot overflow.
size_t PackedBytes(int64_t count, int bits) {
  KVQ_ASSERT(count >= 0 && count <= kMaxProfileValues && bits >= 1 && bits <= 8);
  return static_cast<size_t>((count * bits + 7) / 8);
}

void PackCodes(std::span<const uint8_t> codes, int bits, std::vector<uint8_t>& out) {
  out.assign(PackedBytes(static_cast<int64_t>(codes.size()), bits), 0);
  uint64_t acc = 0;
  int have = 0;
  size_t o = 0;
  for (uint8_t c : codes) {
    acc |= static_cast<uint64_t>(c) << have;
    have += bits;
    while (have >= 8) {
      out[o++] = static_cast<uint8_t>(acc);
      acc >>= 8;
      have -= 8;
    }
  }
  if (have > 0) out[o] = static_cast<uint8_t>(acc);
}

// Decodes `count` codes through the level table into out.
void UnpackLevels(std::span<const uint8_t> packed, int bits, std::span<const float> levels,
                  std::span<float> out) {
  const uint32_t mask = (1u << bits) - 1u;
  if (bits == 8) {
    for (size_t j = 0; j < out.size(); ++j) out[j] = levels[packed[j]];
    return;
  }
  if (bits == 4) {
    size_t j = 0;
    for (; j + 2 <= out.size(); j += 2) {
      const uint8_t b = packed[j / 2];
      out[j] = levels[b & 0xF];
      out[j + 1] = levels[b >> 4];
    }
    if (j < out.size()) out[j] = levels[packed[j / 2] & 0xF];
    return;
  }
  uint64_t acc = 0;
  int have = 0;
  size_t in = 0;
  for (size_t j = 0; j < out.size(); ++j) {
    if (have < bits) {
      acc |= static_cast<uint64_t>(packed[in++]) << have;
      have += 8;
    }
    out[j] = levels[acc & mask];
    acc >>= bits;
    have -= bits;
  }
}

void ValidateOptions(const SortedProfileOptions& o) {
  KVQ_CHECK_ARG(o.top_k >= 0, "top_k: expected >= 0, got ", o.top_k);
  KVQ_CHECK_ARG(o.bits >= 1 && o.bits <= 8, "bits: expected 1..8, got ", o.bits);
  KVQ_CHECK_ARG(o.codebook == Codebook::LloydMax || o.codebook == Codebook::Quantile,
                "codebook: expected LloydMax or Quantile, got ", static_cast<int>(o.codebook));
  KVQ_CHECK_ARG(o.ks_max >= 0.0 && o.ks_max <= 1.0, "ks_max: expected a value in [0, 1], got ",
                o.ks_max);
}

// Flat indices of the k largest |x|, ties to the lower index; ascending.
// O(n): nth_element finds the k-th largest magnitude, then one scan takes
// everything above it and the lowest-index values equal to it.
std::vector<int64_t> SelectHead(std::span<const float> v, int64_t k) {
  std::vector<float> mag(v.size());
  for (size_t i = 0; i < v.size(); ++i) mag[i] = std::fabs(v[i]);
  std::nth_element(mag.begin(), mag.begin() + (k - 1), mag.end(), std::greater<float>());
  const float kth = mag[static_cast<size_t>(k - 1)];
  int64_t above = 0;
  for (float m : mag) above += m > kth;
  int64_t equal_quota = k - above;
  std::vector<int64_t> idx;
  idx.reserve(static_cast<size_t>(k));
  for (size_t i = 0; i < v.size(); ++i) {
    const float m = std::fabs(v[i]);
    if (m > kth || (m == kth && equal_quota-- > 0)) idx.push_back(static_cast<int64_t>(i));
  }
  return idx;
}

// Code of x under ascending thresholds padded with +inf to 2^bits entries:
// the number of thresholds below x, by a branchless binary search.
inline uint8_t BinOf(const double* thr, int bits, double x) {
  size_t idx = 0;
  for (size_t step = size_t{1} << (bits - 1); step > 0; step >>= 1) {
    idx += (x > thr[idx + step - 1]) ? step : 0;
  }
  return static_cast<uint8_t>(idx);
}

}  // namespace

// ---- fit / decode --------------------------------------------------------

constexpr NamedValue<TailPath> kTailPaths[] = {
    {TailPath::Empty, "empty"}, {TailPath::Constant, "constant"}, {TailPath::Parametric, "parametric"},
    {TailPath::Dense, "dense"}};
const char* tail_path_name(TailPath p) { return name_of(kTailPaths, p, "?"); }

std::string SortedProfileEncoding::why() const {
  switch (path) {
    case TailPath::Empty: return "no tail: every value is in the exact head";
    case TailPath::Constant: return "constant tail: every tail value equals loc";
    case TailPath::Parametric:
      return detail::Concat("ks gate passed: D=", ks_statistic, " <= ks_max=", ks_max);
    case TailPath::Dense:
      if (reason == FallbackReason::DegenerateFit) {
        return detail::Concat("dense fallback: the ", family, " fit is degenerate (scale ",
                              params.scale, ")");
      }
      return detail::Concat("dense fallback: ks gate failed: D=", ks_statistic, " > ks_max=", ks_max);
  }
  return "?";
}

SortedProfileEncoding fit_sorted_profile(std::span<const float> values, const Estimator& family,
                                         const SortedProfileOptions& opts) {
  ValidateOptions(opts);
  KVQ_CHECK_ARG(static_cast<int64_t>(values.size()) <= kMaxProfileValues, "values: expected at most ",
                kMaxProfileValues, " values (kMaxProfileValues), got ", values.size());
  if (const int64_t bad = first_non_finite(values); bad >= 0) {
    Fail("values: expected finite values, found ", values[static_cast<size_t>(bad)],
         " at flat index ", bad);
  }
  SortedProfileEncoding enc;
  enc.family = family.name();
  enc.n = static_cast<int64_t>(values.size());
  enc.bits = opts.bits;
  enc.codebook = opts.codebook;
  enc.ks_max = opts.ks_max;

  const int64_t k = std::min<int64_t>(opts.top_k, enc.n);
  if (k > 0) {
    enc.head_indices = SelectHead(values, k);
    enc.head_values.reserve(static_cast<size_t>(k));
    for (int64_t i : enc.head_indices) enc.head_values.push_back(values[static_cast<size_t>(i)]);
  }
  std::vector<float> tail;
  tail.reserve(static_cast<size_t>(enc.n - k));
  for (size_t i = 0, h = 0; i < values.size(); ++i) {
    if (h < enc.head_indices.size() && enc.head_indices[h] == static_cast<int64_t>(i)) {
      ++h;
    } else {
      tail.push_back(values[i]);
    }
  }
  const int64_t m = static_cast<int64_t>(tail.size());
  if (m == 0) {
    enc.path = TailPath::Empty;
    return enc;
  }

  std::vector<float> sorted(tail);
  hwy::Sorter()(sorted.data(), sorted.size(), hwy::SortAscending());  // Highway vqsort
  if (sorted.front() == sorted.back()) {
    enc.path = TailPath::Constant;
    enc.params = {sorted.front(), 0.0};
    return enc;
  }
  enc.params = family.fit(tail);
  const bool fit_ok = std::isfinite(enc.params.loc) && std::isfinite(enc.params.scale) &&
                      enc.params.scale > 0.0;
  if (fit_ok) {
    enc.ks_statistic = ks_statistic_sorted(sorted, family, enc.params);
    enc.p_value = ks_p_value(enc.ks_statistic, m);
  } else {
    enc.ks_statistic = 1.0;
    enc.p_value = 0.0;
  }

  if (fit_ok && enc.ks_statistic <= opts.ks_max) {
    enc.path = TailPath::Parametric;
    const StdCodebook& cb = standard_codebook(family, opts.codebook, opts.bits);
    enc.levels.resize(cb.levels.size());
    for (size_t i = 0; i < cb.levels.size(); ++i) {
      enc.levels[i] = static_cast<float>(enc.params.loc + enc.params.scale * cb.levels[i]);
    }
    std::vector<double> thr(cb.levels.size(), kInf);
    for (size_t i = 0; i < cb.thresholds.size(); ++i) {
      thr[i] = enc.params.loc + enc.params.scale * cb.thresholds[i];
    }
    std::vector<uint8_t> codes(tail.size());
    for (size_t j = 0; j < tail.size(); ++j) codes[j] = BinOf(thr.data(), opts.bits, tail[j]);
    PackCodes(codes, opts.bits, enc.codes);
  } else {
    enc.path = TailPath::Dense;
    enc.reason = fit_ok ? FallbackReason::KsGate : FallbackReason::DegenerateFit;
    enc.dense = quantize_kv_cache(TensorView(tail.data(), {m}, DType::F32), QuantMode::Int8);
  }
  return enc;
}

SortedProfileEncoding fit_sorted_profile(const TensorView& values, const Estimator& family,
                                         const SortedProfileOptions& opts) {
  KVQ_CHECK_ARG(values.rank() >= 1, "values: expected a tensor of rank >= 1, got rank 0");
  KVQ_CHECK_ARG(values.dtype() == DType::F32 || values.dtype() == DType::F16 ||
                    values.dtype() == DType::BF16,
                "values: expected dtype F32, F16 or BF16, got ", dtype_name(values.dtype()));
  if (values.dtype() == DType::F32) {
    return fit_sorted_profile(
        std::span<const float>(values.data_as<float>(), static_cast<size_t>(values.numel())),
        family, opts);
  }
  const Tensor f = to_f32(values);
  return fit_sorted_profile(
      std::span<const float>(f.data_as<float>(), static_cast<size_t>(f.numel())), family, opts);
}

void decode_into(const SortedProfileEncoding& enc, std::span<float> out) {
  KVQ_CHECK_ARG(static_cast<int64_t>(out.size()) == enc.n, "out: expected ", enc.n,
                " elements, got ", out.size());
  KVQ_CHECK_ARG(enc.head_indices.size() == enc.head_values.size(),
                "enc: head_indices and head_values differ in length");
  KVQ_CHECK_ARG(enc.n >= 0 && enc.n <= kMaxProfileValues, "enc.n: expected 0..", kMaxProfileValues,
                " (kMaxProfileValues), got ", enc.n);
  const int64_t m = enc.tail_count();
  KVQ_CHECK_ARG(m >= 0, "enc: more head values than n");
  // Decode the tail (original order) into the front of `out`, then spread it
  // out to its positions from the back so the head slots open up in place.
  const std::span<float> tail = out.first(static_cast<size_t>(m));
  switch (enc.path) {
    case TailPath::Empty:
      KVQ_CHECK_ARG(m == 0, "enc: path 'empty' with ", m, " tail values");
      break;
    case TailPath::Constant:
      std::fill(tail.begin(), tail.end(), static_cast<float>(enc.params.loc));
      break;
    case TailPath::Parametric:
      KVQ_CHECK_ARG(enc.bits >= 1 && enc.bits <= 8 && enc.levels.size() == (size_t{1} << enc.bits),
                    "enc: expected 2^bits levels");
      KVQ_CHECK_ARG(enc.codes.size() == PackedBytes(m, enc.bits), "enc: expected ",
                    PackedBytes(m, enc.bits), " code bytes, got ", enc.codes.size());
      UnpackLevels(enc.codes, enc.bits, enc.levels, tail);
      break;
    case TailPath::Dense:
      KVQ_CHECK_ARG(enc.dense.codes.dtype() == DType::I8 && enc.dense.codes.numel() == m,
                    "enc: expected ", m, " int8 dense codes");
      dequantize_int8(std::span<const int8_t>(enc.dense.codes.data_as<int8_t>(), static_cast<size_t>(m)),
                      enc.dense.scale, tail);
      break;
  }
  // Spread, from the back: the tail segment after head h moves right by
  // h + 1 slots, then head h takes its exact value.
  const auto& hi = enc.head_indices;
  int64_t end = enc.n;  // one past the segment being placed
  for (size_t h = hi.size(); h-- > 0;) {
    const int64_t at = hi[h];
    KVQ_CHECK_ARG(at >= 0 && at < end && at >= static_cast<int64_t>(h),
                  "enc: head indices are not ascending, unique and < n");
    const int64_t len = end - at - 1;  // tail values between head h and the next head
    std::memmove(out.data() + at + 1, out.data() + at - static_cast<int64_t>(h),
                 static_cast<size_t>(len) * sizeof(float));
    out[static_cast<size_t>(at)] = enc.head_values[h];
    end = at;
  }
}

std::vector<float> decode(const SortedProfileEncoding& enc) {
  KVQ_CHECK_ARG(enc.n >= 0 && enc.n <= kMaxProfileValues, "enc.n: expected 0..", kMaxProfileValues,
                " (kMaxProfileValues), got ", enc.n);
  std::vector<float> out(static_cast<size_t>(enc.n));
  decode_into(enc, out);
  return out;
}

// ---- persistence ---------------------------------------------------------

namespace {

constexpr char kMagic[4] = {'K', 'V', 'Q', 'P'};
constexpr uint16_t kVersion = 1;
constexpr const char* kWhat = "sorted-profile encoding";

}  // namespace

size_t SortedProfileEncoding::size_bytes() const {
  size_t s = detail::kContainerHeaderBytes;
  s += 4;                  // path, reason, codebook, bits
  s += 2 + family.size();  // name
  s += 8 + 5 * 8;          // n; loc, scale, ks_max, D, p
  s += 8 + head_indices.size() * (8 + 4);
  if (path == TailPath::Parametric) s += levels.size() * 4 + 8 + codes.size();
  if (path == TailPath::Dense) s += 4 + static_cast<size_t>(dense.codes.numel());
  return s;
}

std::vector<uint8_t> serialize(const SortedProfileEncoding& e) {
  KVQ_CHECK_ARG(e.family.size() <= 255, "enc.family: name longer than 255 bytes");
  KVQ_CHECK_ARG(e.head_indices.size() == e.head_values.size(),
                "enc: head_indices and head_values differ in length");
  detail::ByteWriter w;
  w.put<uint8_t>(static_cast<uint8_t>(e.path));
  w.put<uint8_t>(static_cast<uint8_t>(e.reason));
  w.put<uint8_t>(static_cast<uint8_t>(e.codebook));
  w.put<uint8_t>(static_cast<uint8_t>(e.bits));
  w.put<uint16_t>(static_cast<uint16_t>(e.family.size()));
  w.put_array(std::span<const char>(e.family.data(), e.family.size()));
  w.put<int64_t>(e.n);
  for (double d : {e.params.loc, e.params.scale, e.ks_max, e.ks_statistic, e.p_value}) w.put<double>(d);
  w.put<uint64_t>(e.head_indices.size());
  w.put_array(std::span<const int64_t>(e.head_indices));
  w.put_array(std::span<const float>(e.head_values));
  if (e.path == TailPath::Parametric) {
    w.put_array(std::span<const float>(e.levels));
    w.put<uint64_t>(e.codes.size());
    w.put_array(std::span<const uint8_t>(e.codes));
  } else if (e.path == TailPath::Dense) {
    w.put<float>(e.dense.scale);
    w.put_array(std::span<const int8_t>(e.dense.codes.data_as<int8_t>(),
                                        static_cast<size_t>(e.dense.codes.numel())));
  }
  return detail::WrapContainer(kMagic, kVersion, w.bytes());
}

SortedProfileEncoding deserialize_sorted_profile(std::span<const uint8_t> bytes) {
  detail::ByteReader r(detail::OpenContainer(bytes, kMagic, kVersion, kWhat), kWhat);
  SortedProfileEncoding e;
  const uint8_t path = r.get<uint8_t>(), reason = r.get<uint8_t>();
  const uint8_t codebook = r.get<uint8_t>(), bits = r.get<uint8_t>();
  if (path > 3) r.corrupt(detail::Concat("tail path ", int{path}));
  if (reason > 2) r.corrupt(detail::Concat("fallback reason ", int{reason}));
  if (codebook > 1) r.corrupt(detail::Concat("codebook ", int{codebook}));
  if (bits < 1 || bits > 8) r.corrupt(detail::Concat("bits ", int{bits}));
  e.path = static_cast<TailPath>(path);
  e.reason = static_cast<FallbackReason>(reason);
  e.codebook = static_cast<Codebook>(codebook);
  e.bits = bits;
  const auto name = r.get_array<char>(r.get<uint16_t>());
  e.family.assign(name.begin(), name.end());
  e.n = r.get<int64_t>();
  e.params.loc = r.get<double>();
  e.params.scale = r.get<double>();
  e.ks_max = r.get<double>();
  e.ks_statistic = r.get<double>();
  e.p_value = r.get<double>();
  const uint64_t heads = r.get<uint64_t>();
  if (e.n < 0 || e.n > kMaxProfileValues) {
    r.corrupt(detail::Concat("n ", e.n, " outside 0..", kMaxProfileValues, " (kMaxProfileValues)"));
  }
  if (heads > static_cast<uint64_t>(e.n)) r.corrupt(detail::Concat("n ", e.n, " with ", heads, " head values"));
  e.head_indices = r.get_array<int64_t>(heads);
  e.head_values = r.get_array<float>(heads);
  if (first_non_finite(e.head_values) >= 0) r.corrupt("non-finite head value");
  for (size_t i = 0; i < e.head_indices.size(); ++i) {
    if (e.head_indices[i] < 0 || e.head_indices[i] >= e.n ||
        (i > 0 && e.head_indices[i] <= e.head_indices[i - 1])) {
      r.corrupt("head indices are not ascending, unique and < n");
    }
  }
  const int64_t m = e.tail_count();
  if ((e.path == TailPath::Empty) != (m == 0)) r.corrupt("tail path does not match the tail size");
  if ((e.path == TailPath::Dense) != (e.reason != FallbackReason::None)) {
    r.corrupt("fallback reason does not match the tail path");
  }
  if (e.path == TailPath::Constant && !std::isfinite(static_cast<float>(e.params.loc))) {
    r.corrupt("non-finite constant");
  }
  if (e.path == TailPath::Parametric) {
    e.levels = r.get_array<float>(uint64_t{1} << bits);
    const uint64_t ncodes = r.get<uint64_t>();
    if (ncodes != PackedBytes(m, bits)) {
      r.corrupt(detail::Concat(ncodes, " code bytes for ", m, " codes of ", int{bits}, " bits"));
    }
    e.codes = r.get_array<uint8_t>(ncodes);
    if (first_non_finite(e.levels) >= 0) r.corrupt("non-finite level");
  } else if (e.path == TailPath::Dense) {
    e.dense.scale = r.get<float>();
    if (!std::isfinite(e.dense.scale) || e.dense.scale < 0) r.corrupt("dense scale");
    const auto codes = r.get_array<int8_t>(static_cast<uint64_t>(m));
    if (std::find(codes.begin(), codes.end(), int8_t{-128}) != codes.end()) {
      r.corrupt("int8 code -128");
    }
    e.dense.codes = Tensor::Uninitialized({m}, DType::I8);
    std::copy(codes.begin(), codes.end(), e.dense.codes.data_as<int8_t>());
    e.dense.mode = QuantMode::Int8;
  }
  r.expect_end();
  return e;
}

}  // namespace kvq
