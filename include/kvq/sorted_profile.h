// G4 — the sorted-profile (parametric tail) quantizer, SPEC §3.
//
// fit_sorted_profile(values, family, {top_k, bits, codebook, ks_max}):
//  1. Head: the top_k values of largest |x| (ties: lower flat index first)
//     are kept exactly, as float32, with their flat indices.
//  2. Tail: the remaining values are fitted by the family's estimator.
//  3. KS receipt: D = sup |F_emp - F_fit| over the tail, computed exactly
//     from the sorted profile (both one-sided gaps at every order
//     statistic), with the asymptotic Kolmogorov p-value.
//  4. Gate: if D <= ks_max the tail is stored as `bits`-bit codes against a
//     codebook of the fitted family (Lloyd–Max or equal-probability
//     quantile bins, both decoded to bin centroids); otherwise the same tail
//     values go dense through quantize_kv_cache int8. The encoding records
//     which path it took and why.
//
// Families are location–scale: a codebook is derived once per (family,
// width) for the standardised family and then scaled by the fitted
// parameters. Adding a family = subclassing Estimator; the quantizer does
// not change.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvq/affine.h"
#include "kvq/tensor.h"

namespace kvq {

// A fitted location–scale family, x = loc + scale * z.
struct LocScale {
  double loc = 0.0;
  double scale = 0.0;
};

// Interface of a parametric family. Implementations describe the standard
// member (loc 0, scale 1) and how to estimate (loc, scale) from data.
class Estimator {
 public:
  virtual ~Estimator() = default;
  virtual std::string name() const = 0;
  // Parameters the fit estimates (2 for every location–scale family here).
  virtual int parameter_count() const { return 2; }
  // Estimates the parameters from finite values (any order, n >= 1).
  virtual LocScale fit(std::span<const float> values) const = 0;

  // The standardised family.
  virtual double std_cdf(double z) const = 0;
  // Survival 1 - cdf; override when it can be computed without cancellation.
  virtual double std_sf(double z) const { return 1.0 - std_cdf(z); }
  virtual double std_inv_cdf(double p) const = 0;  // p in (0,1); 0 -> -inf, 1 -> +inf
  // Integral of z * f(z) over [a, b] (a, b may be infinite).
  virtual double std_partial_mean(double a, double b) const = 0;

  // Derived, shared by every family.
  double std_interval_prob(double a, double b) const;        // P(a < Z <= b), stable in tails
  double std_conditional_mean(double a, double b) const;     // E[Z | a < Z <= b]
  double cdf(double x, const LocScale& p) const;             // of the fitted member
  double inv_cdf(double prob, const LocScale& p) const;
  double conditional_mean(double a, double b, const LocScale& p) const;
};

// Gaussian: loc = mean, scale = standard deviation (MLE, divides by n).
class GaussianEstimator final : public Estimator {
 public:
  std::string name() const override { return "gaussian"; }
  LocScale fit(std::span<const float> values) const override;
  double std_cdf(double z) const override;
  double std_sf(double z) const override;
  double std_inv_cdf(double p) const override;
  double std_partial_mean(double a, double b) const override;
};

// Laplace: loc = median, scale = mean absolute deviation from the median
// (the MLE of both).
class LaplaceEstimator final : public Estimator {
 public:
  std::string name() const override { return "laplace"; }
  LocScale fit(std::span<const float> values) const override;
  double std_cdf(double z) const override;
  double std_sf(double z) const override;
  double std_inv_cdf(double p) const override;
  double std_partial_mean(double a, double b) const override;
};

enum class Codebook : uint8_t { LloydMax = 0, Quantile = 1 };
const char* codebook_name(Codebook c);
// "lloyd_max" / "quantile"; throws kvq::Error naming `arg` otherwise.
Codebook parse_codebook(const std::string& s, const char* arg = "codebook");

// The levels (2^bits, ascending) and thresholds (2^bits - 1) of the
// standardised family. Level i codes values in (thresholds[i-1],
// thresholds[i]]. Lloyd–Max: Lloyd iteration on exact integrals until the
// levels move by < 1e-12 (cached per family name and width; thread-safe).
// Quantile: thresholds at inv_cdf(i / 2^bits), levels the bin centroids.
struct StdCodebook {
  std::vector<double> levels;
  std::vector<double> thresholds;
};
const StdCodebook& standard_codebook(const Estimator& family, Codebook kind, int bits);

// Default KS gate. D is an effect size: the largest gap, in probability,
// between the data's CDF and the fitted one. 0.04 rejects the classic
// misfits of a Gaussian fit at any sample size (a uniform has D = 0.057
// against its fitted Gaussian, a Laplace 0.062, a Student-t(2) or a bimodal
// mixture much more), while a correct family passes from a few hundred
// values up (the 5% Lilliefors critical value 0.886 / sqrt(n) drops below
// 0.04 at n ~ 490). Smaller populations usually go dense, which is the safe
// side: int8 never assumes a shape.
inline constexpr double kDefaultKsMax = 0.04;
// The most values one encoding holds (2^28, 1 GiB as float32): fit refuses
// more, a KVQP container claiming more is rejected before anything is
// allocated, and decode never allocates more than n floats. A constant or
// empty tail holds its n values in no bytes, so this limit, not the
// container's size, bounds what decoding one may allocate.
inline constexpr int64_t kMaxProfileValues = int64_t{1} << 28;

struct SortedProfileOptions {
  int top_k = 0;   // >= 0; values kept exact
  int bits = 4;    // 1..8
  Codebook codebook = Codebook::LloydMax;
  double ks_max = kDefaultKsMax;  // in [0, 1]
};

// How the tail was stored.
enum class TailPath : uint8_t {
  Empty = 0,       // no tail: n == 0 or n <= top_k (everything is in the head)
  Constant = 1,    // every tail value equals loc (scale 0): stored exactly by loc
  Parametric = 2,  // bit-packed codes against the fitted family's codebook
  Dense = 3,       // fallback: quantize_kv_cache int8 of the tail values
};
const char* tail_path_name(TailPath p);

enum class FallbackReason : uint8_t {
  None = 0,
  KsGate = 1,         // D > ks_max
  DegenerateFit = 2,  // the estimator returned a zero/non-finite scale for non-constant data
};

struct SortedProfileEncoding {
  std::string family;            // estimator name
  LocScale params;               // fitted tail parameters (zeros when the tail is empty)
  int64_t n = 0;                 // values encoded (head + tail)
  int bits = 4;
  Codebook codebook = Codebook::LloydMax;
  double ks_max = kDefaultKsMax;
  TailPath path = TailPath::Empty;
  FallbackReason reason = FallbackReason::None;
  double ks_statistic = 0.0;     // D (0 when the tail is empty or constant)
  double p_value = 1.0;          // asymptotic Kolmogorov p-value of D at the tail size
  std::vector<int64_t> head_indices;  // ascending flat indices
  std::vector<float> head_values;     // exact, matching head_indices
  std::vector<float> levels;     // 2^bits scaled levels (Parametric only)
  std::vector<uint8_t> codes;    // tail codes, LSB-first bit-packed, original order
  AffineQuantized dense;         // int8 of the tail values (Dense only; 1-D)

  bool fallback() const { return path == TailPath::Dense; }
  int64_t tail_count() const { return n - static_cast<int64_t>(head_indices.size()); }
  // Human-readable account of the path taken, e.g. "ks gate: D=0.0571 > ks_max=0.04".
  std::string why() const;
  // Exact size of serialize(*this) in bytes.
  size_t size_bytes() const;
};

SortedProfileEncoding fit_sorted_profile(std::span<const float> values, const Estimator& family,
                                         const SortedProfileOptions& opts = {});
// Any-rank F32/F16/BF16 tensor, encoded in flat (row-major) order.
SortedProfileEncoding fit_sorted_profile(const TensorView& values, const Estimator& family,
                                         const SortedProfileOptions& opts = {});

// The n values in their original order.
std::vector<float> decode(const SortedProfileEncoding& enc);
void decode_into(const SortedProfileEncoding& enc, std::span<float> out);

// Versioned container (magic "KVQP", CRC32C payload, SPEC §9).
std::vector<uint8_t> serialize(const SortedProfileEncoding& enc);
// Throws kvq::Error on truncated, corrupted, wrong-version or inconsistent input.
SortedProfileEncoding deserialize_sorted_profile(std::span<const uint8_t> bytes);

// ---- pieces, public for tests and reuse ----------------------------------

// D = max_i max(i/m - F(x_(i)), F(x_(i)) - (i-1)/m) over the sorted x.
double ks_statistic_sorted(std::span<const float> sorted, const Estimator& family,
                           const LocScale& p);
// Asymptotic P(D_m >= d) for a fully specified CDF: the Kolmogorov
// distribution at (sqrt(m) + 0.12 + 0.11 / sqrt(m)) * d (Stephens). With
// fitted parameters it is conservative (too large), which is why the gate
// uses D itself.
double ks_p_value(double d, int64_t m);
// Kolmogorov survival Q(lambda) = 2 sum_{k>=1} (-1)^{k-1} exp(-2 k^2 lambda^2).
double kolmogorov_q(double lambda);

}  // namespace kvq
