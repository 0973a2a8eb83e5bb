"""kvq.KvCache and decode_attention for every scheme, saved caches, SIMD targets (kvq/cache.py)."""

import os

import numpy as np
import pytest

import kvq
from kvq_test_helpers import _torch_or_skip


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
    # a preset resolves per head size, as a cache of that head size holds it
    assert kvq.grouped_kv_presets(64)["kvq-2.5"] == "k2v2g96p8mo3w4r3" != kvq.grouped_kv_presets(8)["kvq-2.5"]
    assert kvq.grouped_kv_presets(64)["kvq-4.5"] == kvq.grouped_kv_presets()["kvq-4.5"]
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


def test_t0_schemes_read_layer0_through_the_models_token_table():
    """t0+<scheme> holds layer 0 as token ids (src/cache/token_family.cc): through kvq.Model it
    decodes as the inner scheme with layer 0 exact; a bare KvCache has no model table to read."""
    from kvq_test_helpers import MODEL, need_data
    with pytest.raises(ValueError, match="token table"):
        kvq.KvCache("t0+q8_0", 2, 64, 2, 32)
    with pytest.raises(ValueError, match="already holds layer 0"):
        kvq.kv_scheme_info("t0+t0+q8_0")
    info = kvq.kv_scheme_info("t0+kvq-4.5")
    assert info["family"] == "tokens" and info["label"] == "t0+kvq-4.5" and info["needs_ranges"]
    need_data()
    m = kvq.Model(str(MODEL))
    ids = [1] + [(7 * i * i + 3 * i + 40) % 500 + 3 for i in range(60)]  # any tokens: layer 0 depends on the id alone
    ref = m.logits(ids, kv="fp32")
    t0 = m.logits(ids, kv="t0+fp32")
    assert np.abs(t0 - ref).max() < 0.05  # layer 0's K and V in fp16, the rest fp32
    assert (t0.argmax(1) == ref.argmax(1)).all()
    t0q8 = m.logits(ids, kv="t0+q8_0")
    assert np.isfinite(t0q8).all() and t0q8.shape == ref.shape
    assert (t0q8.argmax(1) == ref.argmax(1)).mean() > 0.9
