"""pytest suite of the kvq Python module (run by ctest as python_test)."""

import os

import numpy as np
import pytest

import kvq


def _torch_or_skip():
    try:
        import torch  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true" or os.environ.get("KVQ_REQUIRE_DATA") == "1":
            pytest.fail("torch (python3-torch) is required in CI: scripts/install_deps.sh installs it "
                        "when KVQ_WITH_TORCH=1")
        pytest.skip("torch is not installed (apt install python3-torch)")
    return torch


def note_int8(x):
    """The seed note's formula in plain numpy (float32 throughout)."""
    x = np.asarray(x, dtype=np.float32)
    scale = np.float32(np.abs(x).max()) / np.float32(127)
    if scale == 0:
        return np.zeros(x.shape, np.int8), np.float32(0)
    codes = np.clip(np.round(x / scale), -127, 127).astype(np.int8)  # np.round: half to even
    return codes, scale


def e4m3_table():
    """All 256 E4M3FN codes decoded in numpy (NaN for S.1111.111)."""
    c = np.arange(256)
    s = np.where(c >> 7, -1.0, 1.0)
    e = (c >> 3) & 15
    m = c & 7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    v = s * v
    v[(e == 15) & (m == 7)] = np.nan
    return v


# ---- I2 part 1 ----------------------------------------------------------------

def test_int8_matches_the_notes_formula_including_ties():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 4, 32)) * 3).astype(np.float32)
    x[0, 0, 0] = 17.25
    q = kvq.quantize_kv_cache(x)
    codes, scale = note_int8(x)
    assert q.mode == "int8" and q.codes.dtype == np.int8 and q.codes.shape == x.shape
    assert np.float32(q.scale) == scale
    np.testing.assert_array_equal(q.codes, codes)
    # Exact ties at scale 1: half to even, both signs.
    t = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5], np.float32)
    qt = kvq.quantize_kv_cache(t)
    assert qt.scale == 1.0
    np.testing.assert_array_equal(qt.codes, [127, 0, 2, 2, 0, -2, -2, 126, -126])
    np.testing.assert_array_equal(qt.codes, note_int8(t)[0])


def test_int8_round_trip_bound_and_float16_input():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((33, 7)).astype(np.float16)
    q = kvq.quantize_kv_cache(x)
    back = kvq.dequantize_kv_cache(q)
    assert back.dtype == np.float32 and back.shape == x.shape
    assert np.abs(back - x.astype(np.float32)).max() <= q.scale / 2 * (1 + 1e-6)
    np.testing.assert_array_equal(back, q.codes.astype(np.float32) * np.float32(q.scale))


def test_zero_and_empty_inputs():
    z = kvq.quantize_kv_cache(np.zeros((3, 4), np.float32))
    assert z.scale == 0.0 and not z.codes.any()
    assert not np.isnan(kvq.dequantize_kv_cache(z)).any()
    e = kvq.quantize_kv_cache(np.zeros((0, 4), np.float32))
    assert kvq.dequantize_kv_cache(e).shape == (0, 4)


def test_fp8_codes_are_uint8_and_round_to_the_nearest_e4m3_value():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(4096) * np.exp(rng.uniform(-8, 6, 4096))).astype(np.float32)
    q = kvq.quantize_kv_cache(x, mode="fp8")
    assert q.mode == "fp8" and q.codes.dtype == np.uint8 and q.scale == 1.0
    table = e4m3_table()
    dec = table[q.codes]
    np.testing.assert_array_equal(kvq.dequantize_kv_cache(q), dec.astype(np.float32))
    finite = np.sort(table[np.isfinite(table)])
    clipped = np.clip(x.astype(np.float64), -448, 448)
    best = np.abs(finite[None, :] - clipped[:, None]).min(axis=1)
    np.testing.assert_array_equal(np.abs(dec - clipped), best)  # nearest representable (ties: equal distance)


def test_quantization_error_per_token():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((10, 2, 8)).astype(np.float32)
    for mode in ("int8", "fp8"):
        err = kvq.quantization_error_per_token(x, mode=mode)
        back = kvq.dequantize_kv_cache(kvq.quantize_kv_cache(x, mode=mode))
        np.testing.assert_allclose(err, np.abs(back - x).reshape(10, -1).mean(axis=1), rtol=1e-6)


def test_array_likes_and_non_contiguous_inputs():
    x = np.arange(48, dtype=np.float64).reshape(6, 8)
    q_list = kvq.quantize_kv_cache(x.tolist())
    q_t = kvq.quantize_kv_cache(x.T)  # non-contiguous: copied
    np.testing.assert_array_equal(q_t.codes, note_int8(x.T)[0])
    np.testing.assert_array_equal(q_list.codes, note_int8(x)[0])
    q_i = kvq.quantize_kv_cache(np.arange(10))  # integers are converted to float32
    assert q_i.codes[-1] == 127


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


# ---- E2 and I2 part 2 -----------------------------------------------------------

def planted(T=1200, H=2, D=4, C=2, seed=7):
    rng = np.random.default_rng(seed)
    mu_k = rng.standard_normal((C, H, D)) * 8
    mu_v = rng.standard_normal((C, H, D))
    A = rng.standard_normal((C, H, D, D)) / np.sqrt(D)
    label = rng.integers(0, C, T)
    k = mu_k[label] + rng.standard_normal((T, H, D))
    v = mu_v[label] + np.einsum("thij,thj->thi", A[label], k - mu_k[label]) + 0.01 * rng.standard_normal((T, H, D))
    anomalies = [int(np.flatnonzero(label == c)[10]) for c in range(C)]
    v[anomalies] += 6.0
    return k.astype(np.float32), v.astype(np.float32), label, A, anomalies


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


# ---- torch -------------------------------------------------------------------------

def test_torch_in_torch_out():
    torch = _torch_or_skip()
    x = torch.randn(16, 2, 8)
    q = kvq.quantize_kv_cache(x)
    assert isinstance(q.codes, torch.Tensor) and q.codes.dtype == torch.int8
    np.testing.assert_array_equal(q.codes.numpy(), kvq.quantize_kv_cache(x.numpy()).codes)
    back = kvq.dequantize_kv_cache(q)
    assert isinstance(back, torch.Tensor) and back.dtype == torch.float32 and back.shape == x.shape
    f = kvq.quantize_kv_cache(x, mode="fp8")
    assert f.codes.dtype == torch.uint8
    assert isinstance(kvq.quantization_error_per_token(x), torch.Tensor)
    bf = x.to(torch.bfloat16)
    qb = kvq.quantize_kv_cache(bf)
    np.testing.assert_array_equal(qb.codes.numpy(), note_int8(bf.to(torch.float32).numpy())[0])
    assert isinstance(qb.codes, torch.Tensor)
    h = kvq.quantize_kv_cache(x.half().t() if x.dim() == 2 else x.half().transpose(0, 1))  # non-contiguous fp16
    assert h.codes.shape == (2, 16, 8)
    enc = kvq.fit_sorted_profile(torch.randn(5000), top_k=3)
    assert isinstance(enc.decode(), torch.Tensor) and isinstance(enc.head_indices, torch.Tensor)
    k, v, _, _, _ = planted()
    r = kvq.ClusterBank(2, 4, birth_distance=0.5).birth_and_merge(torch.from_numpy(k), torch.from_numpy(v))
    assert isinstance(r["assignments"], torch.Tensor)
    for s in r["per_cluster_outlier_tokens"].values():
        assert isinstance(s["k"], torch.Tensor) and isinstance(s["indices"], torch.Tensor)
    q = kvq.quantize_cluster_outliers(r["per_cluster_outlier_tokens"], torch.from_numpy(k), torch.from_numpy(v))
    c = next(iter(q.values()))
    assert isinstance(c.outlier_k.codes, torch.Tensor) and isinstance(c.outlier_indices, torch.Tensor)
    d = kvq.dequantize_cluster_outliers(c)
    assert isinstance(d["outlier_k"], torch.Tensor) and isinstance(d["tail_k"], torch.Tensor)
    with pytest.raises(ValueError, match="finite"):
        kvq.quantize_kv_cache(torch.tensor([1.0, float("inf")]))


# ---- errors ------------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: kvq.quantize_kv_cache(np.array([1.0, np.nan, 2.0])), "x: expected finite values.*index 1"),
    (lambda: kvq.quantize_kv_cache(np.ones(3), mode="int4"), "mode: expected 'int8' or 'fp8'"),
    (lambda: kvq.quantize_kv_cache(np.ones(3, complex)), "expected a real-valued array"),
    (lambda: kvq.quantize_kv_cache("abc"), "expected a real-valued array"),
    (lambda: kvq.quantize_kv_cache(np.float32(3.0)), "rank"),
    (lambda: kvq.dequantize_kv_cache(kvq.AffineQuantized(np.zeros(3, np.uint8), 1.0, "int8")), "q.codes: expected int8"),
    (lambda: kvq.dequantize_kv_cache(kvq.AffineQuantized(np.zeros(3, np.int8), float("nan"), "int8")), "q.scale"),
    (lambda: kvq.dequantize_kv_cache(kvq.AffineQuantized(np.zeros(3, np.uint8), 2.0, "fp8")), "q.scale"),
    (lambda: kvq.dequantize_kv_cache("not quantized"), "q: expected an AffineQuantized"),
    (lambda: kvq.AffineQuantized(np.zeros(3, np.int8), 1.0, "int3"), "mode"),
    (lambda: kvq.fit_sorted_profile(np.ones(10), bits=9), "bits"),
    (lambda: kvq.fit_sorted_profile(np.ones(10), top_k=-1), "top_k"),
    (lambda: kvq.fit_sorted_profile(np.ones(10), codebook="best"), "codebook"),
    (lambda: kvq.fit_sorted_profile(np.ones(10), ks_max=2.0), "ks_max"),
    (lambda: kvq.fit_sorted_profile(np.ones(10), family="gaussian"), "family"),
    (lambda: kvq.fit_sorted_profile(np.array([0.0, np.inf])), "finite"),
    (lambda: kvq.ClusterBank(0, 4), "n_head"),
    (lambda: kvq.ClusterBank(2, 4, max_clusters=0), "max_clusters"),
    (lambda: kvq.ClusterBank(2, 4, ridge=-1.0), "ridge"),
    (lambda: kvq.ClusterBank(2, 4, outlier_top_k=1.5), "outlier_top_k: expected an integer"),
    (lambda: kvq.ClusterBank(2, 4).birth_and_merge(np.ones((5, 2, 3)), np.ones((5, 2, 3))), "chunk_k: expected shape"),
    (lambda: kvq.ClusterBank(2, 4).birth_and_merge(np.ones((5, 2, 4)), np.ones((4, 2, 4))), "chunk_v"),
    (lambda: kvq.ClusterBank(2, 4).birth_and_merge(np.ones((0, 2, 4)), np.ones((0, 2, 4))), "T >= 1"),
    (lambda: kvq.ClusterBank(2, 4).fit(3, 0), "no live cluster 3"),
    (lambda: kvq.quantize_cluster_outliers([], np.ones((4, 2, 4)), np.ones((4, 2, 4))), "expected a dict"),
    (lambda: kvq.quantize_cluster_outliers({0: {"k": np.ones((1, 2, 4))}}, np.ones((4, 2, 4)), np.ones((4, 2, 4))),
     "expected a dict with 'k', 'v' and 'indices'"),
    (lambda: kvq.quantize_cluster_outliers({0: {"k": np.ones((1, 2, 4)), "v": np.ones((1, 2, 4)), "indices": [7]}},
                                           np.ones((4, 2, 4)), np.ones((4, 2, 4))), r"indices: expected positions in \[0, 4\)"),
    (lambda: kvq.quantize_cluster_outliers({0: {"k": np.ones((1, 2, 4)), "v": np.ones((1, 2, 4)), "indices": [0.5]}},
                                           np.ones((4, 2, 4)), np.ones((4, 2, 4))), "integer token positions"),
    (lambda: kvq.quantize_cluster_outliers({0: {"k": np.ones((2, 2, 4)), "v": np.ones((2, 2, 4)), "indices": [0]}},
                                           np.ones((4, 2, 4)), np.ones((4, 2, 4))), r"\[0\].k: expected shape \(1, 2, 4\)"),
    (lambda: kvq.quantize_cluster_outliers({}, np.ones((4, 2, 4)), np.ones((4, 2, 4)), membership=[0.5] * 4),
     "membership: expected integer"),
    (lambda: kvq.quantize_cluster_outliers({}, np.ones((4, 2, 4)), np.ones((4, 2, 4)), membership=[0] * 3),
     "membership: expected 4 cluster ids"),
    (lambda: kvq.quantize_cluster_outliers({}, np.ones((4, 2, 4)), np.ones((4, 2, 4)), tail_top_k=-2), "tail_top_k"),
    (lambda: kvq.dequantize_cluster_outliers({}), "q: expected a QuantizedClusterOutliers"),
    (lambda: kvq.spearman([1, 2, 3], [1, 2]), "b: expected 3 values"),
    # Every class of bad input is kvq.Error (issue 19: these were a plain
    # ValueError, a TypeError with a signature dump or a RuntimeError).
    (lambda: kvq.quantize_kv_cache(np.ones(4, np.complex64)), "real-valued"),
    (lambda: kvq.quantize_kv_cache(np.ones(4, bool)), "real-valued"),
    (lambda: kvq.quantize_kv_cache(np.array([object(), 1])), "real-valued"),
    (lambda: kvq.quantize_kv_cache(np.ones(4), mode="int4"), "mode: expected 'int8' or 'fp8'"),
    (lambda: kvq.fit_sorted_profile(np.ones(9), bits=True), "bits: expected an integer"),
    (lambda: kvq.fit_sorted_profile(np.ones(9), top_k=2 ** 31), r"top_k: expected an integer in"),
    (lambda: kvq.fit_sorted_profile(np.ones(9), family="cauchy"), "family: expected"),
    (lambda: kvq.fit_sorted_profile(np.ones(9), ks_max="high"), "ks_max: expected a number"),
    (lambda: kvq.fit_sorted_profile(np.ones(9), codebook=3), "codebook: expected a string"),
    (lambda: kvq.ClusterBank(2 ** 31, 4), "n_head: expected an integer in"),
    (lambda: kvq.ClusterBank(2, 4, ridge=None), "ridge: expected a number"),
    (lambda: kvq.quantize_cluster_outliers([1, 2], np.ones((4, 2, 4)), np.ones((4, 2, 4))), "expected a dict"),
    (lambda: kvq.quantize_cluster_outliers({2 ** 31: {"k": np.ones((1, 2, 4)), "v": np.ones((1, 2, 4)),
                                                      "indices": [0]}}, np.ones((4, 2, 4)), np.ones((4, 2, 4))),
     "key: expected an integer in"),
    (lambda: kvq.SortedProfileEncoding.from_bytes("KVQP"), "data: expected bytes"),
    (lambda: kvq.GaussianEstimator().fit(np.array([np.nan, 1], np.float32)), "finite"),
])
def test_bad_input_raises_kvq_error(call, match):
    with pytest.raises(kvq.Error, match=match):
        call()
    assert issubclass(kvq.Error, ValueError)


def _crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def test_crafted_containers_are_rejected_not_crashed():
    # A valid-CRC KVQP claiming a constant tail of 2^63 - 1 values decoded
    # to a segfault; it is now rejected before anything is allocated.
    import struct
    enc = kvq.fit_sorted_profile(np.full(50, -2.0, np.float32))
    assert enc.path == "constant"
    b = bytearray(enc.serialize())
    name_len = struct.unpack_from("<H", b, 24)[0]
    for n in (2 ** 63 - 1, 2 ** 28 + 1):
        struct.pack_into("<q", b, 26 + name_len, n)
        struct.pack_into("<I", b, 16, _crc32c(bytes(b[20:])))
        with pytest.raises(kvq.Error, match="kMaxProfileValues"):
            kvq.SortedProfileEncoding.from_bytes(bytes(b)).decode()


def test_help_is_useful():
    assert "quantize_kv_cache" in kvq.__doc__
    for name in kvq.__all__:
        obj = getattr(kvq, name)
        if callable(obj):
            assert obj.__doc__ and len(obj.__doc__.strip()) > 20, name


def test_spearman():
    assert kvq.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / np.sqrt(22.5))
    assert np.isnan(kvq.spearman([1, 2, 3], [5, 5, 5]))


# ---- the KV cache and decode attention ------------------------------------------

def _softmax_attention(q, k, v, scale):
    """NumPy reference: q (H, D), k/v (T, Hkv, D) -> (H, D), GQA by h // (H // Hkv)."""
    H, D = q.shape
    g = H // k.shape[1]
    out = np.empty((H, D))
    for h in range(H):
        s = (k[:, h // g, :].astype(np.float64) @ q[h].astype(np.float64)) * scale
        w = np.exp(s - s.max())
        out[h] = (w[:, None] * v[:, h // g, :]).sum(0) / w.sum()
    return out


@pytest.mark.parametrize("scheme", kvq.kv_schemes(2, 32).keys())
def test_kv_cache_attention_matches_numpy_over_the_decoded_cache(scheme):
    rng = np.random.default_rng(5)
    L, T, Hkv, D, H = 2, 41, 2, 32, 4
    cache = kvq.KvCache(scheme, L, 64, Hkv, D)
    assert cache.scheme == scheme
    k = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    cache.write_many(1, 0, k[:30], v[:30])          # batched
    for t in range(30, T):                           # token by token, flat rows
        cache.write(1, t, k[t].reshape(-1), v[t])
    cache.write_many(0, 0, k[:10], v[:10])
    assert cache.bits(10) == kvq.kv_schemes(Hkv, D)[scheme]
    assert cache.bytes(10) == 10 * 2 * L * Hkv * D * cache.bits(10) / 8
    dk = np.stack([cache.read(1, t)[0] for t in range(T)])
    dv = np.stack([cache.read(1, t)[1] for t in range(T)])
    if scheme == "fp32":
        np.testing.assert_array_equal(dk, k)
    q = rng.standard_normal((H, D)).astype(np.float32)
    for tokens in (1, 17, T):
        got = kvq.decode_attention(q, cache, 1, tokens)
        want = _softmax_attention(q, dk[:tokens], dv[:tokens], 1 / np.sqrt(D))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    # int8_query is the inexact, ggml-like mode: within its stated bound, loosely.
    loose = kvq.decode_attention(q, cache, 1, T, int8_query=True, scale=0.2)
    np.testing.assert_allclose(loose, _softmax_attention(q, dk, dv, 0.2), atol=0.05)


def test_kv_cache_torch_in_torch_out_and_errors():
    torch = _torch_or_skip()
    cache = kvq.KvCache("int8", 1, 8, 2, 16)
    k = torch.randn(4, 2, 16)
    cache.write_many(0, 0, k, k.to(torch.bfloat16))
    out = kvq.decode_attention(torch.randn(2, 16), cache, 0, 4)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 16)
    bad = [
        (lambda: kvq.KvCache("int3", 1, 8, 2, 16), "int3"),
        (lambda: kvq.KvCache("q4_0", 1, 8, 1, 16), "multiple of 32"),
        (lambda: kvq.KvCache("int8", 1, 8, 2, 2 ** 31), "head_dim: expected an integer in"),
        (lambda: cache.write(1, 0, np.ones(32), np.ones(32)), "layer"),
        (lambda: cache.write(0, 8, np.ones(32), np.ones(32)), "pos"),
        (lambda: cache.write(0, 0, np.ones(31), np.ones(32)), "k: expected 32 values"),
        (lambda: cache.write(0, 0, np.full(32, np.nan), np.ones(32)), "finite"),
        (lambda: cache.write_many(0, 6, np.ones((3, 32)), np.ones((3, 32))), "max_seq"),
        (lambda: kvq.decode_attention(np.ones((3, 16)), cache, 0, 4), "n_heads"),
        (lambda: kvq.decode_attention(np.ones((2, 8)), cache, 0, 4), r"q: expected shape \(n_heads, 16\)"),
        (lambda: kvq.decode_attention(np.ones((2, 16)), cache, 0, 9), "tokens"),
        (lambda: cache.write(0, 6, np.ones(32), np.ones(32)), "in order"),
        (lambda: kvq.decode_attention(np.ones((2, 16)), "cache", 0, 4), "expected a kvq.KvCache"),
        (lambda: kvq.decode_attention(np.ones((2, 16)), cache, 0, 4, int8_query=1), "int8_query"),
    ]
    for call, match in bad:
        with pytest.raises(kvq.Error, match=match):
            call()


def test_kv_schemes_lists_every_scheme_with_honest_bits():
    s = kvq.kv_schemes()
    assert list(s)[:3] == ["fp32", "fp16", "bf16"] and s["q4_0"] == 4.5 and s["q8_0"] == 8.5
    assert s["int8"] == 8 + 32 / (8 * 128)           # one float32 scale per token row
    assert s["int8-head"] == 8 + 32 / 128            # one per head
    small = kvq.kv_schemes(1, 16)                    # rows of 16 values hold no 32-value block
    assert "q4_0" not in small and "int8" in small
    with pytest.raises(kvq.Error, match="n_kv_heads"):
        kvq.kv_schemes(0, 16)


# ---- grouped low-bit caches -------------------------------------------------


def _rope(x, pos, head_dim):
    """llama2.c's RoPE (pairs (2p, 2p + 1), angle pos * 10000^(-2p / head_dim)) in float32."""
    x = np.array(x, np.float32).reshape(-1, head_dim)
    i = np.arange(0, head_dim, 2, dtype=np.float32)
    ang = np.float32(pos) * (np.float32(1.0) / np.power(np.float32(10000.0), i / np.float32(head_dim)))
    c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    x0, x1 = x[:, 0::2].copy(), x[:, 1::2].copy()
    x[:, 0::2], x[:, 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
    return x


@pytest.mark.parametrize("scheme", ["k4v3g32", "k2v2g16r5s2", "k3v3g16o8x4", "k4v3g32o8r16"])
def test_one_cache_type_takes_grouped_names_and_matches_numpy(scheme):
    rng = np.random.default_rng(5)
    H, hd, nq, N = 2, 16, 8, 90
    c = kvq.KvCache(scheme, 1, N, H, hd)
    assert c.scheme == scheme and kvq.kv_scheme_info(scheme)["family"] == "groups"
    k = rng.standard_normal((N, H, hd)).astype(np.float32)
    v = rng.standard_normal((N, H, hd)).astype(np.float32)
    q = rng.standard_normal((nq, hd)).astype(np.float32)
    for T in (1, 40, N):  # a grouped cache is read at its current length
        c.write_many(0, c.written(0), k[c.written(0):T], v[c.written(0):T])
        assert c.written(0) == T and c.tokens == T
        kk = np.stack([c.read(0, t)[0] for t in range(T)])
        vv = np.stack([c.read(0, t)[1] for t in range(T)])
        ref = np.empty_like(q)
        for h in range(nq):
            s_ = kk[:, h // (nq // H)] @ q[h] / np.sqrt(hd)
            p = np.exp(s_ - s_.max())
            ref[h] = (p / p.sum()) @ vv[:, h // (nq // H)]
        # the fused kernel: within its fixed-point error (kvq/grouped_kv.h; bounds in grouped_kv_test)
        np.testing.assert_allclose(kvq.decode_attention(q, c, 0), ref, atol=0.02)
        np.testing.assert_allclose(c.attend(q, 0, reference=True), ref, atol=2e-5)
    # a token in a coded group decodes near its value (K after RoPE as written)
    t = 3 if "s2" not in c.scheme else 5
    kr, vr = c.read(0, t)
    np.testing.assert_allclose(kr, k[t], atol=1.5)
    np.testing.assert_allclose(vr, v[t], atol=1.5)
    assert 0 < c.bits() < 16 and c.bytes() > 0
    with pytest.raises(kvq.Error, match="current length"):
        kvq.decode_attention(q, c, 0, N - 1)
    assert set(kvq.grouped_kv_presets()) == {"kvq-6.5", "kvq-4.5", "kvq-3.5", "kvq-2.5"}
    names = kvq.all_kv_scheme_names()
    assert names[:len(kvq.kv_schemes())] == list(kvq.kv_schemes()) and names[-4:] == list(kvq.grouped_kv_presets())


@pytest.mark.parametrize("scheme", ["fp16", "q4_0", "int8-head", "k3v2g16r5s2", "k2v2g16p8mo4w4r3", "kvq-4.5",
                                    "kvq-2.5", "k4v3c"])
def test_saved_caches_restore_bitwise_and_continue(scheme, tmp_path):
    rng = np.random.default_rng(9)
    L, H, hd, N = 2, 2, 32, 70
    ks = [rng.standard_normal((64, H * hd)).astype(np.float32) for _ in range(L)]
    r = kvq.static_ranges_from_samples(ks, ks, H, hd, k_weight=np.ones(L * H * hd, np.float32))
    c = kvq.KvCache(scheme, L, 128, H, hd, r)
    k = rng.standard_normal((N, H, hd)).astype(np.float32)
    v = rng.standard_normal((N, H, hd)).astype(np.float32)
    for layer in range(L):
        c.write_many(layer, 0, k[:50], v[:50])
    fp = bytes(range(32))
    data = c.to_bytes(model_fingerprint=fp)
    assert len(data) <= c.bytes() + 4096 and len(data) > c.bytes()
    d = kvq.KvCache.from_bytes(data, model_fingerprint=fp, max_seq=128)
    assert d.scheme == c.scheme and d.tokens == 50 and d.bytes() == c.bytes() and d.max_seq == 128
    assert d.model_fingerprint == fp and d.tokens_digest is None
    q = rng.standard_normal((4, hd)).astype(np.float32)
    for T in range(50, N):  # bitwise alike now and after every further write
        for layer in range(L):
            np.testing.assert_array_equal(kvq.decode_attention(q, c, layer), kvq.decode_attention(q, d, layer))
            c.write(layer, T, k[T], v[T])
            d.write(layer, T, k[T], v[T])
    assert c.to_bytes(model_fingerprint=fp) == d.to_bytes(model_fingerprint=fp)
    path = tmp_path / "cache.kvqs"
    c.save(str(path), tokens_digest=fp[::-1])
    e = kvq.KvCache.load(str(path))
    assert os.path.getsize(path) == len(c.to_bytes(tokens_digest=fp[::-1])) and e.tokens_digest == fp[::-1]
    np.testing.assert_array_equal(kvq.decode_attention(q, c, 1), kvq.decode_attention(q, e, 1))
    assert e.max_seq == N  # the tokens held: full
    with pytest.raises(kvq.Error, match="max_seq"):
        e.write(0, N, k[0], v[0])
    with pytest.raises(kvq.Error, match="max_seq"):
        kvq.KvCache.load(str(path), max_seq=N - 1)
    # Every corruption is a clear error.
    with pytest.raises(kvq.Error, match="fingerprint"):
        kvq.KvCache.from_bytes(data, model_fingerprint=bytes(32))
    with pytest.raises(kvq.Error, match="CRC|checksum"):
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 1
        kvq.KvCache.from_bytes(bytes(bad))
    with pytest.raises(kvq.Error, match="truncated|size|short"):
        kvq.KvCache.from_bytes(data[:-5])
    with pytest.raises(kvq.Error, match="magic"):
        kvq.KvCache.from_bytes(b"XXXX" + data[4:])
    with pytest.raises(kvq.Error, match="bytes"):
        kvq.KvCache.from_bytes("not bytes")


def test_grouped_cache_calibrated_and_allocated_need_ranges_and_errors():
    rng = np.random.default_rng(2)
    H, hd = 2, 8
    ks = [rng.standard_normal((50, H * hd)).astype(np.float32)]
    vs = [rng.standard_normal((50, H * hd)).astype(np.float32)]
    r = kvq.static_ranges_from_samples(ks, vs, H, hd, k_weight=np.arange(1, 17, dtype=np.float32))
    assert r.samples == 50 and r.k_lo.shape == (16,) and np.all(r.k_lo <= r.k_hi)
    for scheme in ("k4v3c", "k3av2g16", "k2v2g16p8o4x2"):
        with pytest.raises(kvq.Error, match="ranges"):
            kvq.KvCache(scheme, 1, 32, H, hd)
        c = kvq.KvCache(scheme, 1, 32, H, hd, r)
        c.write_many(0, 0, ks[0][:32], vs[0][:32])
        q = rng.standard_normal((4, hd)).astype(np.float32)
        np.testing.assert_allclose(c.attend(q, 0), c.attend(q, 0, reference=True), atol=0.02)
    c = kvq.KvCache("k4v4g16", 1, 32, H, hd)
    for bad, match in [(lambda: kvq.KvCache("k4v4g24", 1, 32, H, hd), "multiple of 16"),
                       (lambda: kvq.KvCache("int3", 1, 32, H, hd), "grouped schemes k<bits>"),
                       (lambda: kvq.KvCache("int3", 1, 32, H, hd), "kvq-4.5"),
                       (lambda: kvq.KvCache("k4v4g16", 1, 32, H, 7), "head_dim"),
                       (lambda: kvq.KvCache("k4v4g16", 1, 32, H, hd, ranges=3), "ranges"),
                       (lambda: kvq.KvCache("k4v4g16", 1, 32, H, hd, rope_theta=-1), "theta"),
                       (lambda: c.write(0, 1, np.zeros(16), np.zeros(16)), "in order"),
                       (lambda: c.write(0, 0, np.full(16, np.nan), np.zeros(16)), "fp16 range"),
                       (lambda: c.write(0, 0, np.zeros(15), np.zeros(16)), "k:"),
                       (lambda: c.attend(np.zeros((4, hd), np.float32), 0), "no tokens"),
                       (lambda: c.read(0, 0), "read"),
                       (lambda: c.to_bytes(model_fingerprint=b"short"), "32 bytes"),
                       (lambda: kvq.static_ranges_from_samples(ks, vs, H, hd, clip=0.5), "clip"),
                       (lambda: kvq.static_ranges_from_samples(ks, [], H, hd), "layers")]:
        with pytest.raises(kvq.Error, match=match):
            bad()


def test_resident_memory_is_the_bytes_reported():
    """A filled cache's resident set growth is bytes() within 5% + 1 MiB (scripts/resident_memory.py,
    a fresh interpreter per scheme): every preset, and the row caches as the reference."""
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "resident_memory.py")
    p = subprocess.run([sys.executable, script, "--check", "--layers", "2", "--tokens", "8192", "--heads", "8",
                        "kvq-6.5", "kvq-4.5", "kvq-3.5", "kvq-2.5", "k3v3g32o8x3r4", "fp16", "q4_0"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("| kvq-") == 4


def test_restored_cache_resident_memory_is_the_bytes_reported():
    """A cache restored from the prefix store holds what bytes() reports, within 5% + 1 MiB: the
    chunks a restore fetched (as large as the cache) do not stay resident beside it."""
    import subprocess
    import sys
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "resident_memory.py")
    p = subprocess.run([sys.executable, script, "--check", "--restored", "--layers", "2", "--tokens", "8192",
                        "--heads", "8", "kvq-4.5", "kvq-2.5", "q4_0"], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("| kvq-") == 2


# ---- SIMD targets ------------------------------------------------------------------

def test_simd_targets_select_the_dispatched_target_and_refuse_unknown_names():
    targets = kvq.supported_simd_targets()
    assert targets and kvq.simd_target() == targets[0]
    try:
        kvq.set_simd_targets(targets[-1].lower())
        assert kvq.simd_target() == targets[-1]
        assert kvq.supported_simd_targets() == targets[-1:]
        cache = kvq.KvCache("k4v3g16", 1, 32, 1, 16)
        for t in range(32):
            cache.write(0, t, np.full(16, 0.5, np.float32), np.full(16, 0.25, np.float32))
        out = np.asarray(cache.attend(np.ones((1, 16), np.float32), 0))
        assert abs(float(out.reshape(-1)[3]) - 0.25) < 1e-2
        with pytest.raises(ValueError, match="unknown SIMD target 'AVX9'"):
            kvq.set_simd_targets("AVX9")
        assert kvq.simd_target() == targets[-1]
    finally:
        kvq.set_simd_targets("")
    assert kvq.simd_target() == targets[0]
