// The one table of row schemes (row_scheme.h). A new row scheme: its
// definition in a family file, one line here, one in kernels-inl.h.
#include "src/schemes/row_scheme.h"

namespace kvq::schemes {

namespace {
constexpr const RowSchemeDef* kRowSchemes[] = {
    &kFp32Rows,    &kFp16Rows,          &kBf16Rows,    &kInt8Rows, &kInt8HeadRows,
    &kFp8E4M3Rows, &kFp8E4M3ScaledRows, &kFp8E5M2Rows, &kQ8_0Rows, &kQ4_0Rows,
};
}  // namespace

std::span<const RowSchemeDef* const> row_schemes() { return kRowSchemes; }

const RowSchemeDef* find_row_scheme(KvScheme s) {
  for (const RowSchemeDef* d : kRowSchemes) {
    if (d->id == s) return d;
  }
  return nullptr;
}

}  // namespace kvq::schemes
