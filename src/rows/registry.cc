// The one table of row schemes (row_scheme.h). A new row scheme: its
// definition in a family file, one line here, one in kernels-inl.h.
#include "src/rows/row_scheme.h"

#include <iterator>

namespace kvq::schemes {

namespace {
constexpr const RowSchemeDef* kRowSchemes[] = {
    &kFp32Rows,    &kFp16Rows,          &kBf16Rows,    &kInt8Rows, &kInt8HeadRows,
    &kFp8E4M3Rows, &kFp8E4M3ScaledRows, &kFp8E5M2Rows, &kQ8_0Rows, &kQ4_0Rows,
};
}  // namespace

std::span<const RowSchemeDef* const> row_schemes() { return kRowSchemes; }

// The table is in format order (KvScheme.RegistryHoldsEverySchemeOnceInFormatOrder).
const RowSchemeDef* find_row_scheme(KvScheme s) {
  const size_t i = static_cast<size_t>(s);
  return i < std::size(kRowSchemes) && kRowSchemes[i]->id == s ? kRowSchemes[i] : nullptr;
}

}  // namespace kvq::schemes
