"""kvq.PrefixStore: put / longest_prefix on memory, directory and a real redis-server,
exact restores, warnings for bad entries and a dead server, bad arguments."""
import os
import sys
from pathlib import Path
import warnings

import numpy as np
import pytest

import kvq

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from loopback import free_port, start_redis  # noqa: E402

L, H, HD = 2, 2, 16


def _ranges():
    rng = np.random.default_rng(3)
    ks = [rng.standard_normal((64, H * HD)).astype(np.float32) for _ in range(L)]
    return kvq.static_ranges_from_samples(ks, ks, H, HD, k_weight=np.ones(L * H * HD, np.float32))


RANGES = _ranges()


def _cache(scheme):
    return kvq.KvCache(scheme, L, 1024, H, HD, RANGES if kvq.kv_scheme_info(scheme)["needs_ranges"] else None)


def _fill(store, scheme, tokens, upto, seed=0):
    """A cache of tokens[:upto], put as each chunk fills; its to_bytes at every length."""
    rng = np.random.default_rng(seed)
    c = _cache(scheme)
    snaps = {}
    for p in range(upto):
        for layer in range(L):
            c.write(layer, p, rng.standard_normal(H * HD).astype(np.float32),
                    rng.standard_normal(H * HD).astype(np.float32))
        store.put(tokens, c)
        snaps[p + 1] = c.to_bytes()
    return c, snaps


@pytest.mark.parametrize("scheme", ["q8_0", "fp16", "kvq-4.5", "kvq-2.5"])
def test_restores_the_longest_stored_prefix_exactly(scheme):
    s = kvq.PrefixStore(f"memory:py-{scheme}", chunk_tokens=40)
    e0, e1, e2 = s.chunk_ends(_cache(scheme), 3)
    tokens = [(7 * i) % 50 for i in range(e2 + 3)]
    _, snaps = _fill(s, scheme, tokens, e2 + 3)
    n, c = s.longest_prefix(tokens, _cache(scheme))
    assert n == e2 and c.tokens == e2
    assert c.to_bytes() == snaps[e2]
    n, c = s.longest_prefix(tokens, _cache(scheme), limit=e2 - 1)
    assert n == e1 and c.to_bytes() == snaps[e1]
    other = list(tokens)
    other[e0 + 1] += 1
    assert s.longest_prefix(other, _cache(scheme))[0] == e0
    n, c = s.longest_prefix(np.array(tokens[:e0 - 1]), _cache(scheme))
    assert n == 0 and c.tokens == 0
    assert len(s.keys(tokens, _cache(scheme))) == 3
    assert s.warnings == []


def test_directory_store_and_a_corrupted_entry(tmp_path):
    s = kvq.PrefixStore(str(tmp_path / "store"), chunk_tokens=32)
    tokens = list(range(100))
    _, snaps = _fill(s, "kvq-4.5", tokens, 100)
    files = sorted((tmp_path / "store").glob("*.kvqr"))
    assert len(files) == 1  # chunks of 64 (groups of 64) after an offset of 16 (r16): one in 100 tokens
    b = bytearray(files[0].read_bytes())
    b[len(b) // 2] ^= 1
    files[0].write_bytes(bytes(b))
    s2 = kvq.PrefixStore(str(tmp_path / "store"), chunk_tokens=32)
    with pytest.warns(RuntimeWarning, match="unusable"):
        n, c = s2.longest_prefix(tokens, _cache("kvq-4.5"))
    assert n == 0 and len(s2.warnings) == 1
    _fill(s2, "kvq-4.5", tokens, 80)  # recomputed: overwritten
    n, c = kvq.PrefixStore(str(tmp_path / "store"), chunk_tokens=32).longest_prefix(tokens, _cache("kvq-4.5"))
    assert n == 80 and c.to_bytes() == snaps[80]


def test_bad_arguments_are_value_errors():
    s = kvq.PrefixStore("memory:bad", chunk_tokens=16)
    with pytest.raises(ValueError, match="tokens"):
        s.put([[1, 2]], _cache("q8_0"))
    with pytest.raises(ValueError, match="tokens"):
        s.put([-1] * 20, _cache("q8_0"))
    with pytest.raises(ValueError, match="cache"):
        s.put([1] * 20, "not a cache")
    with pytest.raises(ValueError, match="unsupported URL"):
        kvq.PrefixStore("ftp://x")
    with pytest.raises(ValueError, match="chunk_tokens"):
        kvq.PrefixStore("memory:", chunk_tokens=0)
    with pytest.raises(ValueError, match="model_fingerprint"):
        kvq.PrefixStore("memory:", model_fingerprint=b"short")


@pytest.fixture
def redis_url():
    p, url = start_redis()
    if p is None:
        if os.environ.get("KVQ_REQUIRE_DATA") == "1":
            pytest.fail("redis-server is not installed or does not start (scripts/install_deps.sh installs it)")
        pytest.skip("redis-server is not installed")
    yield url, p
    p.kill()
    p.wait()


def test_redis_store_and_a_server_that_dies(redis_url):
    url, proc = redis_url
    s = kvq.PrefixStore(url + "/2", chunk_tokens=32, ttl=60)
    tokens = list(range(200))
    _, snaps = _fill(s, "q8_0", tokens, 100)
    n, c = kvq.PrefixStore(url + "/2", chunk_tokens=32).longest_prefix(tokens, _cache("q8_0"))
    assert n == 96 and c.to_bytes() == snaps[96]
    proc.kill()
    proc.wait()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _fill(s, "q8_0", tokens, 200)  # puts after the server died: one warning, the run goes on
        n, _ = s.longest_prefix(tokens, _cache("q8_0"))
    assert n == 0 and not s.alive
    assert len([x for x in w if "continuing without the store" in str(x.message)]) == 1


def test_unreachable_redis_is_a_warning():
    with pytest.warns(RuntimeWarning, match="cannot connect"):
        s = kvq.PrefixStore(f"redis://user:pw123@127.0.0.1:{free_port()}")
    assert not s.alive and "pw123" not in s.warnings[0] and "pw123" not in repr(s)


def test_one_store_and_one_cache_shared_by_threads(redis_url):
    """One Redis store and one grouped cache used from four threads at once: writes and puts in one,
    attend / to_bytes / bytes / longest_prefix in the others. Calls on one object run one at a
    time, so nothing crashes and the cache ends as a single-threaded run leaves it."""
    import threading
    url, _ = redis_url
    s = kvq.PrefixStore(url, chunk_tokens=32)
    tokens = list(range(400))
    shared = _cache("kvq-4.5")
    rng = np.random.default_rng(0)
    rows = [(rng.standard_normal(H * HD).astype(np.float32), rng.standard_normal(H * HD).astype(np.float32))
            for _ in range(400)]
    done = threading.Event()
    errors = []

    def writer():
        try:
            for p in range(400):
                for layer in range(L):
                    shared.write(layer, p, *rows[p])
                s.put(tokens, shared)
        except Exception as e:  # noqa: BLE001 - the test reports whatever escaped
            errors.append(e)
        finally:
            done.set()

    def reader():
        q = np.ones((2 * H, HD), np.float32)
        try:
            while not done.is_set():
                try:  # between the writer's layers the layers' lengths differ: a clear error
                    if shared.tokens > 0:
                        shared.attend(q, 0)
                    shared.to_bytes()
                    shared.bytes()
                except kvq.Error as e:
                    assert "current length" in str(e) or "tokens" in str(e), e
                s.longest_prefix(tokens, _cache("kvq-4.5"))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    alone = _cache("kvq-4.5")
    for p in range(400):
        for layer in range(L):
            alone.write(layer, p, *rows[p])
    assert shared.to_bytes() == alone.to_bytes()
    assert s.warnings == [] and s.alive
    n, _ = s.longest_prefix(tokens, _cache("kvq-4.5"))
    assert n > 300


def test_a_secret_authenticates_chunks(tmp_path):
    """With a secret, chunks written without it, under another, or altered are misses (one
    warning each); with the right one they restore exactly."""
    d = str(tmp_path / "auth")
    tokens = list(range(100))
    keyed = kvq.PrefixStore(d, chunk_tokens=32, secret=b"k1")
    _, snaps = _fill(keyed, "q8_0", tokens, 100)
    n, c = kvq.PrefixStore(d, chunk_tokens=32, secret="k1").longest_prefix(tokens, _cache("q8_0"))
    assert n == 96 and c.to_bytes() == snaps[96]
    for other in (None, b"k2"):
        s = kvq.PrefixStore(d, chunk_tokens=32, secret=other)
        with pytest.warns(RuntimeWarning, match="unusable"):
            n, _ = s.longest_prefix(tokens, _cache("q8_0"))
        assert n == 0 and len(s.warnings) == 1
        if other is not None:
            assert "HMAC-SHA256" in s.warnings[0] and "k2" not in s.warnings[0]
    # Chunks rewritten by a writer without the secret (valid CRC, other K/V) are refused too.
    d2 = str(tmp_path / "auth2")
    _fill(kvq.PrefixStore(d2, chunk_tokens=32, secret=b"k1"), "q8_0", tokens, 100)
    _fill(kvq.PrefixStore(d2, chunk_tokens=32), "q8_0", tokens, 100, seed=9)  # overwrites every chunk
    s = kvq.PrefixStore(d2, chunk_tokens=32, secret=b"k1")
    with pytest.warns(RuntimeWarning, match="HMAC"):
        assert s.longest_prefix(tokens, _cache("q8_0"))[0] == 0
    with pytest.raises(ValueError, match="secret"):
        kvq.PrefixStore("memory:", secret=3)
