// Row schemes q8_0 and q4_0: ggml's blocks of 32 values (ggml_quants.h),
// in K and V tiles when heads are block-aligned (kQ8, kQ4).
#include "kvq/ggml_quants.h"
#include "src/rows/row_scheme.h"

namespace kvq::schemes {
namespace {
size_t NoHeader(size_t, size_t) { return 0; }
size_t Q8Bytes(size_t n, size_t) { return n / ggml::kBlock * sizeof(ggml::BlockQ8_0); }
size_t Q4Bytes(size_t n, size_t) { return n / ggml::kBlock * sizeof(ggml::BlockQ4_0); }

void EncodeQ8(const float* x, size_t n, size_t, uint8_t* dst) {
  ggml::quantize_row_q8_0({x, n}, {reinterpret_cast<ggml::BlockQ8_0*>(dst), n / ggml::kBlock});
}
void DecodeQ8(const uint8_t* src, size_t n, size_t, float* y) {
  ggml::dequantize_row_q8_0({reinterpret_cast<const ggml::BlockQ8_0*>(src), n / ggml::kBlock}, {y, n});
}
void EncodeQ4(const float* x, size_t n, size_t, uint8_t* dst) {
  ggml::quantize_row_q4_0({x, n}, {reinterpret_cast<ggml::BlockQ4_0*>(dst), n / ggml::kBlock});
}
void DecodeQ4(const uint8_t* src, size_t n, size_t, float* y) {
  ggml::dequantize_row_q4_0({reinterpret_cast<const ggml::BlockQ4_0*>(src), n / ggml::kBlock}, {y, n});
}
}  // namespace

const RowSchemeDef kQ8_0Rows = {KvScheme::Q8_0, "q8_0", TileCodes::kQ8, Q8Bytes, NoHeader, EncodeQ8, DecodeQ8};
const RowSchemeDef kQ4_0Rows = {KvScheme::Q4_0, "q4_0", TileCodes::kQ4, Q4Bytes, NoHeader, EncodeQ4, DecodeQ4};

}  // namespace kvq::schemes
