// Fused decode attention over a quantized KV cache (SPEC §8).
//
// One new query position attends over T cached tokens whose K and V rows are
// stored in a KvScheme (kv_scheme.h row layouts), laid out as a KvRowsView
// describes (the row store: head-major payload slices, scales apart, K and V of
// int8 / int8-head / q8_0 / q4_0 in 16-token tiles). The kernel reads the codes
// directly, streaming each KV head's slice: each K/V vector is dequantized in
// registers (per-row and per-head scales are folded into the score and the
// softmax weight, ggml block scales are applied per 32-value block); K tiles
// give 16 scores per vector (lanes = tokens) with no horizontal sums; scores
// go through an online
// softmax in blocks of 128 tokens (no T-sized buffer), and every query head
// of a GQA group is served from the same loaded K/V vector. On AVX-512 VNNI
// CPUs, K-tile scores (head_dim a multiple of 16, up to 512) are integer dot
// products (vpdpbusd) of the codes with the scaled query in 23-bit fixed
// point (Q = rne(q 2^e), |Q| <= 2^22, as three base-256 digits): each sum is
// exact in int32, and a score differs from the float one by at most
// 2^-22 max|q_h| sum_e |k_e| plus float rounding. V tiles on the same CPUs
// are accumulated the same way, 4 tokens per vpdpbusd lane: per softmax
// block (<= 128 tokens), head and scale group (a ggml block of 32 values, or
// a whole int8 head) the weights times their block / row scales,
// x_t = w_t a_t, are written in 23-bit fixed point (each within 2^-21
// max_t |x_t| of its value) as three base-256 digits, and every sum is exact
// in int32 before one conversion to float. Highway SIMD,
// one dispatch per call; OpenMP over (KV head, token segment) work items,
// whose partial softmax states are merged exactly.
//
// decode_attention_ref is the dequantize-then-attend reference: rows decoded
// by KvRowCodec, scores and softmax in double, two passes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvq/attention_part.h"
#include "kvq/kv_scheme.h"
#include "kvq/tensor.h"

namespace kvq {

struct DecodeAttentionOptions {
  int64_t length = -1;  // attend to rows [0, length) (causal length); -1 = all tokens
  float scale = 0.0f;   // score scale; 0 = 1 / sqrt(head_dim)
  int threads = 0;      // OpenMP threads; 0 = omp_get_max_threads(); 1 = the caller's only
  // Opt-in, inexact (what ggml does when K is quantized): for caches with
  // K tiles (int8, int8-head; q8_0, q4_0 with head_dim % 32 == 0) and
  // head_dim a multiple of 16 up to 512, each scaled query head is rounded to int8 (scale
  // max|q_h| / 127) and the K scores become integer dot products (AVX-512
  // VNNI vpdpbusd: 64 multiply-adds per instruction instead of 16; block
  // scales applied per 32-value block). The score error is at most
  // (max|q_h| / 254) * sum_e |k_e| (k the dequantized key) plus float
  // rounding. On CPUs without VNNI, for other schemes and for views with K
  // rows (k_tile = 0), the exact kernel runs.
  bool int8_query = false;
};

// q: n_heads * head_dim floats (head-major); out: the same size. n_heads must
// be a positive multiple of kv.n_kv_heads (query head h reads KV head
// h / (n_heads / n_kv_heads)); head_dim a multiple of 8; at least one token.
// Throws kvq::Error on any invalid argument or non-finite q.
void decode_attention(std::span<const float> q, int n_heads, const KvRowsView& kv,
                      std::span<float> out, const DecodeAttentionOptions& opts = {});
// q: F32 tensor of shape (n_heads, head_dim); returns (n_heads, head_dim).
Tensor decode_attention(const TensorView& q, const KvRowsView& kv,
                        const DecodeAttentionOptions& opts = {});

// decode_attention as an AttentionPart (the log-mass comes from the same
// online-softmax state, scores including the scale).
AttentionPart decode_attention_part(std::span<const float> q, int n_heads, const KvRowsView& kv,
                                    const DecodeAttentionOptions& opts = {});

// Reference (validated like decode_attention; slow, for tests).
void decode_attention_ref(std::span<const float> q, int n_heads, const KvRowsView& kv,
                          std::span<float> out, const DecodeAttentionOptions& opts = {});

}  // namespace kvq
