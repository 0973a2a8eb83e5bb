// GGUF models (model/gguf.h, gguf_model.cc) and token-id files
// (model/tokens.h): the loader either rejects the bytes with kvq::Error or
// every weight it hands out is readable (each table's ends are read, each
// quantized matrix's first and last rows go through the fused kernel) and
// its tokenizer encodes; the same bytes as a .npy / raw uint32 token file
// either parse to in-vocabulary ids or are refused; and the same bytes as
// blocks of every ggml weight type (kvq/ggml_weights.h: any bit pattern,
// NaN/Inf/subnormal scales) decode, and the fused dequantise-and-dot and the
// integer path (one row and two at once) give their scalar references' bits.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include <cstring>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "kvq/error.h"
#include "kvq/ggml_weights.h"
#include "model/checkpoint.h"
#include "model/tokenizer.h"
#include "model/tokens.h"

namespace {

// The input as rows of blocks of every block type.
void Blocks(const uint8_t* data, size_t size) {
  for (uint32_t type = 0; type < 40; ++type) {
    if (!kvq::ggml::fused_type(type)) continue;
    const size_t block = static_cast<size_t>(kvq::ggml::weight_block(type)),
                 bytes = static_cast<size_t>(kvq::ggml::weight_block_bytes(type));
    // Up to 12 rows: past 8, the batched kernels that take 8 weight rows at a time.
    const size_t per_row = block == 32 ? 8 : 1, rows = std::min<size_t>(12, size / (per_row * bytes));
    if (rows == 0) continue;
    kvq::ggml::WeightMatrix w;
    w.type = type;
    w.data = data;
    w.rows = rows, w.cols = per_row * block, w.row_bytes = per_row * bytes;
    std::vector<float> x(w.cols), deq(rows * w.cols), out(rows);
    for (size_t j = 0; j < w.cols; ++j) x[j] = static_cast<float>(j % 7) - 3.0f;
    kvq::ggml::dequantize_rows(w, 0, rows, deq.data());
    kvq::ggml::matvec_fused(w, x.data(), 0, rows, out.data());
    for (size_t i = 0; i < rows; ++i) {
      const float ref = kvq::ggml::dot_row_fused_ref(w, i, x.data());
      uint32_t a, b;
      std::memcpy(&a, &out[i], 4), std::memcpy(&b, &ref, 4);
      if (a != b && !(out[i] != out[i] && ref != ref)) __builtin_trap();  // equal bits, or both NaN
    }
    // The integer path: matvec_int and matmul_int give the reference's bits
    // (three activation rows: a batched pass's kernels, 8 weight rows at a
    // time for Q4_0 and Q8_0 on x86, where there are 8; one and two: the
    // decode kernels, on the activation's repacked codes for Q4_0 and Q4_K).
    const size_t ab = kvq::ggml::activation_bytes(type, w.cols);
    std::vector<uint8_t> xq(3 * ab);
    kvq::ggml::quantize_activation(type, x.data(), w.cols, xq.data());
    kvq::ggml::quantize_activation(type, deq.data(), w.cols, xq.data() + ab);  // any values, NaN included
    kvq::ggml::quantize_activation(type, deq.data() + (rows - 1) * w.cols, w.cols, xq.data() + 2 * ab);
    std::vector<float> three(3 * rows), two(2 * rows);
    kvq::ggml::matmul_int(w, xq.data(), 3, 0, rows, three.data(), rows);
    kvq::ggml::matmul_int(w, xq.data() + ab, 2, 0, rows, two.data(), rows);
    for (size_t t = 0; t < 3; ++t) {
      kvq::ggml::matvec_int(w, xq.data() + t * ab, 0, rows, out.data());
      for (size_t i = 0; i < rows; ++i) {
        const float ref = kvq::ggml::dot_row_int_ref(w, i, xq.data() + t * ab);
        for (const float got : {out[i], three[t * rows + i], t > 0 ? two[(t - 1) * rows + i] : out[i]}) {
          uint32_t a, b;
          std::memcpy(&a, &got, 4), std::memcpy(&b, &ref, 4);
          if (a != b && !(got != got && ref != ref)) __builtin_trap();
        }
      }
    }
  }
}

// A loaded model's quantized matrices: first and last rows through the kernels.
void Matrices(const kvq::model::Weights& w) {
  auto rows = [](const kvq::ggml::WeightMatrix& m) {
    std::vector<float> x(m.cols, 0.5f), out(1), deq(m.cols);
    std::vector<uint8_t> xq(kvq::ggml::activation_bytes(m.type, m.cols));
    if (kvq::ggml::fused_type(m.type)) kvq::ggml::quantize_activation(m.type, x.data(), m.cols, xq.data());
    for (size_t i : {size_t{0}, m.rows - 1}) {
      kvq::ggml::dequantize_rows(m, i, i + 1, deq.data());
      if (kvq::ggml::fused_type(m.type)) {
        kvq::ggml::matvec_fused(m, x.data(), i, i + 1, out.data());
        kvq::ggml::matvec_int(m, xq.data(), i, i + 1, out.data());
      }
    }
  };
  rows(w.token_embedding), rows(w.wcls);
  for (const auto* kind : {&w.wq, &w.wk, &w.wv, &w.wo, &w.w1, &w.w2, &w.w3}) {
    for (const kvq::ggml::WeightMatrix& m : *kind) rows(m);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Blocks(data, size);
  const kvq::fuzz::MemFile f(data, size);
  try {
    const kvq::model::Checkpoint c(f.path());
    kvq::fuzz::ReadWeightEnds(c);
    Matrices(c.weights());
    if (const kvq::model::Tokenizer* t = c.tokenizer()) {
      for (int id : t->encode("Once upon a time \xE2\x96\x81 <0x0A> \xF0\x9F\x98\x80", true)) {
        if (id < 0 || id >= t->vocab_size()) __builtin_trap();
      }
      // the input's own bytes as text (byte-level BPE: any bytes, invalid UTF-8 included)
      for (int id : t->encode(std::string(reinterpret_cast<const char*>(data), std::min<size_t>(size, 2048)), false)) {
        if (id < 0 || id >= t->vocab_size()) __builtin_trap();
        (void)t->decode(-1, id);
      }
    }
  } catch (const kvq::Error&) {
  }
  for (bool npy : {true, false}) {
    try {
      for (int id : kvq::model::parse_token_ids({data, size}, npy, 1000, "fuzz")) {
        if (id < 0 || id >= 1000) __builtin_trap();
      }
    } catch (const kvq::Error&) {
    }
  }
  return 0;
}
