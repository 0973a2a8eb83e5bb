// llama2.c's tokenizer (tokenizer.bin, or a GGUF's sentencepiece vocabulary): BPE merges by score,
// byte fallback, decoding with its special pieces (model/tokenizer.cc); or a GGUF's byte-level BPE
// (model/bpe.h) behind the same interface.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvq::model {

class ByteLevelBpe;

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
  // A byte-level BPE vocabulary (a GGUF's gpt2 tokenizer): its BOS id (-1:
  // none), whether encode(text, true) adds it (tokenizer.ggml.add_bos_token),
  // and the ids that end a text (EOS, EOT).
  Tokenizer(std::shared_ptr<const ByteLevelBpe> bpe, int bos, bool add_bos, std::vector<int> ends);
  ~Tokenizer();
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
  // The text of `token` following `prev` (sentencepiece: drops the leading
  // space after BOS, maps <0xNN> pieces to raw bytes; byte-level BPE: the
  // token's bytes, control tokens none).
  std::string decode(int prev, int token) const;
  // Whether a decoded piece is text to show: all but a lone ASCII control
  // byte (llama2.c's safe_printf skips unprintable single bytes; a byte of
  // 0x80 and above is part of a UTF-8 character and is kept: "café" is
  // "caf", <0xC3>, <0xA9> in stories260K's vocabulary).
  static bool shows_piece(const std::string& piece);
  // How many bytes at the end of `text` begin a UTF-8 character that is not
  // complete yet (0..3): a stream holds them back until the next piece.
  static size_t incomplete_utf8_tail(const std::string& text);
  int vocab_size() const;
  const std::string& piece(int id) const;
  // The id a sequence starts from: BOS (1 for sentencepiece; a BPE
  // vocabulary's own, or 1 when it names none).
  int bos_id() const { return bpe_ && bpe_bos_ >= 0 ? bpe_bos_ : kBos; }
  // Whether the vocabulary has a BOS of its own (a byte-level BPE may not).
  bool has_bos() const { return !bpe_ || bpe_bos_ >= 0; }
  // EOS: 2 for sentencepiece, a BPE vocabulary's first end id, -1 when none.
  int eos_id() const { return !bpe_ ? kEos : bpe_ends_.empty() ? -1 : bpe_ends_.front(); }
  // Whether generating `id` ends the text: BOS for llama2.c's vocabulary
  // (BOS delimits its stories), EOS / EOT for byte-level BPE.
  bool ends_text(int id) const;
  // "sentencepiece" or "byte-level BPE (<pre>)".
  std::string kind() const;

 private:
  void Index(const std::vector<bool>& matchable);
  int lookup(const std::string& s) const;
  // BOS, the " " prefix and code points or byte fallbacks, before merges.
  std::vector<int> Symbols(const std::string& text, bool bos) const;
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::vector<std::pair<std::string, int>> sorted_;  // piece -> id, sorted
  std::shared_ptr<const ByteLevelBpe> bpe_;
  int bpe_bos_ = -1;
  bool bpe_add_bos_ = false;
  std::vector<int> bpe_ends_;
};

}  // namespace kvq::model
