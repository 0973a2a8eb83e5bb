"""A model kvq can run (GGUF or llama2.c) and token-id files."""

from . import _kvq
from ._util import _input, _numpy, _int, _str


class Model:
    """A model kvq can run: a GGUF file (architectures llama and qwen2; weights F32, F16, BF16, Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0, Q2_K ... Q6_K, IQ4_NL, IQ4_XS, kept in their type) or a llama2.c checkpoint, with
    kvq's fp32 forward pass.

    Model(path)
      .config                      dict: arch, dim, n_layers, heads, RoPE, norm_eps, tokenizer, ...
      .logits(tokens, kv="fp32", forward="window", weight_dot="exact")  float32 (T, vocab): the logits of
                                   tokens[0..T) with the KV cache in scheme kv; forward "token" (one decoding
                                   step at a time), "window" (the same numbers, bitwise) or "batched" (sgemm +
                                   chunked prefill: the same up to summation order); weight_dot "int8":
                                   quantized matrices through llama.cpp's arithmetic (8-bit activations,
                                   integer block sums; the same numbers in every pass)
      .tokenize(text, bos=True)    the GGUF's own tokenizer, sentencepiece or byte-level BPE (ValueError when it
                                   has none); text as str or bytes
      .detokenize(ids)             bytes
    """

    def __init__(self, path):
        self._m = _kvq.Model(_str(path, "path"))
        self.config = self._m.config()

    def logits(self, tokens, kv="fp32", forward="window", weight_dot="exact"):
        ids = [_int(t, "tokens") for t in _numpy(tokens).reshape(-1).tolist()] if not isinstance(tokens, list) \
            else [_int(t, "tokens") for t in tokens]
        return self._m.logits(ids, _str(kv, "kv"), _str(forward, "forward"), _str(weight_dot, "weight_dot"))

    def tokenize(self, text, bos=True):
        """The model's own tokenizer: str, or bytes (any bytes; byte-level BPE keeps invalid UTF-8 as
        byte tokens)."""
        if isinstance(text, (bytes, bytearray)):
            return self._m.tokenize_bytes(bytes(text), bool(bos))
        return self._m.tokenize(_str(text, "text"), bool(bos))

    def detokenize(self, ids):
        """The bytes the ids stand for (BOS/EOS and other control tokens: none)."""
        return self._m.detokenize([_int(t, "ids") for t in ids])

    def __repr__(self):
        c = self.config
        return (f"kvq.Model({c['arch']}: dim {c['dim']}, {c['n_layers']} layers, {c['n_heads']} heads, "
                f"{c['n_kv_heads']} KV heads, vocab {c['vocab_size']}, {c['rope']})")


def dequantize_ggml(ggml_type, data, n):
    """n values of a GGUF tensor's bytes in ggml type id ggml_type (0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 6 Q5_0,
    7 Q5_1, 8 Q8_0, 10-14 Q2_K-Q6_K, 20 IQ4_NL, 23 IQ4_XS, 30 BF16) as float32, exactly as ggml's
    reference dequantisation computes them."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        data = _numpy(data).tobytes()
    return _kvq.dequantize_ggml(_int(ggml_type, "ggml_type", 0, 2 ** 32 - 1), bytes(data), _int(n, "n"))


def quantize_activation(ggml_type, x):
    """One float32 row rounded to the 8-bit block format ggml pairs with weight type ggml_type (Q8_0, Q8_1 or
    Q8_K), byte for byte as ggml's quantize_row_q8_*_ref writes it: kvq's integer path's activation."""
    return _kvq.quantize_activation(_int(ggml_type, "ggml_type", 0, 2 ** 32 - 1), _input(x, "x")[0].astype("float32"))


def dot_ggml_int(ggml_type, weights, activation, cols):
    """Rows of cols values in ggml type ggml_type (bytes) dotted with an activation from quantize_activation
    through kvq's integer path (llama.cpp's arithmetic): (rows,) float32."""
    return _kvq.dot_ggml_int(_int(ggml_type, "ggml_type", 0, 2 ** 32 - 1), bytes(weights), bytes(activation),
                             _int(cols, "cols"))


def read_token_file(path, vocab_size):
    """Token ids from a .npy file (one row of integers) or raw little-endian uint32 ids (kvq eval --tokens)."""
    return _kvq.read_token_file(_str(path, "path"), _int(vocab_size, "vocab_size"))
