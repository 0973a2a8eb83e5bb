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

import functools as _functools
import sys as _sys
import threading as _threading

import numpy as _np

from . import _kvq
from ._kvq import Error, Estimator, GaussianEstimator, LaplaceEstimator

def _lock_of(obj):
    """The object's own lock (created on first use; dict.setdefault is atomic under the GIL)."""
    return obj.__dict__.get("_lock") or obj.__dict__.setdefault("_lock", _threading.RLock())


def _locked(f):
    """Runs the method under the object's lock: calls on one kvq object from several threads run one
    at a time (the C++ objects are not safe to use concurrently, and the GIL is released inside)."""
    @_functools.wraps(f)
    def g(self, *args, **kwargs):
        with _lock_of(self):
            return f(self, *args, **kwargs)
    return g


def _locked_property(f, doc=None):
    return property(_locked(f), doc=doc)


__all__ = [
    "AffineQuantized", "ClusterBank", "DEFAULT_KS_MAX", "Error", "Estimator", "GaussianEstimator",
    "KvCache", "LaplaceEstimator", "Model", "PrefixStore", "QuantizedClusterOutliers", "SortedProfileEncoding", "all_kv_scheme_names",
    "decode_attention", "read_token_file",
    "dequantize_cluster_outliers", "dequantize_kv_cache", "fit_sorted_profile", "grouped_kv_presets", "kv_scheme_info",
    "kv_schemes",
    "quantization_error_per_token", "static_ranges_from_samples", "quantize_cluster_outliers", "quantize_kv_cache", "spearman",
    "set_simd_targets", "simd_target", "supported_simd_targets",
]

Error.__doc__ = ("kvq's error: a bad argument (wrong shape, dtype or mode, NaN/Inf, empty or out-of-range input, "
                 "truncated or corrupted bytes). A ValueError whose message names the argument and what was "
                 "expected.")

DEFAULT_KS_MAX = _kvq.DEFAULT_KS_MAX
"""Default KS gate of fit_sorted_profile (an effect size, see SortedProfileEncoding)."""

_MODES = ("int8", "fp8")


# ---- SIMD targets ---------------------------------------------------------------

def simd_target():
    """The Highway target kvq's kernels dispatch to now (e.g. "AVX3_DL", "AVX2", "NEON").

    KVQ_TARGETS (read once) or set_simd_targets limits it."""
    return _kvq.simd_target()


def set_simd_targets(name):
    """Limits dispatch to the Highway target `name` and the weaker ones below it ("" = all).

    Raises kvq.Error for an unknown name or one this CPU cannot run."""
    _kvq.set_simd_targets(str(name))


def supported_simd_targets():
    """Every compiled target this CPU supports now, best first."""
    return list(_kvq.supported_simd_targets())


# ---- array plumbing ------------------------------------------------------------

def _torch():
    """The torch module if the caller has imported it (kvq never imports it)."""
    return _sys.modules.get("torch")


def _is_torch(x):
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def _contiguous(a):
    # np.ascontiguousarray would turn a 0-d array into 1-d; keep the rank.
    return a if a.flags.c_contiguous else _np.ascontiguousarray(a)


def _input(x, arg):
    """(contiguous numpy array, dtype name, was_torch) for a real-valued input."""
    if _is_torch(x):
        torch = _torch()
        if x.device.type != "cpu":
            raise Error(f"{arg}: expected a CPU tensor, got device {x.device}")
        t = x.detach()
        if t.is_complex() or t.dtype == torch.bool:
            raise Error(f"{arg}: expected a real-valued tensor, got dtype {t.dtype}")
        if t.dtype == torch.bfloat16:
            return _contiguous(t.contiguous().view(torch.int16).numpy().view(_np.uint16)), "bfloat16", True
        if t.dtype not in (torch.float32, torch.float16):
            t = t.to(torch.float32)
        a = t.contiguous().numpy()
        return _contiguous(a), str(a.dtype), True
    try:
        a = _np.asarray(x)
    except Exception as e:  # ragged lists and the like
        raise Error(f"{arg}: expected an array-like of real numbers ({e})") from None
    if a.dtype.kind not in "fiu":
        raise Error(f"{arg}: expected a real-valued array, got dtype {a.dtype}")
    if a.dtype not in (_np.float32, _np.float16):
        a = a.astype(_np.float32)
    return _contiguous(a), str(a.dtype), False


def _output(a, as_torch):
    if a is None or not as_torch:
        return a
    return _torch().from_numpy(a)


def _numpy(x):
    """A numpy view/copy of an output-kind array (numpy or torch)."""
    if _is_torch(x):
        return x.detach().cpu().contiguous().numpy()
    return _np.asarray(x)


def _mode(mode):
    if mode not in _MODES:
        raise Error(f"mode: expected 'int8' or 'fp8', got {mode!r}")
    return mode


def _int(v, arg, lo=-2 ** 31, hi=2 ** 31 - 1):
    """An int that fits the C++ parameter it is passed to (int32 unless told)."""
    if isinstance(v, bool) or not isinstance(v, (int, _np.integer)):
        raise Error(f"{arg}: expected an integer, got {v!r}")
    if not lo <= int(v) <= hi:
        raise Error(f"{arg}: expected an integer in [{lo}, {hi}], got {int(v)}")
    return int(v)


def _str(v, arg):
    if not isinstance(v, str):
        raise Error(f"{arg}: expected a string, got {v!r}")
    return v


def _float(v, arg):
    if isinstance(v, bool) or not isinstance(v, (int, float, _np.integer, _np.floating)):
        raise Error(f"{arg}: expected a number, got {v!r}")
    return float(v)


def _indices(x, arg):
    a = _numpy(x)
    if a.size == 0:
        return _np.zeros(0, dtype=_np.int64)
    if a.dtype.kind not in "iu":
        raise Error(f"{arg}: expected integer token positions, got dtype {a.dtype}")
    return _np.ascontiguousarray(a.astype(_np.int64))


def _flatten_batch(a):
    """(b, t, n_head, d_head) -> (b*t, n_head, d_head); other ranks unchanged."""
    return a.reshape(-1, a.shape[-2], a.shape[-1]) if a.ndim == 4 else a


# ---- I2 part 1 -------------------------------------------------------------------

class AffineQuantized:
    """Quantized codes plus the per-tensor scale needed to dequantize them.

    codes: int8 (mode 'int8') or uint8 E4M3FN bit patterns (mode 'fp8'),
        numpy or torch, the shape of the input.
    scale: for int8 max(|x|) / 127 (dequant = codes * scale); for fp8 1.0.
    mode: 'int8' or 'fp8'.
    """

    __slots__ = ("codes", "scale", "mode")

    def __init__(self, codes, scale, mode):
        self.codes = codes
        self.scale = _float(scale, "scale")
        self.mode = _mode(mode)

    @property
    def size_bytes(self):
        """Bytes stored: the codes plus the float32 scale."""
        return int(_numpy(self.codes).nbytes) + 4

    def __repr__(self):
        return f"AffineQuantized(mode={self.mode!r}, scale={self.scale!r}, shape={tuple(self.codes.shape)})"


def quantize_kv_cache(x, *, mode="int8"):
    """Quantize a K or V tensor (any shape, rank >= 1) to int8 or fp8.

    int8: symmetric per-tensor affine, scale = max(|x|) / 127 (float32),
    codes = clamp(round_half_even(x / scale), -127, 127) with a true division;
    an all-zero input stores scale 0 and zero codes. fp8: the E4M3FN cast of x
    (saturating at +-448) with scale 1.0; codes are uint8 bit patterns.
    NaN/Inf raise ValueError naming the first bad flat index.
    """
    a, dt, as_torch = _input(x, "x")
    codes, scale, m = _kvq.quantize_kv_cache(a, dt, _mode(mode))
    return AffineQuantized(_output(codes, as_torch), scale, m)


def dequantize_kv_cache(q):
    """Inverse of quantize_kv_cache: float32 of the original shape (codes * scale)."""
    if not isinstance(q, AffineQuantized):
        raise Error(f"q: expected an AffineQuantized, got {type(q).__name__}")
    codes = q.codes
    as_torch = _is_torch(codes)
    c = _contiguous(_numpy(codes))
    return _output(_kvq.dequantize_kv_cache(c, q.scale, _mode(q.mode)), as_torch)


def quantization_error_per_token(x, *, mode="int8"):
    """Mean absolute quantize/dequantize round-trip error of each leading-axis row.

    x: (n_tokens, ...) -> (n_tokens,) float32, using quantize_kv_cache(x, mode=mode).
    """
    a, dt, as_torch = _input(x, "x")
    return _output(_kvq.quantization_error_per_token(a, dt, _mode(mode)), as_torch)


# ---- G4 ---------------------------------------------------------------------------

class SortedProfileEncoding:
    """G4 encoding of a value population: head-exact top-k + a fitted parametric tail.

    Attributes: family, params (loc, scale), n, bits, codebook, ks_max,
    ks_statistic (the exact KS distance D of the tail to its fit), p_value
    (asymptotic Kolmogorov), path ('empty', 'constant', 'parametric', 'dense'),
    fallback (True when the KS gate sent the tail to dense int8), why,
    head_indices, head_values, size_bytes (exact serialised size).
    decode() gives the n values back in their original order.
    """

    def __init__(self, enc, as_torch=False):
        if not isinstance(enc, _kvq.SortedProfileEncoding):
            raise Error("enc: expected an encoding made by fit_sorted_profile or SortedProfileEncoding.from_bytes")
        self._enc = enc
        self._torch = as_torch

    family = property(lambda self: self._enc.family, doc="Estimator name of the tail fit.")
    params = property(lambda self: self._enc.params, doc="Fitted tail parameters (loc, scale).")
    n = property(lambda self: self._enc.n, doc="Values encoded (head + tail).")
    bits = property(lambda self: self._enc.bits, doc="Code width of the parametric tail.")
    codebook = property(lambda self: self._enc.codebook, doc="'lloyd_max' or 'quantile'.")
    ks_max = property(lambda self: self._enc.ks_max, doc="The KS gate the fit was held to.")
    ks_statistic = property(lambda self: self._enc.ks_statistic, doc="KS distance D of the tail to its fit.")
    p_value = property(lambda self: self._enc.p_value, doc="Asymptotic Kolmogorov p-value of D.")
    path = property(lambda self: self._enc.path, doc="How the tail was stored.")
    fallback = property(lambda self: self._enc.fallback, doc="True when the tail went dense (int8).")
    why = property(lambda self: self._enc.why, doc="Human-readable account of the path taken.")
    size_bytes = property(lambda self: self._enc.size_bytes, doc="Exact size of serialize() in bytes.")

    @property
    def head_indices(self):
        """Flat indices of the exact head values (ascending)."""
        return _output(self._enc.head_indices, self._torch)

    @property
    def head_values(self):
        """The exact head values (float32)."""
        return _output(self._enc.head_values, self._torch)

    def decode(self):
        """The n values, in their original (flat) order, as float32."""
        return _output(self._enc.decode(), self._torch)

    def serialize(self):
        """bytes: versioned container (magic 'KVQP', CRC32C), len == size_bytes."""
        return self._enc.serialize()

    @staticmethod
    def from_bytes(data):
        """Inverse of serialize(); raises kvq.Error on truncated or corrupted input."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise Error(f"data: expected bytes, got {type(data).__name__}")
        return SortedProfileEncoding(_kvq.SortedProfileEncoding.deserialize(bytes(data)))

    def __repr__(self):
        return (f"SortedProfileEncoding(family={self.family!r}, n={self.n}, path={self.path!r}, "
                f"ks_statistic={self.ks_statistic:.4g}, size_bytes={self.size_bytes})")


def _family(family, arg):
    if family is None:
        return GaussianEstimator()
    if not isinstance(family, Estimator):
        raise Error(f"{arg}: expected GaussianEstimator(), LaplaceEstimator() or None, got {family!r}")
    return family


def fit_sorted_profile(values, family=None, *, top_k=0, bits=4, codebook="lloyd_max", ks_max=DEFAULT_KS_MAX):
    """G4: encode `values` (any shape, flattened) as head-exact top-k + a parametric tail.

    family: GaussianEstimator() (default) or LaplaceEstimator().
    top_k: values of largest |x| kept exactly (ties: lower index first).
    bits: 1..8, tail code width. codebook: 'lloyd_max' or 'quantile'.
    ks_max: gate on the KS distance D; above it the tail goes dense through
        quantize_kv_cache int8 (fallback=True).
    """
    a, dt, as_torch = _input(values, "values")
    enc = _kvq.fit_sorted_profile(a, dt, _family(family, "family"), _int(top_k, "top_k"), _int(bits, "bits"),
                                  _str(codebook, "codebook"), _float(ks_max, "ks_max"))
    return SortedProfileEncoding(enc, as_torch)


# ---- the KV cache and decode attention --------------------------------------------

def _f32(x, arg):
    """(float32 C-contiguous numpy array, was_torch) of a real-valued input."""
    a, dt, as_torch = _input(x, arg)
    if dt == "bfloat16":  # uint16 bit patterns: the upper half of a float32
        a = (a.astype(_np.uint32) << 16).view(_np.float32)
    elif dt != "float32":
        a = a.astype(_np.float32)
    return _contiguous(a), as_torch


def all_kv_scheme_names():
    """Every row scheme, then every preset: the names `kvq eval --kv all` runs."""
    return list(_kvq.all_kv_scheme_names())


def kv_schemes(n_kv_heads=8, head_dim=128):
    """{scheme name: bits per K/V element} of every KV-cache scheme, in registry order.

    Bits count everything stored (codes and scales) and depend on the geometry
    (a per-token scale is spread over n_kv_heads * head_dim values); the default
    is a Llama-style 8 KV heads x 128. Schemes the geometry cannot hold (q8_0 and
    q4_0 need rows of whole 32-value blocks) are left out.
    """
    n, d = _int(n_kv_heads, "n_kv_heads"), _int(head_dim, "head_dim")
    out = {}
    for name in _kvq.kv_scheme_names():
        try:
            out[name] = _kvq.kv_scheme_bits(name, n, d)
        except Error:
            if n < 1 or d < 1:
                raise
    return out


class KvCache:
    """kvq's KV cache, one type for every scheme (kvq/kv_cache.h).

    KvCache(scheme, n_layers, max_seq, n_kv_heads, head_dim, ranges=None, *, rope_theta=10000.0)
    scheme: a row scheme from kv_schemes() ("fp16", "int8", "q4_0", ...), a grouped
        scheme k<B>[a]v<B>g<G>[p8][m][o<N>[x<X>][w<W>]][r<R>][s<S>] / k<B>[a]v<B>c[r<R>][s<S>], or a
        preset (grouped_kv_presets(): "kvq-4.5", ...). Schemes that allocate K bits (k<B>a), code
        group parameters on a grid (p8) or are calibrated (c) need ranges
        (static_ranges_from_samples).
    write(layer, pos, k, v): one token; k after RoPE at pos, v; n_kv_heads * head_dim values each
        ((n_kv_heads, head_dim) or flat), numpy or torch, finite. A layer is written in order
        (pos 0 starts a new sequence; a row scheme also rewrites any earlier position).
    write_many(layer, pos0, k, v): tokens pos0 .. pos0 + T - 1; k, v of shape (T, n_kv_heads,
        head_dim) or (T, n_kv_heads * head_dim).
    read(layer, pos) -> (k, v): a token as attention reads it, float32 (n_kv_heads, head_dim).
    written(layer), tokens: lengths. bytes(tokens=None), bits(tokens=None): every stored bit
        counted, what the cache holds (row schemes: for any tokens <= written; grouped: as written).
    to_bytes(tokens=None, model_fingerprint=None, tokens_digest=None) -> bytes; KvCache.from_bytes(b,
        max_seq=None, model_fingerprint=None); save(path, ...), KvCache.load(path, ...): a checksummed
        container of exactly what the cache holds (+ a header of at most 4 KiB); restored caches attend
        bitwise alike and continue as the saved one would. A restored cache's capacity is max_seq
        (default: the tokens it holds).
    Attention reads the stored codes directly (decode_attention). The GIL is released while
    encoding and attending; calls on one cache from several threads run one at a time (a lock
    per object), so a cache may be shared between threads.
    """

    def __init__(self, scheme, n_layers, max_seq, n_kv_heads, head_dim, ranges=None, *, rope_theta=10000.0):
        if ranges is not None and not isinstance(ranges, _kvq.StaticRanges):
            raise Error(f"ranges: expected static_ranges_from_samples(...), got {type(ranges).__name__}")
        self._c = _kvq.KvCache(_str(scheme, "scheme"), _int(n_layers, "n_layers"), _int(max_seq, "max_seq"),
                               _int(n_kv_heads, "n_kv_heads"), _int(head_dim, "head_dim"), ranges,
                               _float(rope_theta, "rope_theta"))
        self.model_fingerprint = self.tokens_digest = None  # what a restored cache carried

    @classmethod
    def _wrap(cls, c):
        self = cls.__new__(cls)
        self._c = c
        self.model_fingerprint = self.tokens_digest = None
        return self

    scheme = _locked_property(lambda self: self._c.scheme, doc="The canonical scheme name (a preset's expansion).")
    label = _locked_property(lambda self: self._c.label, doc="The name to print (a preset's name).")
    n_layers = _locked_property(lambda self: self._c.n_layers)
    max_seq = _locked_property(lambda self: self._c.max_seq)
    n_kv_heads = _locked_property(lambda self: self._c.n_kv_heads)
    head_dim = _locked_property(lambda self: self._c.head_dim)
    tokens = _locked_property(lambda self: self._c.tokens, doc="The length every layer has reached.")

    def _rows(self, x, arg, many):
        a, _ = _f32(x, arg)
        row = self.n_kv_heads * self.head_dim
        if not many:
            if a.size != row:
                raise Error(f"{arg}: expected {row} values (n_kv_heads * head_dim), got shape {tuple(a.shape)}")
            return a.reshape(1, row)
        if a.ndim not in (2, 3) or a.size != a.shape[0] * row or a.shape[0] == 0:
            raise Error(f"{arg}: expected shape (T, {self.n_kv_heads}, {self.head_dim}) or (T, {row}), "
                        f"got {tuple(a.shape)}")
        return _contiguous(a.reshape(a.shape[0], row))

    @_locked
    def write(self, layer, pos, k, v):
        """Stores one token's K (after RoPE) and V at `pos` of `layer`."""
        self._c.write_many(_int(layer, "layer"), _int(pos, "pos"), self._rows(k, "k", False),
                           self._rows(v, "v", False))

    @_locked
    def write_many(self, layer, pos0, k, v):
        """Stores T tokens' K (after RoPE) and V at pos0 .. pos0 + T - 1 of `layer`."""
        kr, vr = self._rows(k, "k", True), self._rows(v, "v", True)
        if kr.shape != vr.shape:
            raise Error(f"v: expected {kr.shape[0]} tokens like k, got {vr.shape[0]}")
        self._c.write_many(_int(layer, "layer"), _int(pos0, "pos0"), kr, vr)

    @_locked
    def read(self, layer, pos):
        """(k, v) of one token as attention reads it, float32 arrays (n_kv_heads, head_dim)."""
        k, v = self._c.read(_int(layer, "layer"), _int(pos, "pos", 0, 2 ** 62))
        return k.reshape(self.n_kv_heads, self.head_dim), v.reshape(self.n_kv_heads, self.head_dim)

    @_locked
    def written(self, layer):
        return self._c.written(_int(layer, "layer"))

    def _tokens(self, tokens):
        return -1 if tokens is None else _int(tokens, "tokens", 0, 2 ** 62)

    @_locked
    def bytes(self, tokens=None):
        """Bytes the cache holds (every stored bit: codes, scales, parameters, tables), all layers."""
        return self._c.bytes(self._tokens(tokens))

    @_locked
    def bits(self, tokens=None):
        """8 bytes / (2 tokens n_kv_heads head_dim n_layers)."""
        return self._c.bits(self._tokens(tokens))

    @_locked
    def allocated_bytes(self):
        """The object's K/V allocations: bytes() plus a bounded constant."""
        return self._c.allocated_bytes()

    @staticmethod
    def _digest(x, arg):
        if x is None:
            return None
        if not isinstance(x, (bytes, bytearray)) or len(x) != 32:
            raise Error(f"{arg}: expected 32 bytes (e.g. a SHA-256 digest) or None")
        return bytes(x)

    @_locked
    def to_bytes(self, tokens=None, *, model_fingerprint=None, tokens_digest=None):
        """The cache's first `tokens` tokens as a checksummed container (kvq/kv_cache.h)."""
        return self._c.to_bytes(self._tokens(tokens), self._digest(model_fingerprint, "model_fingerprint"),
                                self._digest(tokens_digest, "tokens_digest"))

    @classmethod
    def _restored(cls, got):
        c, fingerprint, digest = got
        self = cls._wrap(c)
        self.model_fingerprint, self.tokens_digest = fingerprint, digest
        return self

    @classmethod
    def from_bytes(cls, data, *, max_seq=None, model_fingerprint=None):
        """A cache restored from to_bytes(). max_seq: its capacity (default: the tokens it holds);
        model_fingerprint: the one it must carry. The restored cache's model_fingerprint and
        tokens_digest are the saved ones (None when absent)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise Error(f"data: expected bytes, got {type(data).__name__}")
        return cls._restored(_kvq.KvCache.from_bytes(bytes(data), cls._digest(model_fingerprint, "model_fingerprint"),
                                                     cls._max_seq(max_seq)))

    @_locked
    def save(self, path, tokens=None, *, model_fingerprint=None, tokens_digest=None):
        """Writes to_bytes() to `path` (a temporary file beside it, renamed: whole or absent)."""
        self._c.save(_str(path, "path"), self._tokens(tokens), self._digest(model_fingerprint, "model_fingerprint"),
                     self._digest(tokens_digest, "tokens_digest"))

    @classmethod
    def load(cls, path, *, max_seq=None, model_fingerprint=None):
        """A cache restored from a file written by save() (arguments as from_bytes)."""
        return cls._restored(_kvq.KvCache.load(_str(path, "path"), cls._digest(model_fingerprint, "model_fingerprint"),
                                               cls._max_seq(max_seq)))

    @staticmethod
    def _max_seq(x):
        return None if x is None else _int(x, "max_seq", 1, 2 ** 31 - 1)

    def attend(self, q, layer, tokens=None, *, threads=0, scale=0.0, reference=False):
        """Attention of a query at position tokens - 1; see decode_attention. reference=True: the
        decode-then-attend reference (double precision)."""
        if not isinstance(reference, bool):
            raise Error(f"reference: expected True or False, got {reference!r}")
        return decode_attention(q, self, layer, tokens, threads=threads, scale=scale, _reference=reference)

    def __repr__(self):
        return (f"KvCache({self.label!r}, n_layers={self.n_layers}, max_seq={self.max_seq}, "
                f"n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, tokens={self.tokens})")


def kv_scheme_info(scheme):
    """{"name", "label", "family", "needs_ranges"} of any scheme name or preset."""
    return dict(_kvq.kv_scheme_info(_str(scheme, "scheme")))


def decode_attention(q, cache, layer, tokens=None, *, int8_query=False, scale=0.0, threads=0, _reference=False):
    """Softmax attention of one decode step over the first `tokens` positions of `layer`.

    q: (n_heads, head_dim) after RoPE (numpy or torch), n_heads a multiple of the cache's
    n_kv_heads (query head h reads KV head h // (n_heads // n_kv_heads)). tokens: None = as
    written (a row scheme reads any tokens <= written, a grouped one its current length).
    Reads the stored codes directly (fused dequantisation, online softmax); scale 0 means
    1 / sqrt(head_dim); int8_query rounds the query to int8 for the row schemes' integer K
    scores (inexact, as ggml does; see kvq/attention.h). Returns (n_heads, head_dim) float32,
    torch if q was torch. The GIL is released.
    """
    if not isinstance(cache, KvCache):
        raise Error(f"cache: expected a kvq.KvCache, got {type(cache).__name__}")
    a, as_torch = _f32(q, "q")
    if a.ndim != 2 or a.shape[1] != cache.head_dim:
        raise Error(f"q: expected shape (n_heads, {cache.head_dim}), got {tuple(a.shape)}")
    if not isinstance(int8_query, bool):
        raise Error(f"int8_query: expected True or False, got {int8_query!r}")
    t = -1 if tokens is None else _int(tokens, "tokens", 0, 2 ** 62)
    with _lock_of(cache):
        out = _kvq.KvCache.attend(cache._c, a, _int(layer, "layer"), t, int8_query, _float(scale, "scale"),
                                  _int(threads, "threads"), _reference)
    return _output(out.reshape(a.shape), as_torch)


# ---- the prefix store -----------------------------------------------------------------


class PrefixStore:
    """A compressed prefix store (store/prefix_store.h): a prompt's KV cache in chunks of
    chunk_tokens tokens (rounded up to a multiple of the scheme's group), each under a chained
    SHA-256 key of (model fingerprint, scheme and its tables, the previous chunk's key, the
    chunk's token ids), in the scheme's stored form.

    PrefixStore(url="", chunk_tokens=256, *, max_bytes=0, ttl=0, key_prefix="kvq:prefix:",
                timeout_ms=1000, model_fingerprint=None, secret=None)
    url: a directory ("" = ~/.cache/kvq/prefix), "redis://[user:password@]host:port[/db]"
        (password also from KVQ_REDIS_PASSWORD; never printed) or "memory:NAME" (this process).
    max_bytes: a directory's size cap (least recently used chunks go first); ttl: seconds a Redis
        entry lives; model_fingerprint: 32 bytes identifying the model (keys differ per model);
        secret (bytes or str, never printed): chunks carry an HMAC-SHA256 under it and chunks that
        fail it (written without it, under another one, or altered) are misses with a warning.
    Chunk i ends at chunk_ends(cache, i + 1)[-1] (the first also holds the scheme's offset).
    put(tokens, cache) -> chunks written: the full chunks of tokens[:cache.tokens] not yet
        restored or written by this store (a row cache any of them; a grouped cache the one ending
        at its current length, so call put as each chunk fills).
    longest_prefix(tokens, like, limit=None) -> (n_tokens, cache): a new cache like `like`
        (scheme, geometry, calibrated tables, max_seq; its contents unused) holding the longest
        run of stored chunks of tokens[:limit], bit for bit the cache an uninterrupted run has
        at n_tokens; (0, empty cache) when none.
    A corrupted, truncated or foreign entry is a miss; an unreachable, silent (timeout_ms) or
    dying Redis leaves the store empty. Each is one RuntimeWarning, also kept in .warnings.
    Calls on one store from several threads run one at a time (a lock per object; put and
    longest_prefix also hold the cache's lock, store first).
    """

    def __init__(self, url="", chunk_tokens=256, *, max_bytes=0, ttl=0, key_prefix="kvq:prefix:", timeout_ms=1000,
                 model_fingerprint=None, secret=None):
        self.warnings = []
        if secret is None:
            secret = b""
        elif isinstance(secret, str):
            secret = secret.encode()
        elif isinstance(secret, (bytes, bytearray)):
            secret = bytes(secret)
        else:
            raise Error(f"secret: expected bytes or str, got {type(secret).__name__}")
        self._s = _kvq.PrefixStore(_str(url, "url"), _int(chunk_tokens, "chunk_tokens"),
                                   _float(max_bytes, "max_bytes"), _int(ttl, "ttl"), _str(key_prefix, "key_prefix"),
                                   _int(timeout_ms, "timeout_ms"), KvCache._digest(model_fingerprint,
                                                                                   "model_fingerprint"), secret)
        self._warn()

    def _warn(self):
        import warnings
        for w in self._s.take_warnings():
            self.warnings.append(w)
            warnings.warn("kvq prefix store: " + w, RuntimeWarning, stacklevel=3)

    @staticmethod
    def _cache(c, arg):
        if not isinstance(c, KvCache):
            raise Error(f"{arg}: expected a kvq.KvCache, got {type(c).__name__}")
        return c._c

    @staticmethod
    def _ids(tokens):
        if _is_torch(tokens):
            tokens = tokens.detach().cpu().numpy()
        a = _np.asarray(tokens)
        if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
            raise Error(f"tokens: expected a 1-D sequence of integer token ids, got {a.dtype} of shape {a.shape}")
        return a.astype(_np.int64)

    @_locked
    def put(self, tokens, cache):
        """Stores the new full chunks of cache (computed from tokens); returns how many."""
        try:
            c = self._cache(cache, "cache")
            with _lock_of(cache):
                n, _ = self._s.put(self._ids(tokens), c)
        finally:
            self._warn()
        return n

    @_locked
    def longest_prefix(self, tokens, like, limit=None):
        """(n_tokens, cache): the longest stored run of full chunks of tokens[:limit], restored."""
        lim = -1 if limit is None else _int(limit, "limit", 0, 2 ** 62)
        try:
            c = self._cache(like, "like")
            with _lock_of(like):
                n, c, self.last_lookup = self._s.longest_prefix(self._ids(tokens), c, lim)
        finally:
            self._warn()
        return n, KvCache._wrap(c)

    @_locked
    def chunk_tokens(self, cache):
        """The chunk size this store uses for cache's scheme."""
        return self._s.chunk_tokens(self._cache(cache, "cache"))

    @_locked
    def chunk_ends(self, cache, n):
        """Where the first n chunks end for cache's scheme: offset + (i + 1) * chunk_tokens, the
        offset (a grouped scheme's sinks and recent window) putting the ends where the cache holds
        the fewest open tokens."""
        c, o = self._s.chunk_plan(self._cache(cache, "cache"))
        return [o + (i + 1) * c for i in range(_int(n, "n", 0, 2 ** 30))]

    @_locked
    def keys(self, tokens, cache):
        """Hex keys of the full chunks of tokens for cache's scheme, tables and this store's model."""
        return list(self._s.keys(self._ids(tokens), self._cache(cache, "cache")))

    @property
    @_locked
    def alive(self):
        """False once a Redis store gave up (it then behaves as an empty store)."""
        return self._s.alive()

    def __repr__(self):
        return f"kvq.PrefixStore({self._s.describe()!r})"


# ---- grouped low-bit schemes ------------------------------------------------------------


class Model:
    """A model kvq can run: a GGUF file (architectures llama and qwen2; F32, F16, BF16 and Q8_0 weights,
    dequantised to fp32) or a llama2.c checkpoint, with kvq's fp32 forward pass.

    Model(path)
      .config                      dict: arch, dim, n_layers, heads, RoPE, norm_eps, tokenizer, ...
      .logits(tokens, kv="fp32", forward="window")  float32 (T, vocab): the logits of tokens[0..T) with
                                   the KV cache in scheme kv; forward "token" (one decoding step at a time),
                                   "window" (the same numbers, bitwise) or "batched" (sgemm + chunked prefill:
                                   the same up to summation order)
      .tokenize(text, bos=True)    the GGUF's own sentencepiece tokenizer (ValueError when it has none)
    """

    def __init__(self, path):
        self._m = _kvq.Model(_str(path, "path"))
        self.config = self._m.config()

    def logits(self, tokens, kv="fp32", forward="window"):
        ids = [_int(t, "tokens") for t in _numpy(tokens).reshape(-1).tolist()] if not isinstance(tokens, list) \
            else [_int(t, "tokens") for t in tokens]
        return self._m.logits(ids, _str(kv, "kv"), _str(forward, "forward"))

    def tokenize(self, text, bos=True):
        return self._m.tokenize(_str(text, "text"), bool(bos))

    def __repr__(self):
        c = self.config
        return (f"kvq.Model({c['arch']}: dim {c['dim']}, {c['n_layers']} layers, {c['n_heads']} heads, "
                f"{c['n_kv_heads']} KV heads, vocab {c['vocab_size']}, {c['rope']})")


def read_token_file(path, vocab_size):
    """Token ids from a .npy file (one row of integers) or raw little-endian uint32 ids (kvq eval --tokens)."""
    return _kvq.read_token_file(_str(path, "path"), _int(vocab_size, "vocab_size"))


def grouped_kv_presets():
    """{preset name: scheme name} of the grouped low-bit presets."""
    return dict(_kvq.grouped_kv_presets())


def static_ranges_from_samples(k, v, n_kv_heads, head_dim, *, clip=0.0, k_weight=None):
    """Calibrated ranges for the calibrated (k<B>v<B>c), allocated (k<B>a...) and p8 schemes.

    k, v: one array per layer of shape (T, n_kv_heads, head_dim) or (T, n_kv_heads * head_dim),
    K in the grouped cache's tile frame (kvq/grouped_kv.h: the key after RoPE turned back by the
    start of its 16-token tile); measure them on text the model generates, not on evaluation text.
    clip: share of each channel's samples left outside its range at each end.
    k_weight: optional (layers * n_kv_heads * head_dim) per-channel weights for bit allocation.
    """
    n, d = _int(n_kv_heads, "n_kv_heads"), _int(head_dim, "head_dim")
    if not isinstance(k, (list, tuple)) or not isinstance(v, (list, tuple)):
        raise Error("k, v: expected a list of per-layer arrays each")
    ks = [_contiguous(_f32(x, "k")[0]) for x in k]
    vs = [_contiguous(_f32(x, "v")[0]) for x in v]
    w = _np.zeros(0, _np.float32) if k_weight is None else _contiguous(_f32(k_weight, "k_weight")[0].reshape(-1))
    return _kvq.static_ranges_from_samples(ks, vs, n, d, _float(clip, "clip"), w)


# ---- E2 ---------------------------------------------------------------------------

_BANK_DEFAULTS = _kvq.default_cluster_bank_options()


class ClusterBank:
    """E2: one layer's tokens summarised as clusters with Gaussian-affine V|K fits.

    ClusterBank(n_head, d_head, *, max_clusters=16, birth_distance=2.0,
                merge_distance=2.0, outlier_top_k=4, ridge=0.01, closure="two-point")

    birth_and_merge(chunk_k, chunk_v) consumes a chunk of shape
    (T, n_head, d_head) (or (b, t, n_head, d_head), flattened to b*t tokens)
    and returns the receipt dict:
      assignments (T,), per_token_residual (T,), per_cluster_misfit {id: float},
      births, merges, born [ids], merged [(kept, absorbed)],
      per_cluster_outlier_tokens {id: {"k": (n_out, n_head, d_head), "v": ..., "indices": (n_out,)}}.
    Distances are measured on the within-cluster key scale (key_scale: one
    variance per head), so the clustering does not depend on the data's units
    or on how many groups a chunk holds; births and merges follow
    include/kvq/cluster_bank.h. far_field uses the bounded "two-point" (default)
    or "gaussian" closure. The bank's state persists across chunks.
    """

    def __init__(self, n_head, d_head, *, max_clusters=_BANK_DEFAULTS["max_clusters"],
                 birth_distance=_BANK_DEFAULTS["birth_distance"], merge_distance=_BANK_DEFAULTS["merge_distance"],
                 outlier_top_k=_BANK_DEFAULTS["outlier_top_k"], ridge=_BANK_DEFAULTS["ridge"],
                 closure=_BANK_DEFAULTS["closure"]):
        if not isinstance(closure, str):
            raise Error(f"closure: expected \"two-point\" or \"gaussian\", got {closure!r}")
        self._bank = _kvq.ClusterBank(_int(n_head, "n_head"), _int(d_head, "d_head"),
                                      _int(max_clusters, "max_clusters"), _float(birth_distance, "birth_distance"),
                                      _float(merge_distance, "merge_distance"), _int(outlier_top_k, "outlier_top_k"),
                                      _float(ridge, "ridge"), closure)

    n_head = property(lambda self: self._bank.n_head)
    d_head = property(lambda self: self._bank.d_head)
    num_clusters = property(lambda self: self._bank.num_clusters, doc="Live clusters.")
    cluster_ids = property(lambda self: self._bank.cluster_ids, doc="Live cluster ids, ascending.")
    total_births = property(lambda self: self._bank.total_births)
    total_merges = property(lambda self: self._bank.total_merges)
    key_scale = property(lambda self: list(self._bank.key_scale),
                         doc="Per-head within-cluster key variance used for the last chunk.")

    def cluster_count(self, cluster_id):
        """Tokens in the cluster's moments (outliers excluded)."""
        return self._bank.cluster_count(_int(cluster_id, "cluster_id"))

    def fit(self, cluster_id, head):
        """{"count", "mean_k", "mean_v", "A"}: v_hat = mean_v + A @ (k - mean_k) for one head."""
        return self._bank.fit(_int(cluster_id, "cluster_id"), _int(head, "head"))

    def far_field(self, q, scale=0.0):
        """Moment-closure attention of queries q (n_q_heads, d_head) over the bank's clusters.

        n_q_heads must be a multiple of n_head (GQA). A cluster of n tokens with
        key mean mu, covariance Sigma and key range [lo, hi] carries, with the
        default two-point closure, log-mass log n + s q.mu + log cosh(s sqrt(q'Sigma q))
        (the "gaussian" closure: s^2 q'Sigma q / 2), clipped to [log n + s q.mu,
        log n + s max over the range]; clusters combine by log-sum-exp. Returns {"log_mass": (n_q_heads,), "value": (n_q_heads, d_head)}
        (log_mass -inf and value 0 for an empty bank). scale 0 means 1/sqrt(d_head).
        """
        a, dt, as_torch = _input(q, "q")
        if dt != "float32":
            a = a.astype(_np.float32)
        if a.ndim != 2:
            raise Error(f"q: expected shape (n_q_heads, {self.d_head}), got {tuple(a.shape)}")
        r = self._bank.far_field(_contiguous(a), _int(a.shape[0], "q.shape[0]"), _float(scale, "scale"))
        return {k: _output(v, as_torch) for k, v in r.items()}

    def birth_and_merge(self, chunk_k, chunk_v):
        """Assign, birth, merge, fit and flag outliers for one chunk; returns the receipt dict."""
        k, kd, as_torch = _input(chunk_k, "chunk_k")
        v, vd, _ = _input(chunk_v, "chunk_v")
        r = self._bank.birth_and_merge(_flatten_batch(k), kd, _flatten_batch(v), vd)
        if as_torch:
            for key in ("assignments", "per_token_residual"):
                r[key] = _output(r[key], True)
            for s in r["per_cluster_outlier_tokens"].values():
                for key in ("k", "v", "indices"):
                    s[key] = _output(s[key], True)
        return r

    def __repr__(self):
        return f"ClusterBank(n_head={self.n_head}, d_head={self.d_head}, clusters={self.num_clusters})"


# ---- I2 part 2 --------------------------------------------------------------------

class QuantizedClusterOutliers:
    """One cluster's storage for one chunk: quantized exact outliers + G4 parametric tails.

    cluster_id: int
    outlier_k, outlier_v: AffineQuantized of the flagged tokens (n_out, n_head, d_head), or None
    outlier_indices: flat chunk positions of the outliers (int64), or None
    tail_k, tail_v: SortedProfileEncoding of the non-outlier population, or None
    n_head, d_head, tail_tokens: geometry of the tail (decoded as (tail_tokens, n_head, d_head))
    size_bytes: codes + scales + 4 bytes per index + the tails' serialised sizes
    """

    __slots__ = ("cluster_id", "outlier_k", "outlier_v", "outlier_indices", "tail_k", "tail_v", "n_head",
                 "d_head", "tail_tokens", "size_bytes")

    def __init__(self, cluster_id, outlier_k, outlier_v, outlier_indices, tail_k, tail_v, *, n_head=None,
                 d_head=None, tail_tokens=None, size_bytes=None):
        self.cluster_id = _int(cluster_id, "cluster_id")
        self.outlier_k, self.outlier_v, self.outlier_indices = outlier_k, outlier_v, outlier_indices
        self.tail_k, self.tail_v = tail_k, tail_v
        self.n_head, self.d_head, self.tail_tokens, self.size_bytes = n_head, d_head, tail_tokens, size_bytes

    def __repr__(self):
        n_out = 0 if self.outlier_indices is None else len(self.outlier_indices)
        return (f"QuantizedClusterOutliers(cluster_id={self.cluster_id}, outliers={n_out}, "
                f"tail_tokens={self.tail_tokens}, size_bytes={self.size_bytes})")


def quantize_cluster_outliers(per_cluster_outlier_tokens, flat_k, flat_v, *, mode="int8", tail_family=None,
                              tail_top_k=0, membership=None):
    """Close E2's I2/G4 storage seam for one birth_and_merge chunk.

    per_cluster_outlier_tokens: the receipt's {cluster_id: {"k": (n_out, n_head, d_head),
        "v": ..., "indices": (n_out,)}}.
    flat_k, flat_v: the whole chunk, (b*t, n_head, d_head) (or (b, t, n_head, d_head)).
    For each cluster: the outliers' K and V go through quantize_kv_cache(mode);
    the tail population, every chunk token not among that cluster's indices
    (or, with membership = the receipt's assignments, only the cluster's own
    non-outlier tokens), goes through fit_sorted_profile(tail_family,
    top_k=tail_top_k) for K and V separately.
    Returns {cluster_id: QuantizedClusterOutliers}.
    """
    if not isinstance(per_cluster_outlier_tokens, dict):
        raise Error("per_cluster_outlier_tokens: expected a dict {cluster_id: {'k', 'v', 'indices'}}, got "
                         f"{type(per_cluster_outlier_tokens).__name__}")
    k, kd, as_torch = _input(flat_k, "flat_k")
    v, vd, _ = _input(flat_v, "flat_v")
    k, v = _flatten_batch(k), _flatten_batch(v)
    norm = {}
    for cid, entry in per_cluster_outlier_tokens.items():
        cid = _int(cid, "per_cluster_outlier_tokens key")
        if not isinstance(entry, dict) or not {"k", "v", "indices"} <= set(entry):
            raise Error(f"per_cluster_outlier_tokens[{cid}]: expected a dict with 'k', 'v' and 'indices'")
        ok, okd, _ = _input(entry["k"], f"per_cluster_outlier_tokens[{cid}].k")
        ov, ovd, _ = _input(entry["v"], f"per_cluster_outlier_tokens[{cid}].v")
        norm[cid] = (ok, okd, ov, ovd, _indices(entry["indices"], f"per_cluster_outlier_tokens[{cid}].indices"))
    member = None
    if membership is not None:
        m = _numpy(membership)
        if m.dtype.kind not in "iu":
            raise Error(f"membership: expected integer cluster ids, got dtype {m.dtype}")
        if m.size and (m.min() < -2 ** 31 or m.max() >= 2 ** 31):
            raise Error("membership: expected cluster ids that fit in int32")
        member = _np.ascontiguousarray(m.astype(_np.int32))
    parts = _kvq.quantize_cluster_outliers(norm, k, kd, v, vd, _mode(mode), _family(tail_family, "tail_family"),
                                           _int(tail_top_k, "tail_top_k"), member)
    out = {}
    for cid, p in parts.items():
        def affine(t):
            return None if t is None else AffineQuantized(_output(t[0], as_torch), t[1], t[2])

        def tail(e):
            return None if e is None else SortedProfileEncoding(e, as_torch)

        out[cid] = QuantizedClusterOutliers(
            p["cluster_id"], affine(p["outlier_k"]), affine(p["outlier_v"]), _output(p["outlier_indices"], as_torch),
            tail(p["tail_k"]), tail(p["tail_v"]), n_head=p["n_head"], d_head=p["d_head"],
            tail_tokens=p["tail_tokens"], size_bytes=p["size_bytes"])
    return out


def dequantize_cluster_outliers(q):
    """Inverse of one cluster's QuantizedClusterOutliers.

    Returns {"outlier_k", "outlier_v", "tail_k", "tail_v"}: the outliers'
    dequantized K/V (n_out, n_head, d_head), and the tails decoded in token
    order as (tail_tokens, n_head, d_head) (flat when the geometry is unknown);
    None where a part is absent.
    """
    if not isinstance(q, QuantizedClusterOutliers):
        raise Error(f"q: expected a QuantizedClusterOutliers, got {type(q).__name__}")

    def tail(e, arg):
        if e is None:
            return None
        if not isinstance(e, SortedProfileEncoding):
            raise Error(f"q.{arg}: expected a SortedProfileEncoding or None, got {type(e).__name__}")
        x = e.decode()
        if q.n_head and q.d_head:
            if e.n % (q.n_head * q.d_head):
                raise Error(f"q.{arg}: expected a multiple of n_head * d_head = {q.n_head * q.d_head} values, "
                                 f"got {e.n}")
            x = x.reshape(-1, q.n_head, q.d_head)
        return x

    return {
        "outlier_k": None if q.outlier_k is None else dequantize_kv_cache(q.outlier_k),
        "outlier_v": None if q.outlier_v is None else dequantize_kv_cache(q.outlier_v),
        "tail_k": tail(q.tail_k, "tail_k"),
        "tail_v": tail(q.tail_v, "tail_v"),
    }


def spearman(a, b):
    """Spearman's rank correlation (average ranks for ties); NaN when a side is constant."""
    x, _, _ = _input(a, "a")
    y, _, _ = _input(b, "b")
    return _kvq.spearman(_np.ascontiguousarray(x.astype(_np.float32).reshape(-1)),
                         _np.ascontiguousarray(y.astype(_np.float32).reshape(-1)))
