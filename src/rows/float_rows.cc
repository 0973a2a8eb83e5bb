// Row schemes fp32, fp16, bf16: the values themselves (fp16 / bf16 rounded
// to nearest even). No header, no tiles.
#include <cstring>

#include "kvq/half.h"
#include "src/rows/row_scheme.h"

namespace kvq::schemes {
namespace {
size_t NoHeader(size_t, size_t) { return 0; }
size_t Bytes4(size_t n, size_t) { return 4 * n; }
size_t Bytes2(size_t n, size_t) { return 2 * n; }

void EncodeFp32(const float* x, size_t n, size_t, uint8_t* dst) { std::memcpy(dst, x, 4 * n); }
void DecodeFp32(const uint8_t* src, size_t n, size_t, float* y) { std::memcpy(y, src, 4 * n); }
void EncodeFp16(const float* x, size_t n, size_t, uint8_t* dst) {
  f32_to_f16({x, n}, {reinterpret_cast<uint16_t*>(dst), n});
}
void DecodeFp16(const uint8_t* src, size_t n, size_t, float* y) {
  f16_to_f32({reinterpret_cast<const uint16_t*>(src), n}, {y, n});
}
void EncodeBf16(const float* x, size_t n, size_t, uint8_t* dst) {
  f32_to_bf16({x, n}, {reinterpret_cast<uint16_t*>(dst), n});
}
void DecodeBf16(const uint8_t* src, size_t n, size_t, float* y) {
  bf16_to_f32({reinterpret_cast<const uint16_t*>(src), n}, {y, n});
}
}  // namespace

const RowSchemeDef kFp32Rows = {KvScheme::Fp32, "fp32", TileCodes::kNone, Bytes4, NoHeader, EncodeFp32, DecodeFp32};
const RowSchemeDef kFp16Rows = {KvScheme::Fp16, "fp16", TileCodes::kNone, Bytes2, NoHeader, EncodeFp16, DecodeFp16};
const RowSchemeDef kBf16Rows = {KvScheme::Bf16, "bf16", TileCodes::kNone, Bytes2, NoHeader, EncodeBf16, DecodeBf16};

}  // namespace kvq::schemes
