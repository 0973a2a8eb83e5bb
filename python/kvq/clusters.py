"""E2, the ClusterBank, and I2 part 2: cluster outliers and tails."""

import numpy as _np

from . import _kvq
from ._kvq import Error
from ._util import _contiguous, _input, _output, _numpy, _mode, _int, _float, _indices, _flatten_batch
from .affine import AffineQuantized, dequantize_kv_cache
from .sorted_profile import SortedProfileEncoding, _family


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
