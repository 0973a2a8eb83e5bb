"""Shared plumbing of the kvq package: argument checks, numpy/torch in and out, per-object locks."""

import functools as _functools
import sys as _sys
import threading as _threading

import numpy as _np

from ._kvq import Error


def _lock_of(obj):
    """The object's own lock (created on first use; dict.setdefault is atomic under the GIL)."""
    return obj.__dict__.get("_lock") or obj.__dict__.setdefault("_lock", _threading.RLock())


def _locked(f):
    """Runs the method under the object's lock: calls on one kvq object from several threads run one
    at a time (the C++ objects are not safe to use concurrently, and the GIL is released inside)."""
    @_functools.wraps(f)
    def g(self, *args, **kwargs):
        with _lock_of(self):
            return f(self, *args, **kwargs)
    return g


def _locked_property(f, doc=None):
    return property(_locked(f), doc=doc)


_MODES = ("int8", "fp8")


# ---- array plumbing ------------------------------------------------------------

def _torch():
    """The torch module if the caller has imported it (kvq never imports it)."""
    return _sys.modules.get("torch")


def _is_torch(x):
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def _contiguous(a):
    # np.ascontiguousarray would turn a 0-d array into 1-d; keep the rank.
    return a if a.flags.c_contiguous else _np.ascontiguousarray(a)


def _input(x, arg):
    """(contiguous numpy array, dtype name, was_torch) for a real-valued input."""
    if _is_torch(x):
        torch = _torch()
        if x.device.type != "cpu":
            raise Error(f"{arg}: expected a CPU tensor, got device {x.device}")
        t = x.detach()
        if t.is_complex() or t.dtype == torch.bool:
            raise Error(f"{arg}: expected a real-valued tensor, got dtype {t.dtype}")
        if t.dtype == torch.bfloat16:
            return _contiguous(t.contiguous().view(torch.int16).numpy().view(_np.uint16)), "bfloat16", True
        if t.dtype not in (torch.float32, torch.float16):
            t = t.to(torch.float32)
        a = t.contiguous().numpy()
        return _contiguous(a), str(a.dtype), True
    try:
        a = _np.asarray(x)
    except Exception as e:  # ragged lists and the like
        raise Error(f"{arg}: expected an array-like of real numbers ({e})") from None
    if a.dtype.kind not in "fiu":
        raise Error(f"{arg}: expected a real-valued array, got dtype {a.dtype}")
    if a.dtype not in (_np.float32, _np.float16):
        a = a.astype(_np.float32)
    return _contiguous(a), str(a.dtype), False


def _output(a, as_torch):
    if a is None or not as_torch:
        return a
    return _torch().from_numpy(a)


def _numpy(x):
    """A numpy view/copy of an output-kind array (numpy or torch)."""
    if _is_torch(x):
        return x.detach().cpu().contiguous().numpy()
    return _np.asarray(x)


def _mode(mode):
    if mode not in _MODES:
        raise Error(f"mode: expected 'int8' or 'fp8', got {mode!r}")
    return mode


def _int(v, arg, lo=-2 ** 31, hi=2 ** 31 - 1):
    """An int that fits the C++ parameter it is passed to (int32 unless told)."""
    if isinstance(v, bool) or not isinstance(v, (int, _np.integer)):
        raise Error(f"{arg}: expected an integer, got {v!r}")
    if not lo <= int(v) <= hi:
        raise Error(f"{arg}: expected an integer in [{lo}, {hi}], got {int(v)}")
    return int(v)


def _str(v, arg):
    if not isinstance(v, str):
        raise Error(f"{arg}: expected a string, got {v!r}")
    return v


def _float(v, arg):
    if isinstance(v, bool) or not isinstance(v, (int, float, _np.integer, _np.floating)):
        raise Error(f"{arg}: expected a number, got {v!r}")
    return float(v)


def _indices(x, arg):
    a = _numpy(x)
    if a.size == 0:
        return _np.zeros(0, dtype=_np.int64)
    if a.dtype.kind not in "iu":
        raise Error(f"{arg}: expected integer token positions, got dtype {a.dtype}")
    return _np.ascontiguousarray(a.astype(_np.int64))


def _flatten_batch(a):
    """(b, t, n_head, d_head) -> (b*t, n_head, d_head); other ranks unchanged."""
    return a.reshape(-1, a.shape[-2], a.shape[-1]) if a.ndim == 4 else a


def _f32(x, arg):
    """(float32 C-contiguous numpy array, was_torch) of a real-valued input."""
    a, dt, as_torch = _input(x, arg)
    if dt == "bfloat16":  # uint16 bit patterns: the upper half of a float32
        a = (a.astype(_np.uint32) << 16).view(_np.float32)
    elif dt != "float32":
        a = a.astype(_np.float32)
    return _contiguous(a), as_torch
