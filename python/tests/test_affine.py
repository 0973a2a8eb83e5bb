"""I2 part 1: quantize_kv_cache / dequantize_kv_cache against the note's formula (kvq/affine.py)."""

import numpy as np

import kvq
from kvq_test_helpers import e4m3_table, note_int8


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
