"""The SIMD target kvq's kernels run on (kvq/targets.h)."""

from . import _kvq


# ---- SIMD targets ---------------------------------------------------------------

def simd_target():
    """The Highway target kvq's kernels dispatch to now (e.g. "AVX3_DL", "AVX2", "NEON").

    KVQ_TARGETS (read once) or set_simd_targets limits it."""
    return _kvq.simd_target()


def set_simd_targets(name):
    """Limits dispatch to the Highway target `name` and the weaker ones below it ("" = all).

    Raises kvq.Error for an unknown name or one this CPU cannot run."""
    _kvq.set_simd_targets(str(name))


def supported_simd_targets():
    """Every compiled target this CPU supports now, best first."""
    return list(_kvq.supported_simd_targets())
