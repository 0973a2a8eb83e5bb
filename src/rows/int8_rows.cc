// Row schemes int8 (the seed rule on the whole row: one f32 scale) and
// int8-head (one f32 scale per KV head). Codes in K and V tiles: kInt8.
#include <span>

#include "kvq/affine.h"
#include "src/rows/row_scheme.h"
#include "src/rows/scale_io.h"

namespace kvq::schemes {
namespace {
size_t Int8Bytes(size_t n, size_t) { return 4 + n; }
size_t Int8Header(size_t, size_t) { return 4; }
size_t HeadBytes(size_t n, size_t hd) { return 4 * (n / hd) + n; }
size_t HeadHeader(size_t n, size_t hd) { return 4 * (n / hd); }

void EncodeInt8(const float* row, size_t n, size_t, uint8_t* dst) {
  const std::span<const float> x(row, n);
  const float s = int8_scale(max_abs(x));
  PutF32(dst, s);
  quantize_int8(x, s, {reinterpret_cast<int8_t*>(dst + 4), n});
}
void DecodeInt8(const uint8_t* src, size_t n, size_t, float* out) {
  dequantize_int8({reinterpret_cast<const int8_t*>(src + 4), n}, GetF32(src), {out, n});
}
void EncodeHead(const float* row, size_t n, size_t hd, uint8_t* dst) {
  const size_t heads = n / hd;
  int8_t* codes = reinterpret_cast<int8_t*>(dst + 4 * heads);
  for (size_t h = 0; h < heads; ++h) {
    const std::span<const float> xh(row + h * hd, hd);
    const float s = int8_scale(max_abs(xh));
    PutF32(dst + 4 * h, s);
    quantize_int8(xh, s, {codes + h * hd, hd});
  }
}
void DecodeHead(const uint8_t* src, size_t n, size_t hd, float* out) {
  const size_t heads = n / hd;
  const int8_t* codes = reinterpret_cast<const int8_t*>(src + 4 * heads);
  for (size_t h = 0; h < heads; ++h) dequantize_int8({codes + h * hd, hd}, GetF32(src + 4 * h), {out + h * hd, hd});
}
}  // namespace

const RowSchemeDef kInt8Rows = {KvScheme::Int8, "int8", TileCodes::kInt8, Int8Bytes, Int8Header, EncodeInt8, DecodeInt8};
const RowSchemeDef kInt8HeadRows = {KvScheme::Int8Head, "int8-head", TileCodes::kInt8, HeadBytes, HeadHeader,
                                    EncodeHead, DecodeHead};

}  // namespace kvq::schemes
