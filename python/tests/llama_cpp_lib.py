"""llama.cpp as a test oracle: node-llama-cpp 3.21.1's prebuilt CPU libraries (installed from npm into
build/oracles by scripts/install_deps.sh with KVQ_WITH_ORACLES=1; never a dependency of kvq), called
through ctypes: libggml-base's quantizers and reference dequantisers, libllama's llama_model_quantize.
Without them a test skips with the reason; under KVQ_REQUIRE_DATA=1 (CI) it fails."""
import ctypes
import json
import os
import platform
import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
ORACLES = Path(os.environ.get("KVQ_ORACLES", ROOT / "build" / "oracles"))
VERSION = "3.21.1"


def _unavailable(why):
    if os.environ.get("KVQ_REQUIRE_DATA") == "1":
        pytest.fail(f"llama.cpp oracle unavailable: {why}")
    pytest.skip(f"llama.cpp oracle unavailable: {why}")


def npm_module(name, version=None, need_node=True):
    """build/oracles/node_modules/<name> (installed by KVQ_WITH_ORACLES=1 scripts/install_deps.sh), at
    `version` when given; skips (or fails under KVQ_REQUIRE_DATA=1) without it or without node."""
    mod = ORACLES / "node_modules" / name
    why = None
    if need_node and shutil.which("node") is None:
        why = "node is not installed"
    elif not (mod / "package.json").exists():
        why = f"{mod} is missing (KVQ_WITH_ORACLES=1 bash scripts/install_deps.sh installs it from npm)"
    elif version and json.loads((mod / "package.json").read_text())["version"] != version:
        why = f"{mod}: expected {name} {version}"
    if why:
        _unavailable(why)
    return mod


def oracle_dir(need_node=True):
    """build/oracles, holding node_modules/node-llama-cpp at the pinned version."""
    npm_module("node-llama-cpp", VERSION, need_node)
    return ORACLES


# ggml type ids and the llama_ftype that makes each (llama.h), block sizes (ggml-common.h).
TYPES = {  # name: (ggml type id, block, bytes per block, llama_ftype with every matrix in it)
    "F32": (0, 1, 4, 0), "F16": (1, 1, 2, 1), "Q4_0": (2, 32, 18, 2), "Q4_1": (3, 32, 20, 3),
    "Q5_0": (6, 32, 22, 8), "Q5_1": (7, 32, 24, 9), "Q8_0": (8, 32, 34, 7), "Q2_K": (10, 256, 84, 10),
    "Q3_K": (11, 256, 110, 12), "Q4_K": (12, 256, 144, 15), "Q5_K": (13, 256, 176, 17),
    "Q6_K": (14, 256, 210, 18), "IQ4_NL": (20, 32, 18, 25), "IQ4_XS": (23, 256, 136, 30), "BF16": (30, 1, 2, 32),
}
FTYPE_Q4_K_M = 15


class _QuantizeParams(ctypes.Structure):  # llama.h's llama_model_quantize_params (v0.4.0)
    _fields_ = [("nthread", ctypes.c_int32), ("ftype", ctypes.c_int), ("output_tensor_type", ctypes.c_int),
                ("token_embedding_type", ctypes.c_int), ("allow_requantize", ctypes.c_bool),
                ("quantize_output_tensor", ctypes.c_bool), ("only_copy", ctypes.c_bool), ("pure", ctypes.c_bool),
                ("keep_split", ctypes.c_bool), ("dry_run", ctypes.c_bool), ("imatrix", ctypes.c_void_p),
                ("kv_overrides", ctypes.c_void_p), ("tt_overrides", ctypes.c_void_p),
                ("prune_layers", ctypes.c_void_p), ("max_buf_size", ctypes.c_size_t)]


class Llama:
    """libggml-base + libllama of node-llama-cpp's linux-x64 CPU build."""

    def __init__(self):
        if platform.system() != "Linux" or platform.machine() != "x86_64":
            _unavailable(f"the oracle's prebuilt libraries are linux-x64; this is {platform.machine()}")
        bins = oracle_dir(need_node=False) / "node_modules" / "@node-llama-cpp" / "linux-x64" / "bins" / "linux-x64"
        try:
            self.ggml = ctypes.CDLL(str(bins / "libggml-base.so"))
            self.llama = ctypes.CDLL(str(bins / "libllama.v0.4.0.so"))
        except OSError as e:
            _unavailable(f"{bins}: {e}")
        g = self.ggml
        g.ggml_quantize_chunk.restype = ctypes.c_size_t
        g.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                          ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        g.ggml_quantize_init.argtypes = [ctypes.c_int]
        self.llama.llama_model_quantize_default_params.restype = _QuantizeParams
        self.llama.llama_model_quantize.restype = ctypes.c_uint32
        self.llama.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                                    ctypes.POINTER(_QuantizeParams)]
        self.llama.llama_backend_init()

    def quantize(self, name, x):
        """Rows of x (float32, (rows, n)) in ggml type `name`, as ggml's own quantizer writes them."""
        ty, block, nbytes, _ = TYPES[name]
        x = np.ascontiguousarray(x, dtype=np.float32)
        rows, n = x.shape
        assert n % block == 0
        out = ctypes.create_string_buffer(rows * n // block * nbytes)
        self.ggml.ggml_quantize_init(ty)
        got = self.ggml.ggml_quantize_chunk(ty, x.ctypes.data, out, 0, rows, n, None)
        assert got == len(out.raw), (name, got, len(out.raw))
        return out.raw

    def dequantize(self, name, data, n):
        """n values of `data` in ggml type `name` through ggml's reference dequantize_row_<type>."""
        fn = getattr(self.ggml, {"F16": "ggml_fp16_to_fp32_row", "BF16": "ggml_bf16_to_fp32_row"}.get(
            name, "dequantize_row_" + name.lower().replace("_k", "_K")))
        fn.restype = None
        fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int64]
        out = np.empty(n, np.float32)
        fn(bytes(data), out.ctypes.data, n)
        return out

    def quantize_model(self, src, dst, ftype, pure=True, requantize=False):
        """llama_model_quantize(src -> dst): every matrix in ftype (pure) or llama.cpp's own mix."""
        p = self.llama.llama_model_quantize_default_params()
        p.nthread, p.ftype, p.pure, p.allow_requantize = 2, ftype, pure, requantize
        rc = self.llama.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
        assert rc == 0, f"llama_model_quantize({src} -> {dst}, ftype {ftype}) returned {rc}"


# The activation format ggml pairs with each weight type (ggml-cpu.c's type_traits_cpu vec_dot_type).
ACTIVATION = {"Q4_0": "q8_0", "Q4_1": "q8_1", "Q5_0": "q8_0", "Q5_1": "q8_1", "Q8_0": "q8_0", "IQ4_NL": "q8_0",
              "Q2_K": "q8_K", "Q3_K": "q8_K", "Q4_K": "q8_K", "Q5_K": "q8_K", "Q6_K": "q8_K", "IQ4_XS": "q8_K"}
ACTIVATION_BYTES = {"q8_0": (32, 34), "q8_1": (32, 36), "q8_K": (256, 292)}
# The CPU flags each of ggml's x86 CPU variants needs (ggml-cpu/arch/x86/cpu-feats.cpp's scores).
_VARIANT_FLAGS = {
    "x64": set(), "haswell": {"avx2", "fma", "f16c", "bmi2"},
    "skylakex": {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"},
    "icelake": {"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw",
                "avx512vbmi", "avx512_vnni"},
}


def cpu_flags():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


class GgmlCpu:
    """One of libggml-cpu's x86 variants (node-llama-cpp's linux-x64 build): its activation quantizers and
    quantized dot products, ggml_vec_dot_<type>_<fmt> (the variant's SIMD code) and ..._generic (ggml's
    plain C). Variant "x64" is built for baseline x86-64 (no FMA): its generic code's float operations are
    those written in the source."""

    def __init__(self, variant):
        Llama()  # libggml-base loaded (the variant links against it), or skip / fail with the reason
        bins = ORACLES / "node_modules" / "@node-llama-cpp" / "linux-x64" / "bins" / "linux-x64"
        if not _VARIANT_FLAGS[variant] <= cpu_flags():
            pytest.skip(f"this CPU cannot run ggml's {variant} variant")
        ctypes.CDLL(str(bins / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        try:
            self.lib = ctypes.CDLL(str(bins / f"libggml-cpu-{variant}.so"))
        except OSError as e:
            _unavailable(f"libggml-cpu-{variant}.so: {e}")
        self.base = ctypes.CDLL(str(bins / "libggml-base.so"))
        self.lib.ggml_cpu_init()
        self.variant = variant

    def quantize_activation(self, weight_type, x):
        """x (float32, one row) as ggml's quantize_row_<fmt>_ref writes it (libggml-base)."""
        fmt = ACTIVATION[weight_type]
        block, nbytes = ACTIVATION_BYTES[fmt]
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = ctypes.create_string_buffer(len(x) // block * nbytes)  # zeroed: q8_K leaves a zero block's sums unwritten
        fn = getattr(self.base, f"quantize_row_{fmt}_ref")
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        fn(x.ctypes.data, out, len(x))
        return out.raw

    def vec_dot(self, weight_type, row, activation, n, generic=False):
        """ggml_vec_dot_<type>_<fmt>(_generic) of one weight row with an activation (bytes)."""
        name = f"ggml_vec_dot_{weight_type.lower().replace('_k', '_K')}_{ACTIVATION[weight_type]}"
        fn = getattr(self.lib, name + ("_generic" if generic else ""))
        fn.restype = None
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t,
                       ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
        s = ctypes.c_float()
        fn(n, ctypes.byref(s), 0, bytes(row), 0, bytes(activation), 0, 1)
        return s.value
