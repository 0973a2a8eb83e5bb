// Row schemes fp8-e4m3 (the seed's cast, scale 1, saturating), fp8-e5m2
// (saturating) and fp8-e4m3-scaled (one f32 scale amax / 448 per row).
#include <algorithm>

#include "kvq/affine.h"
#include "kvq/fp8.h"
#include "src/rows/row_scheme.h"
#include "src/rows/scale_io.h"

namespace kvq::schemes {
namespace {
size_t NoHeader(size_t, size_t) { return 0; }
size_t Bytes1(size_t n, size_t) { return n; }
size_t ScaledBytes(size_t n, size_t) { return 4 + n; }
size_t ScaledHeader(size_t, size_t) { return 4; }

void EncodeE4M3(const float* x, size_t n, size_t, uint8_t* dst) { fp8::encode_e4m3({x, n}, {dst, n}); }
void DecodeE4M3(const uint8_t* src, size_t n, size_t, float* y) { fp8::decode_e4m3({src, n}, {y, n}); }
void EncodeE5M2(const float* x, size_t n, size_t, uint8_t* dst) { fp8::encode_e5m2({x, n}, {dst, n}); }
void DecodeE5M2(const uint8_t* src, size_t n, size_t, float* y) { fp8::decode_e5m2({src, n}, {y, n}); }
void EncodeScaled(const float* x, size_t n, size_t, uint8_t* dst) {
  const float s = max_abs({x, n}) / fp8::kE4M3Max;
  PutF32(dst, s);
  float tmp[512];
  for (size_t i0 = 0; i0 < n; i0 += 512) {
    const size_t m = std::min<size_t>(512, n - i0);
    for (size_t i = 0; i < m; ++i) tmp[i] = s != 0.0f ? x[i0 + i] / s : 0.0f;
    fp8::encode_e4m3({tmp, m}, {dst + 4 + i0, m});
  }
}
void DecodeScaled(const uint8_t* src, size_t n, size_t, float* y) {
  const float s = GetF32(src);
  fp8::decode_e4m3({src + 4, n}, {y, n});
  for (size_t i = 0; i < n; ++i) y[i] *= s;
}
}  // namespace

const RowSchemeDef kFp8E4M3Rows = {KvScheme::Fp8E4M3, "fp8-e4m3", TileCodes::kNone, Bytes1, NoHeader, EncodeE4M3,
                                   DecodeE4M3};
const RowSchemeDef kFp8E4M3ScaledRows = {KvScheme::Fp8E4M3Scaled, "fp8-e4m3-scaled", TileCodes::kNone, ScaledBytes,
                                         ScaledHeader, EncodeScaled, DecodeScaled};
const RowSchemeDef kFp8E5M2Rows = {KvScheme::Fp8E5M2, "fp8-e5m2", TileCodes::kNone, Bytes1, NoHeader, EncodeE5M2,
                                   DecodeE5M2};

}  // namespace kvq::schemes
