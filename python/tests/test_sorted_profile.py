"""G4: fit_sorted_profile (kvq/sorted_profile.py)."""

import numpy as np
import pytest

import kvq


# ---- G4 -----------------------------------------------------------------------

def test_fit_sorted_profile_gaussian_tail_and_head():
    rng = np.random.default_rng(4)
    x = rng.standard_normal(20000).astype(np.float32)
    x[123] = 40.0
    enc = kvq.fit_sorted_profile(x, kvq.GaussianEstimator(), top_k=4)
    assert enc.family == "gaussian" and enc.n == x.size and not enc.fallback and enc.path == "parametric"
    assert enc.ks_statistic < 0.01 and 0 <= enc.p_value <= 1
    assert 123 in enc.head_indices and 40.0 in enc.head_values
    back = enc.decode()
    assert back.shape == x.shape and back[123] == 40.0
    mse = float(np.mean((back - x) ** 2))
    assert mse < 0.012  # 4-bit Lloyd-Max on N(0,1): 0.0095
    blob = enc.serialize()
    assert len(blob) == enc.size_bytes
    again = kvq.SortedProfileEncoding.from_bytes(blob)
    np.testing.assert_array_equal(again.decode(), back)
    with pytest.raises(ValueError, match="truncated"):
        kvq.SortedProfileEncoding.from_bytes(blob[:-1])
    with pytest.raises(ValueError):
        kvq.SortedProfileEncoding.from_bytes(blob[:30] + bytes([blob[30] ^ 1]) + blob[31:])


def test_fit_sorted_profile_falls_back_on_a_misfit():
    x = np.random.default_rng(5).uniform(-1, 1, 50000).astype(np.float32)
    enc = kvq.fit_sorted_profile(x)  # default family: Gaussian
    assert enc.fallback and enc.path == "dense" and "ks gate" in enc.why
    assert enc.ks_statistic > kvq.DEFAULT_KS_MAX
    lap = kvq.fit_sorted_profile(np.random.default_rng(6).laplace(size=50000), kvq.LaplaceEstimator(),
                                 bits=3, codebook="quantile")
    assert not lap.fallback and lap.family == "laplace" and lap.bits == 3 and lap.codebook == "quantile"
    assert kvq.GaussianEstimator().name == "gaussian"
    loc, scale = kvq.GaussianEstimator().fit(np.array([1, 3], np.float32))
    assert (loc, scale) == (2.0, 1.0)
