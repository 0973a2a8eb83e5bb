// llama2.c checkpoint: the loader either rejects the file or every weight
// pointer it hands out lies inside the file (read each table's ends).
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_util.h"
#include "kvq/error.h"
#include "model/llama2.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const kvq::fuzz::MemFile f(data, size);
  try {
    const kvq::model::Checkpoint c(f.path());
    const kvq::model::Config& cfg = c.config();
    const kvq::model::Weights& w = c.weights();
    volatile float sink = 0;
    const size_t d = static_cast<size_t>(cfg.dim), v = static_cast<size_t>(cfg.vocab_size);
    sink = sink + w.token_embedding[0] + w.token_embedding[v * d - 1];
    sink = sink + w.rms_final[0] + w.rms_final[d - 1];
    sink = sink + w.wcls[0] + w.wcls[v * d - 1];
    (void)sink;
  } catch (const kvq::Error&) {
  }
  return 0;
}
