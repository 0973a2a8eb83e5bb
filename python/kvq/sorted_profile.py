"""G4: the sorted-profile (parametric tail) quantizer (kvq/sorted_profile.h)."""

from . import _kvq
from ._kvq import Error
from ._kvq import Estimator, GaussianEstimator
from ._util import _input, _output, _int, _str, _float

DEFAULT_KS_MAX = _kvq.DEFAULT_KS_MAX
"""Default KS gate of fit_sorted_profile (an effect size, see SortedProfileEncoding)."""


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
