// Byte-level BPE, GPT-2's scheme (a GGUF's tokenizer.ggml.model = gpt2:
// Llama 3, Qwen2/2.5/3, SmolLM, GPT-2), as Hugging Face's tokenizers
// encodes (model/bpe.cc):
//
//   1. added tokens (GGUF token types control and user-defined: "<|...|>")
//      are cut out of the text where they occur, leftmost, longest first,
//      and map to their ids;
//   2. qwen2 only: the rest is NFC-normalised (ICU), as Qwen's tokenizer.json
//      says;
//   3. the pre-tokenizer of tokenizer.ggml.pre splits it into words with
//      its regular expression (PCRE2, Unicode properties):
//        llama-bpe  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
//                   | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//        qwen2      the same with \p{N} (one digit a word)
//        gpt-2      's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//        smollm     every digit a word, then gpt-2's expression
//      (bytes no expression matches, i.e. invalid UTF-8, form words of
//      their own);
//   4. each word's bytes become GPT-2's byte characters, and merges apply
//      by rank, the lowest first and the leftmost of equals (a heap over
//      adjacent pairs on a linked list: O(w log w) for a word of w bytes);
//      llama-bpe first takes a word that is a whole token as that token
//      (Llama 3's ignore_merges).
//
// Any other tokenizer.ggml.pre is refused by name.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvq::model {

class ByteLevelBpe {
 public:
  enum class Pre { kLlama3, kQwen2, kSmolLM, kGpt2 };
  // "llama-bpe", "qwen2", "smollm", "gpt-2"; nullopt for any other name.
  static std::optional<Pre> parse_pre(const std::string& name);
  static const char* pre_name(Pre p);

  // tokens: the vocabulary in GPT-2's byte characters; types: GGUF token
  // types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6
  // byte) or empty (all normal); merges: "left right" in rank order. The
  // 256 byte characters must be tokens, and every merge's parts and result.
  // `what` names the source in errors. Throws kvq::Error.
  ByteLevelBpe(std::vector<std::string> tokens, const std::vector<int64_t>& types,
               const std::vector<std::string>& merges, Pre pre, const std::string& what);
  ~ByteLevelBpe();
  ByteLevelBpe(const ByteLevelBpe&) = delete;
  ByteLevelBpe& operator=(const ByteLevelBpe&) = delete;

  // The ids of `text` (any bytes; no BOS). Thread-safe.
  std::vector<int> encode(std::string_view text) const;
  // The bytes token `id` stands for ("" for control tokens).
  std::string decode(int id) const;
  int vocab_size() const { return static_cast<int>(tokens_.size()); }
  const std::string& token(int id) const { return tokens_[static_cast<size_t>(id)]; }
  Pre pre() const { return pre_; }

 private:
  struct Regexes;
  void Words(std::string_view text, std::vector<int>& out, std::unordered_map<std::string, std::vector<int>>& cache) const;
  void Word(std::string_view word, std::vector<int>& out) const;
  std::vector<std::string> tokens_;
  std::vector<bool> control_;
  std::unordered_map<std::string, int> ids_;
  std::unordered_map<uint64_t, std::pair<int, int>> merges_;  // (left id, right id) -> (rank, merged id)
  int byte_id_[256] = {};
  int16_t char_byte_[324];        // GPT-2 byte character code point (< 324) -> byte, -1: none
  std::string byte_chars_[256];   // byte -> its character, UTF-8
  // The added tokens as a byte trie: node 0 is the root; a node's id is the
  // token ending there (-1: none; of duplicates, the first id). Matching at
  // a position walks at most the longest added token's bytes, whatever
  // their number (a list tried in turn cost text x tokens).
  struct AddedNode {
    std::vector<std::pair<unsigned char, int>> next;  // sorted by byte
    int id = -1;
  };
  std::vector<AddedNode> added_{AddedNode{}};
  // The longest added token at text[p..] (its id and length), or id -1.
  std::pair<int, size_t> MatchAdded(std::string_view text, size_t p) const;
  Pre pre_;
  std::unique_ptr<Regexes> re_;
};

}  // namespace kvq::model
