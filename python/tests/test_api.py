"""The module as a whole: torch in / torch out, every error path, crafted containers, help."""

import numpy as np
import pytest

import kvq
from kvq_test_helpers import _torch_or_skip, note_int8, planted


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
