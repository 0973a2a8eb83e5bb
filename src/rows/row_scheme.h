// Internal: the row schemes' registry (kv_scheme.h). A row scheme is defined
// in its family's file, src/schemes/<family>_rows.cc (its codec: bytes per
// row, header, encode, decode, and the tile code format it shares), with
// its attention kernel traits beside it in <family>_rows-inl.h (how the
// fused kernel loads its values and row scales), and registered once: in
// kRowSchemes (registry.cc) and in the kernel list (kernels-inl.h).
// kv_scheme.cc and attention.cc hold no per-scheme branch: they read these
// definitions, and branch only on the tile code format, which is a layout
// (kv_scheme.h: K and V tiles), not a scheme.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvq/kv_scheme.h"

namespace kvq::schemes {

// How a scheme's codes sit in K and V tiles (kv_scheme.h), when it has them.
enum class TileCodes : uint8_t {
  kNone = 0,  // rows only
  kInt8 = 1,  // int8 codes, f32 row scales in the header (int8, int8-head)
  kQ8 = 2,    // ggml q8_0 blocks: fp16 block scales, int8 codes
  kQ4 = 3,    // ggml q4_0 blocks: fp16 block scales, nibbles (code - 8)
};

// True when payloads are ggml blocks of 32 values (a block may straddle heads).
constexpr bool IsBlockTile(TileCodes t) { return t == TileCodes::kQ8 || t == TileCodes::kQ4; }

struct RowSchemeDef {
  KvScheme id;
  const char* name;
  TileCodes tile;
  // n values per row (a multiple of hd, and of 32 for block schemes), hd per head.
  size_t (*row_bytes)(size_t n, size_t hd);
  size_t (*header_bytes)(size_t n, size_t hd);  // f32 scales in front of the payload
  void (*encode)(const float* row, size_t n, size_t hd, uint8_t* dst);
  void (*decode)(const uint8_t* src, size_t n, size_t hd, float* out);
};

// Every row scheme, in KvScheme order (the registry, registry.cc).
std::span<const RowSchemeDef* const> row_schemes();
// The scheme's definition; nullptr for a value that names none.
const RowSchemeDef* find_row_scheme(KvScheme s);

// One head slice's payload in codec order <-> lane `lane` of its K (which
// 0) or V (1) tile (layouts in kv_scheme.h; kv_scheme.cc): what the row
// store writes and KvRowsView::gather_row reads back.
void SliceToTile(int which, TileCodes t, size_t hd, const uint8_t* src, uint8_t* tile, int lane);
void TileToSlice(int which, TileCodes t, size_t hd, const uint8_t* tile, int lane, uint8_t* dst);

// The families' definitions (each in its own file).
extern const RowSchemeDef kFp32Rows, kFp16Rows, kBf16Rows;                  // float_rows.cc
extern const RowSchemeDef kInt8Rows, kInt8HeadRows;                         // int8_rows.cc
extern const RowSchemeDef kFp8E4M3Rows, kFp8E4M3ScaledRows, kFp8E5M2Rows;   // fp8_rows.cc
extern const RowSchemeDef kQ8_0Rows, kQ4_0Rows;                             // ggml_rows.cc

}  // namespace kvq::schemes
