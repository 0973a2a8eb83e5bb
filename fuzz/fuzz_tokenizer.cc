// llama2.c tokenizer.bin: bytes 0-1 give the vocabulary size (any value;
// the loader must refuse what it cannot serve), bytes 2.. are the file.
// What loads encodes text (the input's own bytes, a fixed sentence, every
// byte value) and decodes every token it produced.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_util.h"
#include "kvq/error.h"
#include "model/checkpoint.h"
#include "model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const int vocab = data[0] | (data[1] << 8);
  const kvq::fuzz::MemFile f(data + 2, size - 2);
  try {
    const kvq::model::Tokenizer tok(f.path(), vocab);
    std::string all_bytes;
    for (int b = 1; b < 256; ++b) all_bytes.push_back(static_cast<char>(b));
    const std::string tail(reinterpret_cast<const char*>(data), std::min<size_t>(size, 512));
    for (const std::string& text : {std::string("Once upon a time, a cat."), all_bytes, tail}) {
      for (bool bos : {true, false}) {
        const std::vector<int> ids = tok.encode(text, bos);
        if (text.size() < 64 && ids != tok.encode_reference(text, bos)) __builtin_trap();
        int prev = kvq::model::Tokenizer::kBos;
        for (int id : ids) {
          (void)tok.decode(prev, id);
          prev = id;
        }
      }
    }
  } catch (const kvq::Error&) {
  }
  return 0;
}
