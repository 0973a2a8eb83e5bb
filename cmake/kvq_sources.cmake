# The core library's sources, one list for the main build (CMakeLists.txt)
# and the fuzz build (fuzz/CMakeLists.txt, clang + sanitizers). Folders by
# concept, lower before higher (ARCHITECTURE.md):
#   base/     numbers: tensors, fp16 / bf16 / fp8, affine int8, ggml blocks, RoPE, statistics, SIMD targets
#   io/       bytes: the CRC32C container, whole-file writes, SHA-256
#   profile/  the seed's sorted profiles, cluster bank and outliers
#   calib/    calibrated static ranges and per-channel bit allocation
#   rows/     row schemes: the registry, each family's codecs, the row store and the row kernel
#   groups/   grouped schemes: grammar and presets, codes, the streaming store, encoding, the kernel, state I/O
#   cache/    the one KvCache: families over rows/ and groups/, saved caches (KVQS) and ranges (KVQR)
set(KVQ_CORE_SOURCES
  src/base/tensor.cc
  src/base/half.cc
  src/base/fp8.cc
  src/base/affine.cc
  src/base/ggml_quants.cc
  src/base/ggml_weights.cc
  src/base/ggml_dot.cc
  src/base/ggml_int_dot.cc
  src/base/rope.cc
  src/base/stats.cc
  src/base/targets.cc
  src/io/crc32c.cc
  src/io/container.cc
  src/io/file.cc
  src/io/sha256.cc
  src/attn/parts.cc
  src/profile/sorted_profile.cc
  src/profile/cluster_bank.cc
  src/profile/cluster_outliers.cc
  src/rows/kv_scheme.cc
  src/rows/row_store.cc
  src/rows/registry.cc
  src/rows/float_rows.cc
  src/rows/int8_rows.cc
  src/rows/fp8_rows.cc
  src/rows/ggml_rows.cc
  src/rows/attention.cc
  src/rows/attention_api.cc
  src/calib/static_ranges.cc
  src/groups/scheme.cc
  src/groups/store.cc
  src/groups/read.cc
  src/groups/state_io.cc
  src/groups/attention.cc
  src/groups/encode.cc
  src/cache/families.cc
  src/cache/row_family.cc
  src/cache/group_family.cc
  src/cache/token_table.cc
  src/cache/token_family.cc
  src/cache/kv_cache.cc
)
# The parsers the fuzz targets reach (fuzz/CMakeLists.txt): the core and the
# model's loaders, no forward pass.
set(KVQ_MODEL_LOADER_SOURCES model/checkpoint.cc model/tokenizer.cc model/bpe.cc model/gguf.cc model/gguf_model.cc model/tokens.cc
    model/chat_template.cc)
