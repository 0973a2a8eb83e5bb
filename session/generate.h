// A generation session (above model/ and store/): the library half of `kvq
// generate`, so that the CLI only parses flags and Python calls the same
// code (kvq.generate). A session loads the model and tokenizer, builds the
// cache (a scheme, calibrated ranges when it needs them) or restores one (a
// saved KVQS file checked against the model's fingerprint and the prompt's
// token digest; the longest stored run of the prompt's chunks from a prefix
// store), runs the prompt's remaining tokens through the batched pass (in
// passes of `batch` tokens that end where a save or a store is due), saves
// or stores what is due, then samples token by token.
//
// Errors are kvq::Error and name the `kvq generate` option of the field
// (--steps, --save-cache, ...). Nothing is written before every input is
// checked; --save-cache never overwrites an input.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace kvq::session {

struct GenerateOptions {
  std::string model;      // llama2.c checkpoint or GGUF
  std::string tokenizer;  // llama2.c tokenizer.bin; empty with a GGUF (its own)
  std::string prompt;     // text; empty: start from BOS
  // The prompt as token ids instead of text (any tokenizer's; BOS only if
  // given): with a model whose tokenizer kvq does not read, the output is
  // token ids too (GenerateReport::ids).
  std::vector<int> tokens;
  std::string kv;         // scheme or preset; empty: fp32, or the loaded cache's scheme
  std::string save_cache, load_cache;
  // A prefix store (a directory, redis://... or memory:); unset: none.
  std::optional<std::string> prompt_cache;
  int prompt_cache_chunk = 256;
  double prompt_cache_max_mb = 0;  // directory store: size cap (0: none)
  int prompt_cache_ttl = 0;        // Redis store: seconds (0: forever)
  std::string prompt_cache_secret; // the store's HMAC secret (empty: none)
  double temperature = 0.0;        // 0: greedy
  uint64_t seed = 0;               // 0: a fixed default
  int steps = 256;                 // forward steps, prompt included (<= the model's seq_len)
  int threads = 0;                 // OpenMP and BLAS threads for the session (0: as the process has them)
  int batch = 512;                 // prompt tokens per batched pass (sgemm + KvCache::prefill)
  bool calib_batched = false;      // calibrated schemes: the sequences side by side (model/calibrate.h)
  std::string weight_dot = "int8";  // quantized weights: int8 (llama.cpp's arithmetic) or exact (model/transformer.h)
};

struct GenerateReport {
  std::string text;          // the prompt's text and the sampled tokens' (what on_text was given)
  std::vector<int> ids;      // the prompt's token ids, then the sampled ones
  bool has_text = true;      // false: the model's tokenizer is not one kvq reads (ids only)
  int prefilled = 0;         // prompt tokens run through the batched pass
  double prefill_seconds = 0;
  int tokens = 0;            // positions run or restored
  int restored = 0;          // prompt tokens restored (a saved cache or the prefix store)
  int evaluated = 0;         // forward passes run
  double seconds = 0;        // of those passes (stores included)
  std::string kv;            // "label" or "preset = scheme"
  std::string weight_dot;    // how quantized weights were multiplied ("int8", "exact")
  double bits = 0;           // bits per element the cache holds at its length
  uint64_t bytes = 0;        // bytes it holds
  int64_t cache_tokens = 0;  // its length
  int stored_chunks = 0;     // prefix-store chunks written
  uint64_t stored_bytes = 0;
};

// Runs a session. on_text gets each token's text as it is known (the
// prompt's, then the sampled ones; lone unprintable bytes skipped, as
// llama2.c does); on_status one line per event (restored, saved, the prompt
// cache's reuse), each without its newline. Either may be empty.
GenerateReport generate(const GenerateOptions& o, const std::function<void(const std::string&)>& on_text = {},
                        const std::function<void(const std::string&)>& on_status = {});

}  // namespace kvq::session
