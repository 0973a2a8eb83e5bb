// Pre-tokenized text (kvq eval --tokens): token ids made by any tokenizer,
// so a model whose tokenizer kvq does not implement can still be evaluated.
// Two forms: a NumPy .npy file (format 1.0-3.0, C order, one row: shape (N,)
// or (1, N); dtype int16/uint16/int32/uint32/int64/uint64, little-endian)
// or, for any other name, raw little-endian uint32 ids.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvq::model {

// Throws kvq::Error naming `what` on a malformed file, an empty one, or an
// id outside [0, vocab_size) (with its position).
std::vector<int> parse_token_ids(std::span<const uint8_t> bytes, bool npy, int vocab_size, const std::string& what);
// The file at `path` (.npy by its name), read whole (at most 1 GiB).
std::vector<int> read_token_file(const std::string& path, int vocab_size);

}  // namespace kvq::model
