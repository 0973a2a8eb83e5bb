"""The compressed prefix store (store/prefix_store.h)."""

import numpy as _np

from . import _kvq
from ._kvq import Error
from ._util import _lock_of, _locked, _is_torch, _int, _str, _float
from .cache import KvCache


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
