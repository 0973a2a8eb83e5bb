// Rotary position embedding (see kvq/rope.h).
#include "kvq/rope.h"

#include <cmath>
#include <mutex>
#include <sstream>

#include "kvq/error.h"

namespace kvq {

void RopeConfig::validate(const char* arg) const {
  KVQ_CHECK_ARG(std::isfinite(theta) && theta > 1.0f && theta <= 1e9f, arg, ": RoPE theta must be in (1, 1e9], got ",
                theta);
  KVQ_CHECK_ARG(scaling == Scaling::kNone || scaling == Scaling::kLinear || scaling == Scaling::kLlama3, arg,
                ": unknown RoPE scaling ", static_cast<int>(scaling));
  if (scaling == Scaling::kNone) return;
  KVQ_CHECK_ARG(std::isfinite(factor) && factor >= 1.0f && factor <= 1024.0f, arg,
                ": RoPE scaling factor must be in [1, 1024], got ", factor);
  if (scaling != Scaling::kLlama3) return;
  KVQ_CHECK_ARG(std::isfinite(low_freq_factor) && std::isfinite(high_freq_factor) && low_freq_factor > 0.0f &&
                    high_freq_factor > low_freq_factor && high_freq_factor <= 1024.0f,
                arg, ": Llama 3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor <= 1024, got ",
                low_freq_factor, " and ", high_freq_factor);
  KVQ_CHECK_ARG(original_context >= 1 && original_context <= (1 << 24), arg,
                ": Llama 3 RoPE scaling needs an original context of 1..2^24, got ", original_context);
}

RopeConfig RopeConfig::canonical() const {
  const RopeConfig d;
  RopeConfig c = *this;
  if (scaling != Scaling::kLlama3) {
    c.low_freq_factor = d.low_freq_factor, c.high_freq_factor = d.high_freq_factor;
    c.original_context = d.original_context;
  }
  if (scaling == Scaling::kNone) c.factor = d.factor;
  return c;
}

std::string RopeConfig::describe() const {
  std::ostringstream os;
  os << "theta " << theta;
  if (scaling == Scaling::kLinear) os << ", linear scaling x" << factor;
  if (scaling == Scaling::kLlama3) {
    os << ", llama3 scaling x" << factor << " (low " << low_freq_factor << ", high " << high_freq_factor
       << ", original context " << original_context << ")";
  }
  return os.str();
}

std::vector<float> rope_frequencies(int head_dim, const RopeConfig& rope) {
  std::vector<float> f(static_cast<size_t>(head_dim / 2));
  for (int i = 0; i < head_dim; i += 2) {
    // llama2.c: 1 / theta^(i / head_dim) in float.
    float freq = 1.0f / std::pow(rope.theta, static_cast<float>(i) / static_cast<float>(head_dim));
    if (rope.scaling == RopeConfig::Scaling::kLinear) {
      freq /= rope.factor;
    } else if (rope.scaling == RopeConfig::Scaling::kLlama3) {
      // Llama 3.1's rule (Meta's reference apply_scaling): wavelengths
      // above original / low_freq_factor are divided by the factor, below
      // original / high_freq_factor kept, in between interpolated.
      const double wavelen = 2.0 * M_PI / freq;
      const double low_wavelen = rope.original_context / static_cast<double>(rope.low_freq_factor);
      const double high_wavelen = rope.original_context / static_cast<double>(rope.high_freq_factor);
      if (wavelen > low_wavelen) {
        freq = static_cast<float>(freq / rope.factor);
      } else if (wavelen >= high_wavelen) {
        const double smooth = (rope.original_context / wavelen - rope.low_freq_factor) /
                              (static_cast<double>(rope.high_freq_factor) - rope.low_freq_factor);
        freq = static_cast<float>((1.0 - smooth) * freq / rope.factor + smooth * freq);
      }
    }
    f[static_cast<size_t>(i / 2)] = freq;
  }
  return f;
}

RopeTable::RopeTable(int max_seq, int head_dim, const RopeConfig& rope)
    : max_seq_(max_seq), head_dim_(head_dim), config_(rope) {
  KVQ_CHECK_ARG(max_seq >= 1, "rope: max_seq must be >= 1, got ", max_seq);
  KVQ_CHECK_ARG(head_dim >= 2 && head_dim % 2 == 0, "rope: head_dim must be even (RoPE rotates pairs), got ",
                head_dim);
  rope.validate("rope");
  const std::vector<float> freq = rope_frequencies(head_dim, rope);
  const size_t P = static_cast<size_t>(head_dim / 2);
  cos_.resize(static_cast<size_t>(max_seq) * P);
  sin_.resize(cos_.size());
  for (int pos = 0; pos < max_seq; ++pos) {
    for (size_t p = 0; p < P; ++p) {
      const float val = static_cast<float>(pos) * freq[p];
      cos_[static_cast<size_t>(pos) * P + p] = std::cos(val);
      sin_[static_cast<size_t>(pos) * P + p] = std::sin(val);
    }
  }
}

std::shared_ptr<const RopeTable> shared_rope_table(int max_seq, int head_dim, const RopeConfig& rope) {
  static std::mutex mu;
  static std::vector<std::weak_ptr<const RopeTable>> held;  // one per rotation alive, the longest
  std::lock_guard<std::mutex> lock(mu);
  const RopeConfig want = rope.canonical();
  for (std::weak_ptr<const RopeTable>& w : held) {
    std::shared_ptr<const RopeTable> t = w.lock();
    if (!t || t->head_dim() != head_dim || !(t->config().canonical() == want)) continue;
    if (t->max_seq() >= max_seq) return t;
    auto longer = std::make_shared<const RopeTable>(max_seq, head_dim, want);
    w = longer;  // the shorter one lives on with its holders
    return longer;
  }
  std::erase_if(held, [](const std::weak_ptr<const RopeTable>& w) { return w.expired(); });
  auto t = std::make_shared<const RopeTable>(max_seq, head_dim, want);
  held.push_back(t);
  return t;
}

void rope_rotate(float* x, int n_heads, int head_dim, const float* c, const float* s, bool transpose) {
  const float sg = transpose ? -1.0f : 1.0f;
  for (int h = 0; h < n_heads; ++h) {
    float* xh = x + static_cast<size_t>(h) * static_cast<size_t>(head_dim);
    for (int p = 0; p < head_dim / 2; ++p) {
      const float x0 = xh[2 * p], x1 = xh[2 * p + 1], sn = sg * s[p];
      xh[2 * p] = x0 * c[p] - x1 * sn;
      xh[2 * p + 1] = x0 * sn + x1 * c[p];
    }
  }
}

void RopeTable::apply(float* x, int n_heads, int pos) const {
  rope_rotate(x, n_heads, head_dim_, cos(pos), sin(pos), false);
}

}  // namespace kvq
