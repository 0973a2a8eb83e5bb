"""E2 and I2 part 2: ClusterBank, cluster outliers and tails, spearman (kvq/clusters.py)."""

import numpy as np
import pytest

import kvq
from kvq_test_helpers import planted


# ---- E2 and I2 part 2 -----------------------------------------------------------



def test_cluster_bank_finds_planted_clusters_and_flags_anomalies():
    k, v, label, A, anomalies = planted()
    bank = kvq.ClusterBank(2, 4, outlier_top_k=2, ridge=1e-3)  # default birth and merge rules
    r = bank.birth_and_merge(k, v)
    assert set(r) >= {"assignments", "per_token_residual", "per_cluster_misfit", "births", "merges",
                      "per_cluster_outlier_tokens"}
    assert r["births"] - r["merges"] == 2 and bank.num_clusters == 2
    # The within-cluster scale is the planted unit variance, in any units.
    assert bank.key_scale == pytest.approx([1.0, 1.0], rel=0.15)
    scaled = kvq.ClusterBank(2, 4, outlier_top_k=2, ridge=1e-3)
    np.testing.assert_array_equal(scaled.birth_and_merge(k * 1e3, v * 1e3)["assignments"], r["assignments"])
    a = r["assignments"]
    assert a.shape == (1200,) and r["per_token_residual"].shape == (1200,)
    for c in range(2):
        assert len(set(a[label == c])) == 1
    flagged = {int(i) for s in r["per_cluster_outlier_tokens"].values() for i in s["indices"]}
    assert set(anomalies) <= flagged
    for cid, s in r["per_cluster_outlier_tokens"].items():
        assert s["k"].shape == (len(s["indices"]), 2, 4)
        np.testing.assert_array_equal(s["k"], k[s["indices"]])
    c0 = int(a[label == 0][0])
    fit = bank.fit(c0, 1)
    assert fit["A"].shape == (4, 4)
    np.testing.assert_allclose(fit["A"], A[0, 1], atol=0.01)
    # A (b, t, H, D) chunk is flattened to b*t tokens.
    r2 = kvq.ClusterBank(2, 4).birth_and_merge(k.reshape(4, 300, 2, 4), v.reshape(4, 300, 2, 4))
    assert r2["assignments"].shape == (1200,)


def test_far_field_matches_exact_attention_for_identical_keys():
    k = np.zeros((100, 1, 4), np.float32)
    k[:60] = [1, 2, 3, 4]
    k[60:] = [-1, 0, 1, 0]
    v = np.random.default_rng(9).standard_normal((100, 1, 4)).astype(np.float32)
    bank = kvq.ClusterBank(1, 4, outlier_top_k=0)
    bank.birth_and_merge(k, v)
    q = np.array([[0.2, -0.1, 0.3, 0.05]], np.float32)
    r = bank.far_field(q)
    s = q[0] @ k[:, 0].T * 0.5
    w = np.exp(s - s.max())
    assert r["log_mass"][0] == pytest.approx(s.max() + np.log(w.sum()), abs=1e-6)
    np.testing.assert_allclose(r["value"][0], (w[:, None] * v[:, 0]).sum(0) / w.sum(), atol=1e-5)
    with pytest.raises(ValueError, match="n_q_heads"):
        kvq.ClusterBank(2, 4).far_field(np.zeros((3, 4), np.float32))
    # The Gaussian closure is exact here too (Sigma = 0); a bad name is kvq.Error.
    g = kvq.ClusterBank(1, 4, outlier_top_k=0, closure="gaussian")
    g.birth_and_merge(k, v)
    assert g.far_field(q)["log_mass"][0] == pytest.approx(r["log_mass"][0], abs=1e-9)
    for bad in ("gauss", 3):
        with pytest.raises(kvq.Error, match="closure"):
            kvq.ClusterBank(1, 4, closure=bad)


def test_quantize_cluster_outliers_round_trip_and_the_seeds_dict_shapes():
    k, v, label, _, _ = planted()
    bank = kvq.ClusterBank(2, 4, outlier_top_k=3)
    r = bank.birth_and_merge(k, v)
    q = kvq.quantize_cluster_outliers(r["per_cluster_outlier_tokens"], k, v)
    assert set(q) == set(r["per_cluster_outlier_tokens"])
    for cid, c in q.items():
        assert isinstance(c, kvq.QuantizedClusterOutliers) and c.cluster_id == cid
        s = r["per_cluster_outlier_tokens"][cid]
        np.testing.assert_array_equal(c.outlier_indices, s["indices"])
        d = kvq.dequantize_cluster_outliers(c)
        assert set(d) == {"outlier_k", "outlier_v", "tail_k", "tail_v"}
        assert np.abs(d["outlier_k"] - s["k"]).max() <= c.outlier_k.scale / 2 * (1 + 1e-6)
        keep = np.setdiff1d(np.arange(1200), s["indices"])
        assert d["tail_k"].shape == (len(keep), 2, 4)
        np.testing.assert_array_equal(d["tail_k"].reshape(-1), kvq.fit_sorted_profile(k[keep]).decode())
        # The serialised KVQC container: 20-byte header, 21-byte geometry, the
        # outliers (13 bytes + u32 indices + codes) and two length-prefixed tails.
        codes = c.outlier_k.size_bytes - 4 + c.outlier_v.size_bytes - 4
        assert c.size_bytes == (20 + 21 + 13 + 4 * len(s["indices"]) + codes
                                + 8 + c.tail_k.size_bytes + 8 + c.tail_v.size_bytes)
    # The note's dict, written by hand with lists; fp8 outliers; membership.
    hand = {5: {"k": k[[1, 2]].tolist(), "v": v[[1, 2]], "indices": [1, 2]},
            9: {"k": np.zeros((0, 2, 4), np.float32), "v": np.zeros((0, 2, 4), np.float32), "indices": []}}
    member = np.where(np.arange(1200) < 600, 5, 9)
    member[[1, 2]] = 5
    qh = kvq.quantize_cluster_outliers(hand, k, v, mode="fp8", tail_family=kvq.LaplaceEstimator(), tail_top_k=2,
                                       membership=member)
    assert qh[5].outlier_k.codes.dtype == np.uint8 and qh[5].tail_tokens == 598
    assert qh[9].outlier_k is None and qh[9].outlier_indices is None and qh[9].tail_tokens == 600
    assert qh[9].tail_k.family == "laplace" and len(qh[9].tail_k.head_indices) == 2
    d9 = kvq.dequantize_cluster_outliers(qh[9])
    assert d9["outlier_k"] is None and d9["tail_v"].shape == (600, 2, 4)


def test_spearman():
    assert kvq.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / np.sqrt(22.5))
    assert np.isnan(kvq.spearman([1, 2, 3], [5, 5, 5]))
