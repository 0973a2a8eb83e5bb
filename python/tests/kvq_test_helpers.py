"""Helpers shared by the kvq module's test files (imported from their directory)."""

import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("KVQ_SHARED", os.environ.get("KVQ_DEFAULT_SHARED", ROOT.parent / "shared")))
MODEL = SHARED / "models" / "stories260K" / "stories260K.bin"
TOKENIZER = SHARED / "models" / "stories260K" / "tok512.bin"


def need_data():
    """Skips without ../shared's model; fails instead under KVQ_REQUIRE_DATA=1."""
    if not MODEL.exists():
        if os.environ.get("KVQ_REQUIRE_DATA") == "1":
            pytest.fail(f"KVQ_REQUIRE_DATA=1 but {MODEL} is missing")
        pytest.skip(f"{MODEL} not found (set KVQ_SHARED)")


def kvq_cli():
    """The kvq binary of the build tree the module was imported from (skips when not built)."""
    import kvq
    exe = Path(kvq.__file__).resolve().parents[2] / "kvq"
    if not exe.exists():
        pytest.skip(f"{exe} not built")
    return exe


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
