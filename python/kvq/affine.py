"""I2 part 1: affine int8 / fp8 KV quantization (kvq/affine.h)."""

from . import _kvq
from ._kvq import Error
from ._util import _is_torch, _contiguous, _input, _output, _numpy, _mode, _float


# ---- I2 part 1 -------------------------------------------------------------------

class AffineQuantized:
    """Quantized codes plus the per-tensor scale needed to dequantize them.

    codes: int8 (mode 'int8') or uint8 E4M3FN bit patterns (mode 'fp8'),
        numpy or torch, the shape of the input.
    scale: for int8 max(|x|) / 127 (dequant = codes * scale); for fp8 1.0.
    mode: 'int8' or 'fp8'.
    """

    __slots__ = ("codes", "scale", "mode")

    def __init__(self, codes, scale, mode):
        self.codes = codes
        self.scale = _float(scale, "scale")
        self.mode = _mode(mode)

    @property
    def size_bytes(self):
        """Bytes stored: the codes plus the float32 scale."""
        return int(_numpy(self.codes).nbytes) + 4

    def __repr__(self):
        return f"AffineQuantized(mode={self.mode!r}, scale={self.scale!r}, shape={tuple(self.codes.shape)})"


def quantize_kv_cache(x, *, mode="int8"):
    """Quantize a K or V tensor (any shape, rank >= 1) to int8 or fp8.

    int8: symmetric per-tensor affine, scale = max(|x|) / 127 (float32),
    codes = clamp(round_half_even(x / scale), -127, 127) with a true division;
    an all-zero input stores scale 0 and zero codes. fp8: the E4M3FN cast of x
    (saturating at +-448) with scale 1.0; codes are uint8 bit patterns.
    NaN/Inf raise ValueError naming the first bad flat index.
    """
    a, dt, as_torch = _input(x, "x")
    codes, scale, m = _kvq.quantize_kv_cache(a, dt, _mode(mode))
    return AffineQuantized(_output(codes, as_torch), scale, m)


def dequantize_kv_cache(q):
    """Inverse of quantize_kv_cache: float32 of the original shape (codes * scale)."""
    if not isinstance(q, AffineQuantized):
        raise Error(f"q: expected an AffineQuantized, got {type(q).__name__}")
    codes = q.codes
    as_torch = _is_torch(codes)
    c = _contiguous(_numpy(codes))
    return _output(_kvq.dequantize_kv_cache(c, q.scale, _mode(q.mode)), as_torch)


def quantization_error_per_token(x, *, mode="int8"):
    """Mean absolute quantize/dequantize round-trip error of each leading-axis row.

    x: (n_tokens, ...) -> (n_tokens,) float32, using quantize_kv_cache(x, mode=mode).
    """
    a, dt, as_torch = _input(x, "x")
    return _output(_kvq.quantization_error_per_token(a, dt, _mode(mode)), as_torch)
