#include "kvq/ggml_quants.h"

#include <algorithm>
#include <cmath>

#include "kvq/error.h"
#include "kvq/half.h"

namespace kvq::ggml {

void quantize_row_q8_0(std::span<const float> x, std::span<BlockQ8_0> blocks) {
  KVQ_ASSERT(x.size() % kBlock == 0 && blocks.size() == x.size() / kBlock);
  for (size_t b = 0; b < blocks.size(); ++b) {
    const float* v = x.data() + b * kBlock;
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    blocks[b].d = f32_to_f16_ref(d);
    for (int j = 0; j < kBlock; ++j) blocks[b].qs[j] = static_cast<int8_t>(std::roundf(v[j] * id));
  }
}

void dequantize_row_q8_0(std::span<const BlockQ8_0> blocks, std::span<float> x) {
  KVQ_ASSERT(x.size() == blocks.size() * kBlock);
  for (size_t b = 0; b < blocks.size(); ++b) {
    const float d = f16_to_f32_ref(blocks[b].d);
    for (int j = 0; j < kBlock; ++j) x[b * kBlock + j] = static_cast<float>(blocks[b].qs[j]) * d;
  }
}

void quantize_row_q4_0(std::span<const float> x, std::span<BlockQ4_0> blocks) {
  KVQ_ASSERT(x.size() % kBlock == 0 && blocks.size() == x.size() / kBlock);
  for (size_t b = 0; b < blocks.size(); ++b) {
    const float* v = x.data() + b * kBlock;
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kBlock; ++j) {
      if (amax < std::fabs(v[j])) {
        amax = std::fabs(v[j]);
        max = v[j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    blocks[b].d = f32_to_f16_ref(d);
    for (int j = 0; j < kBlock / 2; ++j) {
      const float x0 = v[j] * id;
      const float x1 = v[j + kBlock / 2] * id;
      const uint8_t q0 = static_cast<uint8_t>(std::min<int8_t>(15, static_cast<int8_t>(x0 + 8.5f)));
      const uint8_t q1 = static_cast<uint8_t>(std::min<int8_t>(15, static_cast<int8_t>(x1 + 8.5f)));
      blocks[b].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
  }
}

void dequantize_row_q4_0(std::span<const BlockQ4_0> blocks, std::span<float> x) {
  KVQ_ASSERT(x.size() == blocks.size() * kBlock);
  for (size_t b = 0; b < blocks.size(); ++b) {
    const float d = f16_to_f32_ref(blocks[b].d);
    for (int j = 0; j < kBlock / 2; ++j) {
      x[b * kBlock + j] = static_cast<float>((blocks[b].qs[j] & 0x0F) - 8) * d;
      x[b * kBlock + j + kBlock / 2] = static_cast<float>((blocks[b].qs[j] >> 4) - 8) * d;
    }
  }
}

}  // namespace kvq::ggml
