// Internal: the grouped streaming store behind kvq::KvCache's grouped
// family (src/cache/group_family.cc): the schemes of kvq/grouped_kv.h, their
// records, open tokens, kernel calls and saved state. Its Impl is
// src/groups/store.h; its code store.cc (build, write), read.cc (read,
// attend, bytes) and state_io.cc (state and ranges as bytes).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvq/attention.h"
#include "kvq/grouped_kv.h"
#include "kvq/rope.h"

namespace kvq {

class GroupedKvCache {
 public:
  // Throws kvq::Error on a bad scheme, RoPE or geometry (head_dim a multiple
  // of 8 up to 512, max_seq >= 1, n_layers, n_kv_heads >= 1, within the
  // size limits), or when a scheme that needs calibrated ranges comes
  // without ranges of this geometry (ranges are copied; a dynamic scheme
  // ignores them).
  GroupedKvCache(const GroupedKvScheme& scheme, int n_layers, int max_seq, int n_kv_heads, int head_dim,
                 const StaticRanges* ranges = nullptr, const RopeConfig& rope = {});
  // From the tables another cache of this scheme and geometry saved
  // (save_tables): throws kvq::Error on a wrong size or any value the
  // scheme cannot have made (non-finite or negative steps, widths outside
  // 2..8 or not summing to k_bits per head).
  GroupedKvCache(const GroupedKvScheme& scheme, int n_layers, int max_seq, int n_kv_heads, int head_dim,
                 std::span<const uint8_t> tables, const RopeConfig& rope = {});
  ~GroupedKvCache();
  GroupedKvCache(GroupedKvCache&&) noexcept;
  GroupedKvCache& operator=(GroupedKvCache&&) noexcept;
  // An explicit deep copy (tests; a cache is large).
  GroupedKvCache Copy() const;

  const GroupedKvScheme& scheme() const { return scheme_; }
  int n_layers() const { return n_layers_; }
  int max_seq() const { return max_seq_; }
  int n_kv_heads() const { return n_kv_heads_; }
  int head_dim() const { return head_dim_; }
  const RopeConfig& rope() const { return rope_; }
  // The calibrated ranges it was built with (null for a dynamic scheme).
  const StaticRanges* ranges() const { return ranges_.get(); }

  // Stores token `pos` of `layer`: k after RoPE at pos, v. Positions of a
  // layer are written in order (pos = tokens written so far), or pos = 0,
  // which starts a new sequence. Throws kvq::Error on a bad layer, an
  // out-of-order pos, a wrong length, a non-finite value or |value| > 65504
  // (the fp16 range of the open tokens and parameters).
  void write(int layer, int pos, std::span<const float> k, std::span<const float> v);
  // Tokens written to `layer` in the current sequence.
  int64_t written(int layer) const;

  // Attention of a query at position T - 1 over the T = written(layer)
  // tokens of `layer`. q: n_heads * head_dim floats (after RoPE at T - 1).
  // threads: 0 = OpenMP default, 1 = the caller's only. Throws kvq::Error
  // on a bad argument (nothing written, geometry, non-finite q).
  void attend(int layer, std::span<const float> q, int n_heads, std::span<float> out, int threads = 1,
              float scale = 0.0f) const;
  // The coded groups alone (log-mass -inf when none).
  AttentionPart coded_part(int layer, std::span<const float> q, int n_heads, int threads = 1,
                           float scale = 0.0f) const;
  // Reference: every token decoded as attention reads it, scores and
  // softmax in double.
  void attend_ref(int layer, std::span<const float> q, int n_heads, std::span<float> out, float scale = 0.0f) const;

  // Token pos of `layer` as attention reads it now: K after RoPE, V.
  // Throws unless 0 <= pos < written(layer).
  void read(int layer, int64_t pos, std::span<float> k, std::span<float> v) const;

  // Bytes the cache holds, one layer at its length / all layers.
  uint64_t layer_bytes(int layer) const;
  uint64_t bytes() const;
  // 8 bytes() / (2 E sum_l written(l)); 0 when empty.
  double bits() const;
  // Bytes of the object's K/V allocations (records, open rings and pool,
  // tables): bytes() plus a bounded constant (see above).
  uint64_t allocated_bytes() const;
  // K bits of channel quad k (channels 4k..4k+3) of KV head h in `layer`.
  int k_quad_bits(int layer, int head, int quad) const;
  // Inspection (tests): complete groups of `layer`, groups read from codes,
  // and the decoded lo / step (head_dim each) of K (which = 0, in the tile
  // frame) or V (1) of KV head `head` in group g < complete_groups.
  int64_t complete_groups(int layer) const;
  int64_t coded_groups(int layer) const;
  void group_params(int layer, int64_t g, int which, int head, std::span<float> lo, std::span<float> step) const;
  // The fixed-point digits the fused kernel uses for K and V (1 or 2).
  int k_digits() const;
  int v_digits() const;

  // The calibrated tables as held (per layer: p8's grid or the static ranges
  // as fp16 pairs per K / V channel, then the allocated K widths, a byte per
  // quad), and their bytes per layer (counted in layer_bytes).
  void save_tables(std::vector<uint8_t>& out) const;
  uint64_t layer_table_bytes() const;

  // Serialisation of the held state (kv_cache.h's container): every layer's
  // held bytes in a fixed order; load_state reads exactly that back into a
  // fresh cache of the same scheme, geometry and tables. load_state throws
  // kvq::Error on any inconsistency and leaves the cache empty.
  void save_state(std::vector<uint8_t>& out) const;
  void load_state(std::span<const uint8_t> in, std::span<const int64_t> lengths);
  // A token range [from, T) at the current length T (the prefix store's
  // chunks): per layer the sinks and final records (coded groups, full
  // calibrated tiles) made since a cache of `from` tokens, then a u64 size
  // and what a cache of T tokens holds besides (the records still changing,
  // the open tokens). load_range_states rebuilds a cache of ends.back()
  // tokens from the ranges [0, ends[0]), [ends[0], ends[1]), ... saved by
  // caches of the same scheme, tables and token prefix: the sinks and final
  // records of every range and the rest from the last one, exactly the state
  // save_state gives at that length (then load_state's checks). Every layer
  // must hold T tokens, from in 0..T-1.
  void save_range_state(int64_t from, std::vector<uint8_t>& out) const;
  void load_range_states(std::span<const std::span<const uint8_t>> parts, std::span<const int64_t> ends);
  // Records that never change once a layer holds T tokens.
  int64_t final_records(int64_t T) const;

  struct Impl;  // src/grouped_kv.cc

 private:
  // Validates the geometry and builds from ranges or saved tables (one of them).
  GroupedKvCache(const GroupedKvScheme& scheme, int n_layers, int max_seq, int n_kv_heads, int head_dim,
                 const StaticRanges* ranges, const std::span<const uint8_t>* tables, const RopeConfig& rope);
  void Build(const StaticRanges* ranges, const std::span<const uint8_t>* tables);
  void SaveLayer(int l, int64_t from, bool range, std::vector<uint8_t>& out) const;
  // load_state over the state's bytes in consecutive pieces (read in place).
  void LoadPieces(std::span<const std::span<const uint8_t>> pieces, std::span<const int64_t> lengths);
  GroupedKvScheme scheme_;
  int n_layers_, max_seq_, n_kv_heads_, head_dim_;
  RopeConfig rope_;
  std::shared_ptr<const StaticRanges> ranges_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvq
