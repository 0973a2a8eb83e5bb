// The weight types of a GGUF file as kvq reads them: each tensor stays in
// its ggml type, rows are dequantised where they are used (model/ggml_weights.cc).
//
// Types (ggml's ids; block = elements, bytes per block):
//   F32 (0; 1, 4)  F16 (1; 1, 2)  BF16 (30; 1, 2)
//   Q4_0 (2; 32, 18)  Q4_1 (3; 32, 20)  Q5_0 (6; 32, 22)  Q5_1 (7; 32, 24)  Q8_0 (8; 32, 34)
//   Q2_K (10; 256, 84)  Q3_K (11; 256, 110)  Q4_K (12; 256, 144)  Q5_K (13; 256, 176)  Q6_K (14; 256, 210)
//   IQ4_NL (20; 32, 18)  IQ4_XS (23; 256, 136)
// Each value is computed as ggml's reference dequantisation (ggml-quants.c's
// dequantize_row_*) computes it, operation for operation in float32 (no
// contraction: the build sets -ffp-contract=off), so kvq's weights equal
// llama.cpp's own F32 copy of a file bit for bit (python/tests/test_ggml_weights.py
// checks every type against libggml). Not read: Q8_1 and Q8_K (ggml's
// activation formats, never stored in model files), the IQ1/IQ2/IQ3
// grid types and TQ1_0/TQ2_0 (lattice codebooks of 256-2048 entries;
// requantize such a file to one of the types above).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace kvq::ggml {

enum class WeightType : uint32_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23, kBF16 = 30,
};

// Whether kvq reads weights of this ggml type id.
bool weight_type_read(uint32_t type);
// Elements per block of a type kvq reads (1, 32 or 256).
int weight_block(uint32_t type);
// Bytes of one block.
int weight_block_bytes(uint32_t type);

// A block type's fp16 scale fields (byte offsets within a block; none for
// F32 / F16 / BF16). Every value of a block is finite exactly when they are
// (a non-finite scale times any code, zero included, is non-finite).
std::span<const uint8_t> scale_fields(uint32_t type);
// The first of `blocks` blocks (elements for F32 / F16 / BF16) at data that
// holds a non-finite value, or -1: the scale fields are read, not the codes.
int64_t first_non_finite_block(uint32_t type, const uint8_t* data, size_t blocks);

// Dequantises n elements (a multiple of the block) of a type kvq reads from
// `in` (any alignment) into out. Non-finite values (from a non-finite fp16
// scale) are kept. Never throws.
void dequantize(uint32_t type, const uint8_t* in, size_t n, float* out);

// A weight matrix: `rows` rows of `cols` values in a ggml type, row i at
// data + i * row_bytes.
struct WeightMatrix {
  uint32_t type = 0;
  const uint8_t* data = nullptr;
  size_t rows = 0, cols = 0, row_bytes = 0;
  const uint8_t* row(size_t i) const { return data + i * row_bytes; }
  // The values when the matrix is F32 (and float-aligned), else null.
  const float* f32() const;
};

// sum_j w[i, j] * x[j] for one row, summed in order j = 0 .. cols - 1 over
// the row's dequantised values: the same bits as the sequential sum over
// an F32 copy of the matrix.
float dot_row(const WeightMatrix& w, size_t i, const float* x);
// Rows [r0, r1) dequantised into out ((r1 - r0) x cols floats).
void dequantize_rows(const WeightMatrix& w, size_t r0, size_t r1, float* out);

// The block types (every type above but F32, F16 and BF16), which the token
// pass reads through the fused kernel below.
bool fused_type(uint32_t type);
// The token pass's fused dequantise-and-dot (src/base/ggml_dot.cc, Highway):
// out[i - r0] = sum_j w[i, j] x[j] for rows [r0, r1) of a block type, each
// element's value ggml's, element j added into partial sum j mod 16 in
// order of j, the 16 sums added in a fixed tree; products and sums rounded
// separately. The same bits on every SIMD target as dot_row_fused_ref.
// Against the sequential sum of dot_row: both are within gamma_n sum_j
// |w_ij x_j| of the exact sum (gamma_n = n u / (1 - n u), u = 2^-24).
void matvec_fused(const WeightMatrix& w, const float* x, size_t r0, size_t r1, float* out);
float dot_row_fused_ref(const WeightMatrix& w, size_t i, const float* x);

// ---- The integer path (llama.cpp's quantized dot products) ----------------
// src/base/ggml_int_dot.cc. The activation row is rounded once to the 8-bit
// block format ggml pairs with the weight type (its vec_dot_type) and each
// block's products are summed in integers; float enters only at the block
// scales. Not the exact path's numbers: the activation carries ggml's 8-bit
// rounding, as llama.cpp's own matmuls do.
//
// The format: 8 (Q8_0: fp16 d | 32 int8) for Q4_0, Q5_0, Q8_0, IQ4_NL;
// 9 (Q8_1: fp16 d | fp16 d sum(q) | 32 int8) for Q4_1, Q5_1; 15 (Q8_K:
// float32 d | 256 int8 | 16 int16 sums of 16) for Q2_K..Q6_K and IQ4_XS;
// 0 for a type without an integer path (F32, F16, BF16).
uint32_t activation_type(uint32_t weight_type);
// Bytes of n activations in that format (n a multiple of the weight's block).
size_t activation_bytes(uint32_t weight_type, size_t n);
// x[0, n) rounded as ggml's quantize_row_q8_0_ref / q8_1_ref / q8_K_ref
// round it, byte for byte (for finite x; a Q8_K block of zeros also has
// zero sums, which ggml leaves unwritten; non-finite values give zero or
// clamped codes, never a trap). Never throws.
void quantize_activation(uint32_t weight_type, const float* x, size_t n, uint8_t* out);
// quantize_activation's scalar reference (Q8_0 / Q8_1 are vectorised there;
// the same bytes on every target).
void quantize_activation_ref(uint32_t weight_type, const float* x, size_t n, uint8_t* out);
// out[i - r0] = row i . xq for rows [r0, r1): each block's integer dot
// product exactly, then float only at the block scales. Q4_0, Q4_K,
// Q5_K and Q6_K sum in 8 lanes (lane k: values 4k..4k+3 of every 32, as the
// kernels' int32 lanes hold them), each block adding its scaled lane totals
// into float lanes added in a fixed tree at the row's end; Q3_K scales each
// block's total once (ggml's generic code keeps 8 float lanes of its own);
// the other types (Q8_0 included) scale each block's total as ggml's generic
// ggml_vec_dot_<type>_q8_<fmt> does (its bits). The same bits on every SIMD
// target as dot_row_int_ref.
// Against ggml's own vec_dot on the same activation bytes (its generic C or
// any SIMD variant): both are sums of the same exact per-block integers times
// the same float scales in another order, so they differ by at most
// 2 gamma_(16 nb + 8) B, B a bound on every float term's magnitude
// (python/tests/test_ggml_int_dot.py states and checks it; nb = blocks a row).
void matvec_int(const WeightMatrix& w, const uint8_t* xq, size_t r0, size_t r1, float* out);
// T activation rows at once (row t at xq + t * activation_bytes(type, cols)):
// out[t * ldo + i - r0] = row i . activation t, the same bits as matvec_int
// of each row alone; each weight row is decoded once for up to 4 activation
// rows (a batched pass, a prompt's prefill).
void matmul_int(const WeightMatrix& w, const uint8_t* xq, size_t T, size_t r0, size_t r1, float* out, size_t ldo);
float dot_row_int_ref(const WeightMatrix& w, size_t i, const uint8_t* xq);

}  // namespace kvq::ggml
