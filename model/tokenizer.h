// llama2.c's tokenizer (tokenizer.bin, or a GGUF's sentencepiece vocabulary): BPE merges by score,
// byte fallback, decoding with its special pieces (model/tokenizer.cc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvq::model {

class Tokenizer {
 public:
  // Loads a llama2.c tokenizer.bin with `vocab_size` entries. Throws
  // kvq::Error, also when vocab_size < kMinVocab: encode and generate can
  // produce BOS (1), EOS (2) and the byte-fallback ids <0xNN> = NN + 3.
  Tokenizer(const std::string& path, int vocab_size);
  // A sentencepiece vocabulary held elsewhere (a GGUF's): pieces with " "
  // for U+2581, their scores, and whether text may match each piece
  // (control and unknown tokens may not). Needs BOS 1, EOS 2 and the byte
  // pieces <0x00>..<0xFF> at ids 3..258 (the layout above); `what` names
  // the source in errors. Throws kvq::Error.
  Tokenizer(std::vector<std::string> pieces, std::vector<float> scores, const std::vector<bool>& matchable,
            const std::string& what);
  static constexpr int kBos = 1;
  static constexpr int kEos = 2;
  static constexpr int kMinVocab = 3 + 256;

  // sentencepiece-BPE encode: optional BOS, dummy " " prefix for non-empty
  // text, code points to pieces or byte-fallback ids, then merges: always the
  // best-scoring adjacent pair, the leftmost of equals (a heap over adjacent
  // pairs with a linked list of symbols: O(n log n)).
  std::vector<int> encode(const std::string& text, bool bos) const;
  // The same tokens by the original O(n^2) loop (rescan all pairs after each
  // merge); kept as the reference encode is tested against.
  std::vector<int> encode_reference(const std::string& text, bool bos) const;
  // The text of `token` following `prev` (drops the leading space after BOS,
  // maps <0xNN> pieces to raw bytes).
  std::string decode(int prev, int token) const;
  int vocab_size() const { return static_cast<int>(pieces_.size()); }
  const std::string& piece(int id) const { return pieces_[static_cast<size_t>(id)]; }

 private:
  void Index(const std::vector<bool>& matchable);
  int lookup(const std::string& s) const;
  // BOS, the " " prefix and code points or byte fallbacks, before merges.
  std::vector<int> Symbols(const std::string& text, bool bos) const;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::vector<std::pair<std::string, int>> sorted_;  // piece -> id, sorted
};

}  // namespace kvq::model
