"""Which implementation of an op runs where — one rule for every dispatcher in pallas_kernels."""

from __future__ import annotations

import jax

IMPLS = ("auto", "pallas", "reference")
_ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


def resolve_impl(impl: str, op: str, extra: tuple = ()) -> str:
    """'auto' | 'pallas' | 'reference' (| extra, e.g. 'interpret_tpu' for tests) -> 'reference' | 'gpu' | 'tpu' |
    'interpret' | an extra name. auto = the Pallas kernel on GPU/TPU, the reference on CPU; 'pallas' on CPU runs the
    GPU kernel in the Pallas interpreter (slow; for tests)."""
    if impl not in IMPLS + tuple(extra):
        raise ValueError(f"{op} impl must be one of {IMPLS}, got {impl!r}")
    if impl in extra:
        return impl
    plat = jax.default_backend()
    if impl == "reference" or (impl == "auto" and plat not in _ACCELERATORS):
        return "reference"
    if plat in ("gpu", "cuda"):
        return "gpu"
    if plat == "tpu":
        return "tpu"
    return "interpret"
