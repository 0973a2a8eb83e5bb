"""kvq's integer path for quantized weights (kvq/ggml_weights.h: quantize_activation, matvec_int) against
llama.cpp's own (llama_cpp_lib.GgmlCpu: node-llama-cpp 3.21.1's libggml-cpu variants through ctypes).

- The activation: byte for byte what ggml's quantize_row_q8_0_ref / q8_1_ref / q8_K_ref write.
- The dot product, on ggml's own activation bytes, rows ggml's quantizer wrote and rows of random bytes:
  - bit for bit ggml's generic C (the x64 variant, built without FMA) for every type where kvq scales each
    block's integer sum as ggml's generic code does (Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, IQ4_XS; Q4_0,
    Q4_K, Q5_K and Q6_K sum in 8 lanes, the kernels' int32 lanes; Q3_K scales each block's total once);
  - for every type, within 2 gamma_k B of ggml's generic and of each SIMD variant this CPU runs, where B
    bounds the absolute value of every float term either side adds (sum_j (|w_j| + 2 |m_j|) |x^_j|, m_j
    the min part of a K-quant / Q4_1 / Q5_1 value, x^_j the activation as rounded) and k = 16 nb + 8
    roundings (nb blocks a row): both are the same exact per-block integers times the same float scales,
    added in different orders (Higham 3.1). A code paired with the wrong activation breaks it by orders
    of magnitude.
"""
import numpy as np
import pytest

import kvq
from llama_cpp_lib import ACTIVATION, TYPES, GgmlCpu, Llama

QUANTIZED = [t for t in TYPES if t not in ("F32", "F16", "BF16")]
# kvq scales each block's integer sum as ggml's generic dot does for these (the same expression).
PER_BLOCK = {"Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "IQ4_XS"}
# Byte ranges of a block's codes (zeroed to read its min part), for the types with a min.
# The fp16 scale fields of a block (ggml-common.h).
SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
          "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}
CODES = {"Q4_1": (4, 20), "Q5_1": (4, 24), "Q2_K": (16, 80), "Q4_K": (16, 144), "Q5_K": (16, 176)}


@pytest.fixture(scope="module")
def llama():
    return Llama()


@pytest.fixture(scope="module")
def generic():
    return GgmlCpu("x64")


def _rows(llama, name, rows, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[1] *= 1e-3
    x[2, ::37] *= 40.0
    x[3, : n // 2] = 0.0
    return llama.quantize(name, x)


def _random_rows(name, rows, n, seed):
    """Random code bytes with finite scales (every code pattern)."""
    ty, block, nbytes, _ = TYPES[name]
    rng = np.random.default_rng(seed)
    data = bytearray(rng.integers(0, 256, size=rows * n // block * nbytes, dtype=np.uint8).tobytes())
    for b in range(rows * n // block):
        for off in SCALES[name]:
            v = np.float16(rng.uniform(1e-3, 0.05) * rng.choice([-1, 1]))
            data[b * nbytes + off: b * nbytes + off + 2] = v.tobytes()
    return bytes(data)


def _activation(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    x[::97] *= 40.0
    x[:32] = 0.0          # a zero block (Q8_0) / part of one (Q8_K)
    x[32:256] *= 1e-6     # tiny values
    return x


def _act_values(name, act, n):
    """The activation as rounded, x^_j = d q_j, float64."""
    fmt = ACTIVATION[name]
    b = np.frombuffer(act, np.uint8)
    if fmt == "q8_K":
        blocks = b.reshape(n // 256, 292)
        d = blocks[:, :4].copy().view(np.float32)[:, 0].astype(np.float64)
        q = blocks[:, 4:260].copy().view(np.int8).astype(np.float64)
    else:
        off = 2 if fmt == "q8_0" else 4
        blocks = b.reshape(n // 32, 32 + off)
        d = blocks[:, :2].copy().view(np.float16)[:, 0].astype(np.float64)
        q = blocks[:, off:].copy().view(np.int8).astype(np.float64)
    return (q * d[:, None]).reshape(-1)


def _magnitude(name, row, act, n):
    """B: a bound on |every float term| of either sum (module docstring)."""
    ty, block, nbytes, _ = TYPES[name]
    w = np.abs(kvq.dequantize_ggml(ty, row, n).astype(np.float64))
    if name in CODES:
        lo, hi = CODES[name]
        z = bytearray(row)
        for b in range(n // block):
            z[b * nbytes + lo: b * nbytes + hi] = bytes(hi - lo)
        w += 2 * np.abs(kvq.dequantize_ggml(ty, bytes(z), n).astype(np.float64))
    return float(np.sum(w * np.abs(_act_values(name, act, n))))


def _tol(name, row, act, n):
    nb = n // TYPES[name][1]
    u = 2.0 ** -24
    k = 16 * nb + 8
    return 2 * k * u / (1 - k * u) * _magnitude(name, row, act, n)


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_activation_is_rounded_as_ggml_rounds_it(generic, name):
    ty = TYPES[name][0]
    for n, seed in ((256, 1), (4096, 2)):
        x = _activation(n, seed)
        assert kvq.quantize_activation(ty, x) == generic.quantize_activation(name, x), (name, n)


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_dot_product_is_ggmls(llama, generic, name):
    ty, block, nbytes, _ = TYPES[name]
    n, rows = 4096, 8
    row_bytes = n // block * nbytes
    for data in (_rows(llama, name, rows, n, ty), _random_rows(name, rows, n, 50 + ty)):
        x = _activation(n, ty)
        act = generic.quantize_activation(name, x)
        ours = kvq.dot_ggml_int(ty, data, act, n)
        worst = 0.0
        for i in range(rows):
            row = data[i * row_bytes:(i + 1) * row_bytes]
            theirs = generic.vec_dot(name, row, act, n, generic=True)
            if name in PER_BLOCK:
                assert np.float32(theirs).view(np.uint32) == ours[i].view(np.uint32), (name, i, ours[i], theirs)
            tol = _tol(name, row, act, n)
            assert abs(float(ours[i]) - theirs) <= tol, (name, i, ours[i], theirs, tol)
            worst = max(worst, abs(float(ours[i]) - theirs) / tol)
        # not vacuous: the dot products are far from zero against the bound
        assert np.abs(ours).max() > 10 * _tol(name, data[:row_bytes], act, n)


@pytest.mark.parametrize("variant", ["haswell", "skylakex", "icelake"])
def test_the_dot_product_is_within_the_bound_of_ggmls_simd_code(llama, variant):
    cpu = GgmlCpu(variant)
    for name in QUANTIZED:
        ty, block, nbytes, _ = TYPES[name]
        n, rows = 4096, 8
        row_bytes = n // block * nbytes
        data = _rows(llama, name, rows, n, 7 + ty)
        act = cpu.quantize_activation(name, _activation(n, ty))
        ours = kvq.dot_ggml_int(ty, data, act, n)
        for i in range(rows):
            row = data[i * row_bytes:(i + 1) * row_bytes]
            theirs = cpu.vec_dot(name, row, act, n)
            assert abs(float(ours[i]) - theirs) <= _tol(name, row, act, n), (variant, name, i, ours[i], theirs)


def test_the_integer_path_refuses_bad_arguments():
    q4k = _random_rows("Q4_K", 2, 256, 3)
    act = kvq.quantize_activation(12, np.ones(256, np.float32))
    for call, msg in ((lambda: kvq.quantize_activation(0, np.ones(256)), "integer path"),
                      (lambda: kvq.quantize_activation(12, np.ones(255)), "multiple of 256"),
                      (lambda: kvq.quantize_activation(12, np.ones((2, 256))), "one row"),
                      (lambda: kvq.dot_ggml_int(12, q4k[:-1], act, 256), "whole rows"),
                      (lambda: kvq.dot_ggml_int(12, q4k, act[:-1], 256), "activation: expected 292"),
                      (lambda: kvq.dot_ggml_int(12, q4k, act, 128), "multiple of 256"),
                      (lambda: kvq.dot_ggml_int(1, q4k, act, 256), "integer path")):
        with pytest.raises(ValueError) as e:
            call()
        assert msg in str(e.value), str(e.value)


def test_the_decode_script_runs_both_engines_on_a_quantized_file(llama, tmp_path):
    """scripts/llama_cpp_decode.py end to end on a small Q4_K_M file (docs/performance.md's table): both
    engines and both weight paths report rates, and kvq's report says which path ran."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from kvq_test_helpers import kvq_cli
    from test_ggml_weights import SMALL, gw
    from llama_cpp_lib import FTYPE_Q4_K_M, ORACLES, oracle_dir
    oracle_dir()
    exe = kvq_cli()
    bench = exe.parent / "bench" / "kvq_bench"
    if not bench.exists():
        pytest.skip(f"{bench} not built")
    f32, q = tmp_path / "f32.gguf", tmp_path / "q4km.gguf"
    g, _ = gw.synthetic(SMALL, 3, keep_reference=False)
    g.write(str(f32))
    llama.quantize_model(f32, q, FTYPE_Q4_K_M, pure=False)
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "decode.json"
    r = subprocess.run([sys.executable, str(root / "scripts" / "llama_cpp_decode.py"), "--model", str(q),
                        "--prompt-tokens", "32", "--max-tokens", "8", "--reps", "1", "--kvq", str(exe), "--bench",
                        str(bench), "--oracles", str(ORACLES), "--json", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [x["engine"] for x in rows] == ["llama.cpp", "kvq int8", "kvq exact"], rows
    for x in rows:
        assert x["prefill_tok_s"] > 0 and x["decode_tok_s"] > 0 and x["R"] > 0, x
    assert "| q4km.gguf | 1 | kvq int8 |" in r.stdout, r.stdout
    # --avx2: llama.cpp's loaded CPU variant is haswell (the script exits otherwise), kvq runs KVQ_TARGETS=AVX2.
    r = subprocess.run([sys.executable, str(root / "scripts" / "llama_cpp_decode.py"), "--model", str(q), "--avx2",
                        "--weight-dot", "int8", "--prompt-tokens", "32", "--max-tokens", "8", "--reps", "1", "--kvq",
                        str(exe), "--bench", str(bench), "--oracles", str(ORACLES), "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [x["engine"] for x in rows] == ["llama.cpp", "kvq int8"] and all(x["avx2_only"] for x in rows), rows
    assert "both engines held to AVX2" in r.stdout, r.stdout


def test_generate_defaults_to_the_integer_path_and_says_so(llama, tmp_path):
    """kvq.generate (the session behind `kvq generate`) multiplies quantized weights through int8 unless told
    exact, reports which, and refuses another name naming --weight-dot."""
    from test_ggml_weights import SMALL, gw
    from llama_cpp_lib import FTYPE_Q4_K_M
    f32, q = tmp_path / "f32.gguf", tmp_path / "q4km.gguf"
    g, _ = gw.synthetic(SMALL, 3, keep_reference=False)
    g.write(str(f32))
    llama.quantize_model(f32, q, FTYPE_Q4_K_M, pure=False)
    ids = [1] + list(range(5, 40))
    r8 = kvq.generate(str(q), tokens=ids, steps=48)
    rx = kvq.generate(str(q), tokens=ids, steps=48, weight_dot="exact")
    assert r8["weight_dot"] == "int8" and rx["weight_dot"] == "exact"
    assert len(r8["ids"]) == len(rx["ids"]) > len(ids)
    with pytest.raises(ValueError, match="--weight-dot"):
        kvq.generate(str(q), tokens=ids, steps=48, weight_dot="fp8")
