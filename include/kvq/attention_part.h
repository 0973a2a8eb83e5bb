// What every attention kernel gives back when its tokens are one part of
// the whole: the row kernel (attention.h), the grouped store's coded groups,
// the cluster bank's far field (cluster_bank.h), a cache's token range
// (KvCache::attend_part).
#pragma once

#include <vector>

namespace kvq {

// One part of an attention result: log of the softmax mass it carries,
// log sum_t exp(score_t), and its normalised value, per query head (value:
// n_heads * head_dim, head-major). Parts over disjoint token sets (a sink
// window, a recent window, E2's far field) combine exactly by log-sum-exp.
struct AttentionPart {
  std::vector<double> log_mass;  // -inf for an empty part
  std::vector<float> value;
};
// Throws kvq::Error on no parts or a geometry mismatch.
AttentionPart merge_attention_parts(const std::vector<AttentionPart>& parts);

}  // namespace kvq
