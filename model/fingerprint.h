// Identities a saved KV cache carries (kvq/kv_cache.h's KvCacheMeta): which
// model wrote it and which tokens it holds. SHA-256 (OpenSSL).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>

#include "kvq/sha256.h"

namespace kvq::model {

using Digest = kvq::Digest;

// SHA-256 of the checkpoint's bytes, then the tokenizer's, each prefixed by
// its length (u64 little-endian): a cache restored on another model, or
// with another vocabulary, is refused. Throws kvq::Error naming the path
// that cannot be read. Files of 64 MiB or more together (a real model:
// hashing takes seconds) have the digest kept in
// $XDG_CACHE_HOME/kvq/fingerprints (else ~/.cache/kvq/fingerprints), one
// entry per pair of absolute paths with both files' device, inode, size,
// mtime and ctime (ns); a later call reuses it while all of them match (a
// file rewritten in place with its size and mtime put back has a new
// ctime) (KVQ_FINGERPRINT_CACHE_MIN_BYTES overrides the threshold).
Digest model_fingerprint(const std::string& checkpoint_path, const std::string& tokenizer_path);

// SHA-256 of the token ids as int32 little-endian.
Digest tokens_digest(std::span<const int> tokens);

}  // namespace kvq::model
