"""kvq — KV-cache quantization for transformer inference (Python API).

The seed note's module, backed by kvq's C++ core:

I2 part 1, affine int8 / fp8 KV quantization (bit-exact with the note's formula)
    quantize_kv_cache(x, *, mode='int8') -> AffineQuantized
    dequantize_kv_cache(q) -> float32 array of the original shape
    quantization_error_per_token(x, *, mode='int8') -> (n_tokens,)

G4, the sorted-profile (parametric tail) quantizer
    fit_sorted_profile(values, family=None, *, top_k=0, bits=4,
                       codebook='lloyd_max', ks_max=DEFAULT_KS_MAX) -> SortedProfileEncoding
    GaussianEstimator(), LaplaceEstimator()

The KV cache and fused decode attention (kvq's C++ cache, not the note's)
    kv_schemes(n_kv_heads=8, head_dim=128) -> {row scheme name: bits per K/V element}
    grouped_kv_presets() -> {preset: scheme}; kv_scheme_info(scheme) -> dict
    KvCache(scheme, n_layers, max_seq, n_kv_heads, head_dim, ranges=None)   any scheme or preset
        .write(layer, pos, k, v), .write_many(layer, pos0, k, v), .read(layer, pos),
        .bytes(), .bits(), .to_bytes(), KvCache.from_bytes(b), .save(path), KvCache.load(path)
    decode_attention(q, cache, layer, tokens=None, *, int8_query=False, scale=0.0, threads=0)
        -> (n_heads, head_dim)
    PrefixStore(url="", chunk_tokens=256, ...)   chunks of a prompt's cache in a directory, Redis or memory
        .put(tokens, cache) -> chunks written; .longest_prefix(tokens, like) -> (n_tokens, cache)

Models and generation
    Model(path).logits(tokens, kv="fp32", forward="window", weight_dot="exact") -> (T, vocab)
    dequantize_ggml(ggml_type, data, n) -> (n,) float32   a GGUF tensor's bytes (F32 ... Q6_K, IQ4_XS)
    quantize_activation(ggml_type, x) -> bytes; dot_ggml_int(ggml_type, weights, activation, cols)
        -> (rows,) float32   the integer path for quantized weights (llama.cpp's arithmetic)
    generate(model, prompt="", *, kv="", steps=256, save_cache=None, load_cache=None,
             prompt_cache=None, ...) -> {"text", "tokens", "bits", "status", ...}   kvq generate, in process

E2, the ClusterBank, and I2 part 2
    ClusterBank(n_head, d_head, ...).birth_and_merge(chunk_k, chunk_v) -> receipt dict
    quantize_cluster_outliers(per_cluster_outlier_tokens, flat_k, flat_v, *, mode='int8',
                              tail_family=None, tail_top_k=0, membership=None)
        -> {cluster_id: QuantizedClusterOutliers}
    dequantize_cluster_outliers(q) -> {"outlier_k", "outlier_v", "tail_k", "tail_v"}

Inputs are numpy arrays (float32, float16, or anything numpy converts to a
real array; other real dtypes are converted to float32) or torch CPU tensors
(float32, float16, bfloat16; other real dtypes converted to float32).
Non-contiguous inputs are copied. Outputs are of the kind given: torch in,
torch out. int8 codes are int8; fp8 (E4M3FN) codes come back as their uint8
bit patterns (numpy.uint8 / torch.uint8), since numpy has no fp8 dtype.

Bad input raises kvq.Error, a subclass of ValueError, whose message names
the argument and what was expected.
"""

# The package by concept; this module re-exports the public API.
from ._kvq import Error, Estimator, GaussianEstimator, LaplaceEstimator
from .targets import set_simd_targets, simd_target, supported_simd_targets
from .affine import AffineQuantized, dequantize_kv_cache, quantization_error_per_token, quantize_kv_cache
from .sorted_profile import DEFAULT_KS_MAX, SortedProfileEncoding, fit_sorted_profile
from .cache import (KvCache, all_kv_scheme_names, decode_attention, grouped_kv_presets, kv_scheme_info, kv_schemes,
                    static_ranges_from_samples)
from .prefix_store import PrefixStore
from .model import Model, dequantize_ggml, dot_ggml_int, quantize_activation, read_token_file
from .session import generate
from .clusters import (ClusterBank, QuantizedClusterOutliers, dequantize_cluster_outliers, quantize_cluster_outliers,
                       spearman)

__all__ = [
    "AffineQuantized", "ClusterBank", "DEFAULT_KS_MAX", "Error", "Estimator", "GaussianEstimator",
    "KvCache", "LaplaceEstimator", "Model", "PrefixStore", "QuantizedClusterOutliers", "SortedProfileEncoding", "all_kv_scheme_names",
    "decode_attention", "dequantize_ggml", "dot_ggml_int", "generate", "quantize_activation", "read_token_file",
    "dequantize_cluster_outliers", "dequantize_kv_cache", "fit_sorted_profile", "grouped_kv_presets", "kv_scheme_info",
    "kv_schemes",
    "quantization_error_per_token", "static_ranges_from_samples", "quantize_cluster_outliers", "quantize_kv_cache", "spearman",
    "set_simd_targets", "simd_target", "supported_simd_targets",
]

Error.__doc__ = ("kvq's error: a bad argument (wrong shape, dtype or mode, NaN/Inf, empty or out-of-range input, "
                 "truncated or corrupted bytes). A ValueError whose message names the argument and what was "
                 "expected.")
