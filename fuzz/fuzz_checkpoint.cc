// llama2.c checkpoint: the loader either rejects the file or every weight
// pointer it hands out lies inside the file (read each table's ends).
#include <cstddef>
#include <cstdint>

#include "fuzz/fuzz_util.h"
#include "kvq/error.h"
#include "model/checkpoint.h"
#include "model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const kvq::fuzz::MemFile f(data, size);
  try {
    kvq::fuzz::ReadWeightEnds(kvq::model::Checkpoint(f.path()));
  } catch (const kvq::Error&) {
  }
  return 0;
}
