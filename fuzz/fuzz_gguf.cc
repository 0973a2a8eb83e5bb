// GGUF models (model/gguf.h, gguf_model.cc) and token-id files
// (model/tokens.h): the loader either rejects the bytes with kvq::Error or
// every weight it hands out is readable (each table's ends are read) and
// its tokenizer encodes; the same bytes as a .npy / raw uint32 token file
// either parse to in-vocabulary ids or are refused.
#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz/fuzz_util.h"
#include "kvq/error.h"
#include "model/llama2.h"
#include "model/tokens.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const kvq::fuzz::MemFile f(data, size);
  try {
    const kvq::model::Checkpoint c(f.path());
    const kvq::model::Config& cfg = c.config();
    const kvq::model::Weights& w = c.weights();
    volatile float sink = 0;
    const size_t d = static_cast<size_t>(cfg.dim), v = static_cast<size_t>(cfg.vocab_size),
                 L = static_cast<size_t>(cfg.n_layers), h = static_cast<size_t>(cfg.hidden_dim),
                 kv = static_cast<size_t>(cfg.kv_dim());
    sink = sink + w.token_embedding[0] + w.token_embedding[v * d - 1];
    sink = sink + w.wcls[0] + w.wcls[v * d - 1] + w.rms_final[d - 1];
    sink = sink + w.wq[L * d * d - 1] + w.wk[L * kv * d - 1] + w.wv[L * kv * d - 1] + w.wo[L * d * d - 1];
    sink = sink + w.w1[L * h * d - 1] + w.w2[L * d * h - 1] + w.w3[L * h * d - 1];
    sink = sink + w.rms_att[L * d - 1] + w.rms_ffn[L * d - 1];
    if (w.bq != nullptr) sink = sink + w.bq[L * d - 1] + w.bk[L * kv - 1] + w.bv[L * kv - 1];
    (void)sink;
    if (const kvq::model::Tokenizer* t = c.tokenizer()) {
      for (int id : t->encode("Once upon a time \xE2\x96\x81 <0x0A> \xF0\x9F\x98\x80", true)) {
        if (id < 0 || id >= t->vocab_size()) __builtin_trap();
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
