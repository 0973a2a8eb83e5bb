// Internal: the row kernel's call (src/rows/attention.cc): work items of
// (KV head, token segment) with their running softmax state, and the
// validated view they read. attention_api.cc validates, builds the items
// and merges them; the SIMD kernel fills them on the dispatched target.
#pragma once

#include <cstddef>
#include <cstdint>

#include <span>

#include "kvq/attention.h"
#include "kvq/kv_scheme.h"

namespace kvq::attn {

// One work item: a KV head and a token segment, with the running softmax
// state of the item's query heads (m: running max, l: running sum, acc:
// unnormalised output, head-major).
struct Item {
  const float* q;  // G * hd pre-scaled query values
  const float* qscale;   // G: the scale of each query head's integer planes
  const int8_t* qi;      // G * planes * hd: the query's integer planes (int8 codes or digits), else null
  const int32_t* qstart;  // G * planes * nb32: the plane accumulators' start values (StartValues)
  const float* qfsum;    // G * nb32: sums of q per 32-element block
  float* m;        // G
  float* l;        // G
  float* acc;      // G * hd
  int g;           // KV head
  int G;           // query heads in the group
  int64_t t0, t1;  // token range [t0, t1)
};

struct Call {
  KvScheme scheme;
  int n_kv, hd;
  const uint8_t* k;  // KvRowsView's payload pointers and geometry
  const uint8_t* v;
  size_t slice_bytes, slice_stride;
  int heads_per_slice;
  const uint8_t* k_header;
  const uint8_t* v_header;
  size_t header_bytes;
  int k_tile;      // 0: K rows; kKTile: K tiles (kv_scheme.h)
  int v_tile;      // 0: V rows; kKTile: V tiles
  int tile_first;  // tiles: lane of token 0
  const Item* items;
  int64_t n_items;
  int threads;
  // K tiles: integer query planes the items carry (qscale / qi / qstart):
  // 0 none, 1 the int8 query (int8_query), 3 the exact query's digits.
  int query_planes;
};

// decode_attention and decode_attention_part over a view the row store
// made: the view's fields are valid by construction and not checked again
// (no codec built per call); q, out and opts are (attention_api.cc).
void StoreAttention(std::span<const float> q, int n_heads, const KvRowsView& kv, std::span<float> out,
                    const DecodeAttentionOptions& opts);
AttentionPart StoreAttentionPart(std::span<const float> q, int n_heads, const KvRowsView& kv,
                                 const DecodeAttentionOptions& opts);

// Runs the kernel on the best target this CPU and KVQ_TARGETS allow.
void RunDecodeAttentionKernel(const Call& c);

}  // namespace kvq::attn
