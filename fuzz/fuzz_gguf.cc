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
#include "model/checkpoint.h"
#include "model/tokenizer.h"
#include "model/tokens.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const kvq::fuzz::MemFile f(data, size);
  try {
    const kvq::model::Checkpoint c(f.path());
    kvq::fuzz::ReadWeightEnds(c);
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
