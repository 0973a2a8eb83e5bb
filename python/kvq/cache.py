"""kvq's KV cache, one type for every scheme, and fused decode attention (kvq/kv_cache.h)."""

import numpy as _np

from . import _kvq
from ._kvq import Error
from ._util import _lock_of, _locked, _locked_property, _contiguous, _output, _int, _str, _float, _f32


# ---- the KV cache and decode attention --------------------------------------------

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


# ---- grouped low-bit schemes ------------------------------------------------------------


def grouped_kv_presets(head_dim=0):
    """{preset name: scheme name} of the grouped low-bit presets, as a cache of heads of `head_dim`
    channels resolves them (a preset may resolve per head size; 0: the smallest heads')."""
    return dict(_kvq.grouped_kv_presets(int(head_dim)))


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
